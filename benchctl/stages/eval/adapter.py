"""`BenchctlLM`: a benchctl checkpoint (any architecture) as an lm-eval `TemplateLM`, registered as model "benchctl".

- Tokens: the run's SentencePiece tokenizer. Training data is `[BOS] + story` with no EOS, and a model ends a story
  by emitting BOS, so BOS (id 1) is both the end-of-text token (`eot_token_id`) and the prefix of every context.
- `_loglikelihood_tokens`: requests sorted by length (lm-eval's `Collator`), right-padded, one forward per batch.
  A context + continuation longer than the model's context keeps its last `max_seq_len` tokens (HF's left
  truncation); a continuation longer than the context itself is scored in consecutive pieces of at most
  `max_seq_len` tokens, each conditioned on everything before it (left-truncated), and the pieces are summed.
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows over the model's context
  (`get_rolling_token_windows(context_len=1)` + `make_disjoint_window`, as HF does), BOS as the first window's prefix.
- `generate_until`: KV-cached greedy (temperature 0) or temperature sampling, stopping at BOS, at any stop sequence
  or after `max_gen_toks`; contexts are left-truncated to the model's context and the window slides beyond it (as
  `BaseLM.generate`). Requests are batched only with requests of the same token length (the models take no mask).
- `n_recur`: the test-time recurrence (validated by the architecture: control only 1, FraiLT / relaxed at most the
  trained R, three-part any r >= 1).
- Determinism: three-part draws a random initial state on every forward. Every forward therefore runs under
  `torch.random.fork_rng` seeded with `seed` mixed with a hash of the batch's tokens: the same requests with the same
  batch size give bit-identical log-likelihoods in any order and process, and the global torch RNG is left untouched.
  (A different batch size changes padding and so three-part's noise: `batch_size` is stored with every result.)
- Precision: the weights are cast once to `dtype` (float32 unless given; `benchctl eval` passes the precision the
  decode benchmark measured fastest on the device, or the user's `--precision`), never autocast per call.
- Progress: one task per request type on the `Progress` it is given (lm-eval's own "Tokenizing" bar is not drawn).
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from architectures.generate import cast_for_inference, generate
from benchctl.core import data as datamod
from benchctl.core.checkpoint import load_model
from benchctl.core.progress import Progress, as_progress
from benchctl.core.runtime import INFERENCE_DTYPES, resolve_device
from benchctl.stages.eval.options import DEFAULT_BATCH_SIZE

DEFAULT_SEED = 1234  # seed mixed into every forward (three-part's random initial state)


def _as_int(name: str, value: Any, minimum: int = 1) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def adapter_precision(dtype: str | None) -> tuple[str, str]:
    """(dtype name, reason) of the adapter's weights for its `dtype` argument: float32 unless one is named."""
    name = "float32" if dtype in (None, "", "auto") else str(dtype)
    if name not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(INFERENCE_DTYPES)}; got {dtype!r}")
    return name, f"set: dtype={name}" if name == dtype else "default: float32"


@register_model("benchctl")
class BenchctlLM(TemplateLM):
    """A benchctl checkpoint (any architecture) as an lm-eval language model."""

    backend = "causal"

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        n_recur: int | str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_batch_size: int | None = None,  # accepted because simple_evaluate passes it; batches are fixed-size
        device: str | None = "auto",
        max_gen_toks: int | str = 256,
        seed: int | str = DEFAULT_SEED,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: datamod.Tokenizer | None = None,
        progress: bool | Progress = True,
        dtype: str | None = None,
        dtype_reason: str | None = None,
    ) -> None:
        super().__init__()
        self._device = resolve_device(device or "auto", option="--device")
        if model is None:
            if checkpoint is None:
                raise ValueError("benchctl model needs checkpoint=PATH (a run's ckpt.pt)")
            model, cfg, tok_path = load_model(Path(checkpoint), self._device)
            tokenizer = datamod.Tokenizer(tok_path)
            self.arch = cfg.arch
        else:
            if tokenizer is None:
                raise ValueError("BenchctlLM(model=...) also needs tokenizer=")
            model = model.to(self._device).eval()
            self.arch = getattr(model, "name", type(model).__name__)
        # The weights are cast once (no autocast re-casting them at every call); `benchctl eval` passes the precision
        # chosen from the decode benchmark's measurements, anything else gets float32 unless it names one. The
        # log-probabilities are computed in fp32 either way.
        name, why = adapter_precision(dtype)
        self.dtype, self.dtype_reason = name, dtype_reason or why
        model = cast_for_inference(model, INFERENCE_DTYPES[name])
        self.model = model
        self.tok = tokenizer
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        # Raises architectures.RecurrenceError (a ValueError) when the architecture cannot run this recurrence.
        self.n_recur = model.resolve_n_recur(None if n_recur in (None, "") else _as_int("n_recur", n_recur))
        self._batch_size = _as_int("batch_size", DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
        self._max_gen_toks = _as_int("max_gen_toks", max_gen_toks)
        self.seed = _as_int("seed", seed, minimum=0)
        self.progress = as_progress(progress)

    # ---- what lm-eval asks of a TemplateLM ---------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.bos_id  # stories end where the next one's BOS begins

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id

    @property
    def max_length(self) -> int:
        return int(self.model.args.max_seq_len)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids; BOS first unless add_special_tokens is False (contexts are prefixed with BOS, as in training)."""
        ids = self.tok.encode(string, bos=add_special_tokens is not False, eos=False)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        return {
            "benchctl_checkpoint": self.checkpoint,
            "arch": self.arch,
            "n_recur": self.n_recur,
            "max_length": self.max_length,
            "benchctl_seed": self.seed,
        }

    # ---- forward passes ------------------------------------------------------------------------------------------

    def _batch_seed(self, tokens: torch.Tensor) -> int:
        digest = zlib.crc32(tokens.detach().cpu().numpy().tobytes()) ^ (tokens.shape[0] << 20) ^ tokens.shape[1]
        return (self.seed * 1_000_003 + digest) % (2**63 - 1)

    @contextlib.contextmanager
    def _seeded(self, tokens: torch.Tensor) -> Iterator[None]:
        """Seed torch from the batch content for the duration of a forward; the global RNG state is restored."""
        devices = [self._device.index or 0] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self._batch_seed(tokens))
            yield

    @torch.no_grad()
    def _logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> log-probabilities (B, T, V), float32."""
        with self._seeded(tokens):
            logits, _ = self.model(tokens.to(self._device), n_recur=self.n_recur)  # (B, T, V)
        return F.log_softmax(logits.float(), dim=-1)

    # ---- loglikelihood -------------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's "Tokenizing inputs" bar is noise next to ours (on `self.progress`).
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, override_bs: int | None = None, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """[(request key, context ids, continuation ids)] -> [(sum log p(continuation | context), is greedy)]."""
        L = self.max_length
        # A continuation longer than the context is scored in pieces of <= L tokens, each after all that precedes it.
        pieces: list[tuple[int, list[int], list[int]]] = []
        for i, (_, ctx, cont) in enumerate(requests):
            if not ctx:
                raise ValueError("empty context: lm-eval always passes at least the prefix token")
            for j in range(0, len(cont), L):
                pieces.append((i, ctx + cont[:j], cont[j : j + L]))
        coll = Collator(pieces, sort_fn=lambda p: (-(len(p[1]) + len(p[2])), tuple(p[1] + p[2])))
        piece_res: list[tuple[float, bool]] = []
        with self.progress.task("loglikelihood", total=len(pieces)) as bar:
            for chunk in coll.get_batched(n=override_bs or self.batch_size):
                piece_res += self._score(chunk)
                bar.update(advance=len(chunk))
        piece_res = coll.get_original(piece_res)
        totals = [[0.0, True] for _ in requests]
        for (i, _, _), (ll, greedy) in zip(pieces, piece_res, strict=True):
            totals[i][0] += ll
            totals[i][1] = totals[i][1] and greedy
        out = [(ll, greedy) for ll, greedy in totals]
        for (key, _, _), answer in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def _score(self, chunk: list[tuple[int, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward over a batch of (owner, context, continuation) pieces -> (log-likelihood, is greedy) each."""
        L = self.max_length
        # Keep the last L+1 tokens (HF's left truncation); the input drops the last, which is only predicted.
        inps = [(ctx + cont)[-(L + 1) :][:-1] for _, ctx, cont in chunk]
        T = max(len(x) for x in inps)
        batch = torch.full((len(inps), T), self.eot_token_id, dtype=torch.long)  # right padding, (B, T)
        for r, x in enumerate(inps):
            batch[r, : len(x)] = torch.tensor(x, dtype=torch.long)
        logp = self._logprobs(batch).cpu()  # (B, T, V); causal: padding never reaches the real positions
        out = []
        for r, (_, _, cont) in enumerate(chunk):
            n, m = len(inps[r]), len(cont)
            lp = logp[r, n - m : n]  # (m, V): predictions of the continuation's tokens
            target = torch.tensor(cont, dtype=torch.long)  # (m,)
            ll = lp.gather(-1, target[:, None]).sum()
            out.append((float(ll), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each whole string, over disjoint windows of the model's context."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            tokens = self.tok_encode(string, add_special_tokens=False)
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        results = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, results, strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        L = self.max_length
        groups: dict[tuple[str, int], list[tuple[int, list[int], dict[str, Any]]]] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            ids = self.tok_encode(context, left_truncate_len=L)  # longer contexts slide out of the window anyway
            key = (json.dumps(kw, sort_keys=True, default=str), len(ids))
            groups.setdefault(key, []).append((i, ids, kw))
        out: list[str | None] = [None] * len(requests)
        with self.progress.task("generate_until", total=len(requests)) as bar:
            for members in groups.values():
                for i, text in self._generate_group(members):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(advance=1)
        return [s if s is not None else "" for s in out]

    def _generate_group(self, members: list[tuple[int, list[int], dict[str, Any]]]) -> Iterator[tuple[int, str]]:
        """(request index, text) for requests that share their generation settings and token length, in batches."""
        kw = dict(members[0][2])
        until = [s for s in handle_stop_sequences(kw.pop("until", None), eos=None) if s]
        max_new = int(kw.pop("max_gen_toks"))
        temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
        for b in range(0, len(members), self.batch_size):
            chunk = members[b : b + self.batch_size]
            new = self._generate(
                torch.tensor([ids for _, ids, _ in chunk], dtype=torch.long), max_new, until, temperature
            )
            for (i, _, _), toks in zip(chunk, new, strict=True):
                text = self.tok.decode(toks)
                for s in until:  # cut at the first stop sequence (it may end inside the last token)
                    text = text.split(s)[0]
                yield i, text

    def _generate(self, idx: torch.Tensor, max_new: int, until: list[str], temperature: float) -> list[list[int]]:
        """idx (B, T), every row the same length -> generated ids per row, without the end token.

        The shared generation routine (KV cache, window slide, dropping finished rows); each row samples from its
        own stream seeded from the batch content and its index, so a request's text does not depend on what else
        is in its batch's RNG use. A row stops at the end-of-text token (dropped) or once its decoded text contains
        a stop sequence (kept; `generate_until` cuts the text there)."""
        if max_new <= 0:
            return [[] for _ in range(idx.shape[0])]
        base = self._batch_seed(idx)
        gens = [torch.Generator(device=self._device).manual_seed((base + r) % (2**63 - 1)) for r in range(idx.shape[0])]

        def should_stop(_row: int, new: list[int]) -> bool:
            return bool(until) and any(s in self.tok.decode(new) for s in until)

        with self._seeded(idx):
            outs = generate(
                self.model,
                idx.tolist(),
                max_new_tokens=max_new,
                temperature=temperature,
                stop_ids=(self.eot_token_id,),
                n_recur=self.n_recur,
                generators=gens,
                should_stop=should_stop,
            )
        return [g.tokens for g in outs]
