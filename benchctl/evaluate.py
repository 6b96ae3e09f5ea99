"""lm-eval integration: a `TemplateLM` adapter for benchctl checkpoints, bundled offline TinyStories tasks, and the
runner behind `benchctl eval` that stores every metric in results.db (`eval_results`).

Follows EleutherAI lm-evaluation-harness 0.4.13 (`lm_eval/models/huggingface.py` for the request handling) and
ECOSYSTEM.md's notes on it.

The adapter (`BenchctlLM`, registered with lm-eval as "benchctl"):
    import benchctl.evaluate, lm_eval
    lm_eval.simple_evaluate(model="benchctl", model_args="checkpoint=PATH,n_recur=14,batch_size=32,device=cpu", ...)
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

Bundled tasks (`BUNDLED_TASKS`), generated from the run's validation split into the data cache
(`<prepared dir>/lm_eval_tasks/`), never hand-written; the generators are pure functions of (stories, seed, n_docs):
- tinystories_ppl: rolling log-likelihood of held-out stories -> word_perplexity, byte_perplexity, bits_per_byte.
- tinystories_ending: the true last sentence of a story vs the last sentences of three other stories (acc, acc_norm).
- tinystories_names: the protagonist's name at its next mention vs the protagonists of three other stories (acc,
  acc_norm); see `find_protagonist` for the rule.
Both multiple-choice tasks are balanced: documents come in groups of four stories that share the same four choices
(the group's answers, in one order), so every choice is right exactly once per group and a model that ignores the
story — a prior for frequent names such as "Lily", a favourite position — scores exactly 1/4 (`_group_docs`).
Each generator has a version (`TASK_VERSIONS`, bump it when its output changes); the rendered YAML carries it in
`metadata.version`, and the stored `task_version` is "<version>+<sha256 of the documents, 12 hex>", so two rows with
the same task_version were computed on exactly the same documents. The YAML templates live in `benchctl/tasks/`;
the rendered copies hold absolute data paths (lm-eval resolves relative ones against the working directory) and are
loaded with `TaskManager(include_path=...)`; a YAML that fails to parse is skipped silently by lm-eval, so every
bundled task is checked to be found.

Runner (`evaluate_runs`): every finished run (or a selection) x tasks; rows keyed (run, task, metric, n_recur,
limit_n) are replaced on rerun, and a (run, task, n_recur, limit) already stored with the same task version is
skipped unless `force`. Standard lm-eval tasks (hellaswag, lambada_openai, blimp_* ...) are accepted by name or
glob, and so are tasks from the user's own YAML directories (`include_paths`, `--include-path`); lm-eval's ~15,000
task entries are indexed (~20 s) only when a name is not found among those. When the Hugging Face hub is
unreachable, tasks are tried from the local datasets cache only (offline mode, so no retry storm), and those that
cannot load are reported and left out. lm-eval reseeds python/numpy/torch globally:
all RNG states are saved before and restored after. lm-eval's request cache is not used (LM_HARNESS_CACHE_PATH is
pointed into benchctl's cache anyway, so nothing is ever written into site-packages).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import os
import random
import re
import socket
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
import yaml

from benchctl import data as datamod
from benchctl.errors import EvalError

os.environ.setdefault("LM_HARNESS_CACHE_PATH", str(datamod.cache_root() / "lm_eval_requests"))

import lm_eval  # noqa: E402  (after LM_HARNESS_CACHE_PATH: lm-eval reads it at import)
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

BUNDLED_TASKS = ("tinystories_ppl", "tinystories_ending", "tinystories_names")
TASK_VERSIONS = {"tinystories_ppl": 1, "tinystories_ending": 1, "tinystories_names": 1}
TASK_SEED = 1234  # seed of the document selection and the distractors
DEFAULT_DOCS = 200  # documents per bundled task
DEFAULT_BATCH_SIZE = 32
DEFAULT_SEED = 1234  # seed mixed into every forward (three-part's random initial state)
BOOTSTRAP_ITERS = 1000  # lm-eval stderr for bootstrapped metrics (acc uses the closed form)
TEMPLATES = Path(__file__).parent / "tasks"
TASKS_SUBDIR = "lm_eval_tasks"
HUB_PROBE_TIMEOUT = 3.0

# ====================================================================================================================
# The adapter


def _as_int(name: str, value: Any, minimum: int = 1) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


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
        progress: bool = True,
    ) -> None:
        super().__init__()
        from benchctl.train import resolve_device

        self._device = resolve_device(device or "auto")
        if model is None:
            if checkpoint is None:
                raise ValueError("benchctl model needs checkpoint=PATH (a run's ckpt.pt)")
            from benchctl.checkpoint import load_model

            model, cfg, tok_path = load_model(Path(checkpoint), self._device)
            tokenizer = datamod.Tokenizer(tok_path)
            self.arch = cfg.arch
        else:
            if tokenizer is None:
                raise ValueError("BenchctlLM(model=...) also needs tokenizer=")
            model = model.to(self._device).eval()
            self.arch = getattr(model, "name", type(model).__name__)
        self.model = model
        self.tok = tokenizer
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        # Raises architectures.RecurrenceError (a ValueError) when the architecture cannot run this recurrence.
        self.n_recur = model.resolve_n_recur(None if n_recur in (None, "") else _as_int("n_recur", n_recur))
        self._batch_size = _as_int("batch_size", DEFAULT_BATCH_SIZE if batch_size is None else batch_size)
        self._max_gen_toks = _as_int("max_gen_toks", max_gen_toks)
        self.seed = _as_int("seed", seed, minimum=0)
        self.progress = progress

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

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids; BOS first unless add_special_tokens is False (contexts are prefixed with BOS, as in training)."""
        ids = self.tok.encode(string, bos=add_special_tokens is not False, eos=False)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        return {"benchctl_checkpoint": self.checkpoint, "arch": self.arch, "n_recur": self.n_recur,
                "max_length": self.max_length, "benchctl_seed": self.seed}

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
        # lm-eval's "Tokenizing inputs" bar is noise next to ours (which follows `progress`).
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """[(request key, context ids, continuation ids)] -> [(sum log p(continuation | context), is greedy)]."""
        from tqdm.auto import tqdm

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
        bar = tqdm(total=len(pieces), desc="loglikelihood", disable=not self.progress, leave=False)
        for chunk in coll.get_batched(n=override_bs or self.batch_size):
            # Keep the last L+1 tokens (HF's left truncation); the input drops the last, which is only predicted.
            inps = [(ctx + cont)[-(L + 1) :][:-1] for _, ctx, cont in chunk]
            T = max(len(x) for x in inps)
            batch = torch.full((len(inps), T), self.eot_token_id, dtype=torch.long)  # right padding, (B, T)
            for r, x in enumerate(inps):
                batch[r, : len(x)] = torch.tensor(x, dtype=torch.long)
            logp = self._logprobs(batch).cpu()  # (B, T, V); causal: padding never reaches the real positions
            for r, (_, _, cont) in enumerate(chunk):
                n, m = len(inps[r]), len(cont)
                lp = logp[r, n - m : n]  # (m, V): predictions of the continuation's tokens
                target = torch.tensor(cont, dtype=torch.long)  # (m,)
                ll = lp.gather(-1, target[:, None]).sum()
                piece_res.append((float(ll), bool((lp.argmax(-1) == target).all())))
            bar.update(len(chunk))
        bar.close()
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

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each whole string, over disjoint windows of the model's context."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            tokens = self.tok_encode(string, add_special_tokens=False)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1,
            )):
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
        from tqdm.auto import tqdm

        L = self.max_length
        groups: dict[tuple[str, int], list[tuple[int, list[int], dict[str, Any]]]] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            ids = self.tok_encode(context, left_truncate_len=L)  # longer contexts slide out of the window anyway
            key = (json.dumps(kw, sort_keys=True, default=str), len(ids))
            groups.setdefault(key, []).append((i, ids, kw))
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=not self.progress, leave=False)
        for members in groups.values():
            kw = dict(members[0][2])
            until = [s for s in handle_stop_sequences(kw.pop("until", None), eos=None) if s]
            max_new = int(kw.pop("max_gen_toks"))
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            for b in range(0, len(members), self.batch_size):
                chunk = members[b : b + self.batch_size]
                new = self._generate(torch.tensor([ids for _, ids, _ in chunk], dtype=torch.long), max_new, until,
                                     temperature)
                for (i, _, _), toks in zip(chunk, new, strict=True):
                    text = self.tok.decode(toks)
                    for s in until:  # cut at the first stop sequence (it may end inside the last token)
                        text = text.split(s)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return [s if s is not None else "" for s in out]

    @torch.no_grad()
    def _generate(self, idx: torch.Tensor, max_new: int, until: list[str], temperature: float) -> list[list[int]]:
        """idx (B, T), every row the same length -> generated ids per row, without the end token."""
        from architectures.base import sample_next
        from architectures.blocks import KVCache

        L, B = self.max_length, idx.shape[0]
        out: list[list[int]] = [[] for _ in range(B)]
        if max_new <= 0:
            return out
        done = [False] * B
        seq = idx.to(self._device)  # (B, T)
        generator = torch.Generator(device=self._device).manual_seed(self._batch_seed(idx))
        with self._seeded(idx):
            cache: KVCache | None = KVCache(L)
            logits, _ = self.model(seq[:, -L:], n_recur=self.n_recur, cache=cache)  # (B, T, V)
            if seq.shape[1] >= L:
                cache = None  # no room left: slide the window from here on
            for step in range(max_new):
                nxt = sample_next(logits[:, -1, :], temperature, None, None, generator)  # (B,)
                for r in range(B):
                    if done[r]:
                        continue
                    t = int(nxt[r])
                    if t == self.eot_token_id:
                        done[r] = True
                        continue
                    out[r].append(t)
                    if until and any(s in self.tok.decode(out[r]) for s in until):
                        done[r] = True
                if all(done) or step == max_new - 1:
                    break
                seq = torch.cat([seq, nxt[:, None]], dim=1)  # (B, T+1)
                if cache is not None and cache.pos < L:
                    logits, _ = self.model(nxt[:, None], n_recur=self.n_recur, cache=cache)  # (B, 1, V)
                else:
                    cache = None
                    logits, _ = self.model(seq[:, -L:], n_recur=self.n_recur)  # (B, L, V)
        return out


# ====================================================================================================================
# Bundled tasks: document generators (pure functions of the validation stories)

# A sentence ends at . ! or ? (possibly followed by closing quotes) and whitespace.
_SENT_END = re.compile(r"[.!?][\"'”’]*\s+")
_QUOTES = set("\"'“”‘’")
_CAP_WORD = re.compile(r"\b[A-Z][a-z]+\b")
_INTRO = re.compile(r"\b(?:named|called)\s+([A-Z][a-z]+)\b|\b[Nn]ame (?:was|is)\s+([A-Z][a-z]+)\b")
# Capitalised words that are not character names in TinyStories: roles used as names, interjections, sentence
# openers, calendar words. (Capitalised words seen only at sentence starts are excluded by the rule itself.)
NOT_NAMES = frozenset("""
Mom Mommy Mum Mummy Mama Momma Dad Daddy Papa Pa Ma Grandma Grandpa Granny Grandad Nana Papa Mr Mrs Ms Miss Sir
Madam Aunt Auntie Uncle Doctor Teacher King Queen Prince Princess God Santa The Once One Then When But And So They
She He It Yes No Oh Wow Okay Ok Hello Hi Bye Goodbye Thank Thanks Please Sorry Let Look Come Go Stop Don Can What Why
How Where Who Good Hey Help Sure Ouch Yay Hooray Monday Tuesday Wednesday Thursday Friday Saturday Sunday January
February March April May June July August September October November December Christmas Halloween Easter Spring
Summer Autumn Fall Winter Earth English
""".split())


def last_sentence_split(story: str) -> tuple[str, str] | None:
    """(context including the separating whitespace, last sentence) or None when the story has a single sentence."""
    story = story.strip()
    ends = [m.end() for m in _SENT_END.finditer(story) if m.end() < len(story)]
    if not ends:
        return None
    return story[: ends[-1]], story[ends[-1] :]


def _ending_ok(context: str, sentence: str) -> bool:
    # A clean narrative sentence: no dialogue fragment, long enough to say something, after a real context.
    return len(sentence.split()) >= 4 and not (_QUOTES & set(sentence)) and len(context.strip()) >= 40


def _sentence_initial(text: str, i: int) -> bool:
    j = i - 1
    while j >= 0 and text[j] in " \t":
        j -= 1
    return j < 0 or text[j] in ".!?:\n" or text[j] in _QUOTES


def find_protagonist(story: str) -> tuple[str, int] | None:
    """(name, offset of the mention that introduces it), or None when the story has no clear named protagonist.

    The rule, in order:
    1. an introduction: the first "named X", "called X" or "name was/is X" where X is a capitalised word not in
       `NOT_NAMES` that is mentioned again later in the story;
    2. otherwise the capitalised word (not in `NOT_NAMES`) mentioned most often, at least twice, at least once
       in the middle of a sentence (so ordinary sentence-initial words are never taken for names); ties go to the
       earliest. Its introduction is its first mention.
    Stories where neither finds a name are dropped from the task.
    """
    m = _INTRO.search(story)
    if m:
        name = m.group(1) or m.group(2)
        start = m.start(1) if m.group(1) else m.start(2)
        if name not in NOT_NAMES and re.search(rf"\b{name}\b", story[start + len(name) :]):
            return name, start
    count: Counter[str] = Counter()
    first: dict[str, int] = {}
    mid: set[str] = set()
    for w in _CAP_WORD.finditer(story):
        name = w.group()
        if name in NOT_NAMES:
            continue
        count[name] += 1
        first.setdefault(name, w.start())
        if not _sentence_initial(story, w.start()):
            mid.add(name)
    candidates = [n for n in count if count[n] >= 2 and n in mid]
    if not candidates:
        return None
    name = max(candidates, key=lambda n: (count[n], -first[n]))
    return name, first[name]


def make_ppl_docs(stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED) -> list[dict[str, Any]]:
    """A seeded random subset of n_docs stories, in random order (so --limit takes a random subset too)."""
    rng = random.Random(f"tinystories_ppl:{seed}")
    eligible = [i for i, s in enumerate(stories) if s.strip()]
    rng.shuffle(eligible)
    return [{"text": stories[i].strip(), "story_idx": i} for i in eligible[:n_docs]]


@dataclass(frozen=True)
class _Item:
    story_idx: int
    context: str
    answer: str  # the true continuation: a last sentence, or a name
    story: str


def _balanced_groups(rng: random.Random, items: Sequence[_Item], k: int, n_groups: int,
                     compatible: Callable[[_Item, _Item], bool]) -> list[list[_Item]]:
    """Up to n_groups groups of k mutually compatible items, greedily from a seeded shuffle of `items`."""
    order = list(items)
    rng.shuffle(order)
    open_groups: list[list[_Item]] = []
    groups: list[list[_Item]] = []
    for it in order:
        for g in open_groups:
            if all(compatible(it, other) for other in g):
                g.append(it)
                if len(g) == k:
                    groups.append(g)
                    open_groups.remove(g)
                break
        else:
            open_groups.append([it])
        if len(groups) == n_groups:
            break
    return groups


def _group_docs(rng: random.Random, groups: list[list[_Item]], extra: Callable[[_Item], dict[str, Any]]
                ) -> list[dict[str, Any]]:
    """Every document of a group gets the same choices (the group's answers) in the same seeded order: each choice
    is the right answer exactly once per group, so any scorer that ignores the story (a prior over names or
    sentences, a favourite position) scores exactly 1/k on whole groups. Groups are contiguous (for --limit)."""
    docs = []
    for g in groups:
        choices = [it.answer for it in g]
        rng.shuffle(choices)
        for it in g:
            docs.append({"context": it.context, "choices": choices, "label": choices.index(it.answer),
                         "story_idx": it.story_idx, **extra(it)})
    return docs


def make_ending_docs(stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED,
                     n_choices: int = 4) -> list[dict[str, Any]]:
    """The story without its last sentence; choices: the last sentences of a group of n_choices stories (all
    different), the story's own among them. About n_docs documents (whole groups)."""
    rng = random.Random(f"tinystories_ending:{seed}")
    items = []
    for i, s in enumerate(stories):
        split = last_sentence_split(s)
        if split is not None and _ending_ok(*split):
            items.append(_Item(story_idx=i, context=split[0], answer=split[1], story=s))
    groups = _balanced_groups(rng, items, n_choices, -(-n_docs // n_choices),
                              lambda a, b: a.answer != b.answer)
    return _group_docs(rng, groups, lambda it: {})


def _mentions(name: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def make_names_docs(stories: Sequence[str], n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED,
                    n_choices: int = 4) -> list[dict[str, Any]]:
    """The story up to the protagonist's next mention after its introduction; choices: the protagonists of a group
    of n_choices stories with different protagonists, none of which occurs in another story of the group (so the
    context never contains a wrong name). About n_docs documents (whole groups)."""
    rng = random.Random(f"tinystories_names:{seed}")
    items = []
    for i, s in enumerate(stories):
        story = s.strip()
        found = find_protagonist(story)
        if found is None:
            continue
        name, intro = found
        after = intro + len(name)
        nxt = re.search(rf"\b{re.escape(name)}\b", story[after:])
        if nxt is None:
            continue
        items.append(_Item(story_idx=i, context=story[: after + nxt.start()], answer=name, story=story))
    groups = _balanced_groups(
        rng, items, n_choices, -(-n_docs // n_choices),
        lambda a, b: a.answer != b.answer and not _mentions(a.answer, b.story) and not _mentions(b.answer, a.story),
    )
    return _group_docs(rng, groups, lambda it: {"name": it.answer})


GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "tinystories_ppl": make_ppl_docs,
    "tinystories_ending": make_ending_docs,
    "tinystories_names": make_names_docs,
}


@dataclass(frozen=True)
class BundledTasks:
    dir: Path  # include_path for lm-eval's TaskManager
    versions: dict[str, str]  # task -> stored task_version
    n_docs: dict[str, int]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def build_bundled_tasks(prepared: datamod.Prepared, tasks: Sequence[str] = BUNDLED_TASKS, *,
                        n_docs: int = DEFAULT_DOCS, seed: int = TASK_SEED) -> BundledTasks:
    """Generate the documents of `tasks` from the validation split and write loadable lm-eval YAMLs beside them.

    Deterministic: the same validation stories, n_docs and seed give byte-identical files. Rewritten every call
    (cheap), atomically, so concurrent evaluations never read a half-written file.
    """
    unknown = [t for t in tasks if t not in GENERATORS]
    if unknown:
        raise EvalError(f"not a bundled task: {', '.join(unknown)}; bundled: {', '.join(BUNDLED_TASKS)}")
    out_dir = prepared.dir / TASKS_SUBDIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stories = prepared.valid_stories()
    versions, counts = {}, {}
    for task in tasks:
        docs = GENERATORS[task](stories, n_docs=n_docs, seed=seed)
        if not docs:
            raise EvalError(f"{task}: no usable documents in the {len(stories)} validation stories of "
                            f"{prepared.dir}; use a larger validation split (data.max_valid_stories)")
        body = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
        digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
        data_path = out_dir / f"{task}.jsonl"
        _atomic_write(data_path, body)
        cfg = yaml.safe_load((TEMPLATES / f"{task}.yaml").read_text(encoding="utf-8"))
        cfg["dataset_kwargs"] = {
            "data_files": {"test": str(data_path.resolve())},
            "cache_dir": str((out_dir / "hf_datasets").resolve()),  # datasets' arrow cache stays in benchctl's cache
        }
        cfg["metadata"] = {"version": float(TASK_VERSIONS[task]), "generator": f"benchctl.evaluate.{task}",
                           "seed": seed, "n_docs": len(docs), "docs_sha256": digest,
                           "data_fingerprint": prepared.fingerprint}
        header = (f"# Generated by benchctl (template benchctl/tasks/{task}.yaml); regenerated on every "
                  "`benchctl eval`.\n")
        _atomic_write(out_dir / f"{task}.yaml", header + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
        versions[task] = f"{TASK_VERSIONS[task]}+{digest[:12]}"
        counts[task] = len(docs)
    return BundledTasks(dir=out_dir, versions=versions, n_docs=counts)


# ====================================================================================================================
# Hub access for standard lm-eval tasks


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Can this machine open a TCP connection to the Hugging Face hub (honouring HF_ENDPOINT / HF_HUB_OFFLINE)?"""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or \
            os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """Put huggingface_hub and datasets in offline mode (local cache only) for the block, then restore.

    Both libraries read HF_HUB_OFFLINE once at import, so the environment variable cannot do it at run time; without
    it every dataset lookup retries the unreachable hub for ~20 s before failing.
    """
    if not enabled:
        yield
        return
    import datasets.config as dconfig
    import huggingface_hub.constants as hconst

    saved = (hconst.HF_HUB_OFFLINE, dconfig.HF_HUB_OFFLINE)
    hconst.HF_HUB_OFFLINE = dconfig.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hconst.HF_HUB_OFFLINE, dconfig.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep our output readable: lm-eval logs every step and draws a bar per task while building requests, and
    datasets draws bars for tiny local files. Our own progress (log lines, the adapter's bar) is unaffected."""
    import functools

    import datasets
    import lm_eval.api.task as task_module

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    saved_tqdm = task_module.__dict__.get("tqdm")
    if saved_tqdm is not None:  # the "Building contexts" bar has no switch; tqdm reads TQDM_DISABLE only at import
        task_module.tqdm = functools.partial(saved_tqdm, disable=True)
    # simple_evaluate ends by collecting environment info for its results dict: torch's collect_env (1-6 s a call:
    # pip list, nvidia-smi, ...) and `git describe` in the working directory, whose "fatal: not a git repository" goes
    # straight to our stderr outside a checkout. benchctl stores none of it (runs record versions and the commit), so
    # while we evaluate, lm-eval gets a quick, quiet version of both.
    import lm_eval.evaluator as evaluator_module

    from benchctl.telemetry import git_commit

    saved_env = {k: evaluator_module.__dict__[k] for k in ("add_env_info", "get_git_commit_hash")
                 if k in evaluator_module.__dict__}
    if "add_env_info" in saved_env:
        evaluator_module.add_env_info = _light_env_info
    if "get_git_commit_hash" in saved_env:
        evaluator_module.get_git_commit_hash = git_commit
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
        if saved_tqdm is not None:
            task_module.tqdm = saved_tqdm
        for k, v in saved_env.items():
            setattr(evaluator_module, k, v)


def _light_env_info(storage: dict[str, Any]) -> None:
    """What lm-eval's add_env_info records that is quick to get (its versions), without torch's collect_env."""
    from importlib.metadata import version

    storage.update({"pretty_env_info": "not collected by benchctl (see the runs table)",
                    "lm_eval_version": version("lm_eval"), "torch_version": torch.__version__})


# ====================================================================================================================
# The runner


@dataclass
class EvalSummary:
    """What `evaluate_runs` did; `rows` are the stored eval_results rows of the selection (new and earlier)."""

    tasks: list[str]
    runs: list[dict[str, Any]]  # id, arch, preset, seed, n_recur (the one evaluated)
    rows: list[dict[str, Any]] = field(default_factory=list)
    evaluated: list[tuple[str, str]] = field(default_factory=list)  # (run id, task) computed now
    skipped: list[tuple[str, str]] = field(default_factory=list)  # already stored
    unavailable: dict[str, str] = field(default_factory=dict)  # task -> why it could not run (needs the hub)
    seconds: float = 0.0
    limit: int | None = None
    n_recur: int | None = None


def allowed_recurrence(arch: str, model_args: Any) -> str:
    import architectures

    cls = architectures.get(arch)
    top = cls.max_n_recur(model_args)
    if top is None:
        return "any value >= 1"
    if top == 1:
        return "only 1"
    return f"1 to {top} (trained with {model_args.n_recur})"


def check_recurrence(run: dict[str, Any], cfg: Any, n_recur: int | None) -> int:
    """The recurrence to evaluate `run` at; an EvalError naming the run and the allowed range if it cannot."""
    import architectures

    if n_recur is None:
        return int(cfg.model.n_recur)
    top = architectures.get(cfg.arch).max_n_recur(cfg.model)
    if n_recur < 1 or (top is not None and n_recur > top):
        raise EvalError(f"--n-recur {n_recur} is not allowed for run {run['id']} ({cfg.arch}): it accepts "
                        f"{allowed_recurrence(cfg.arch, cfg.model)}; select other runs with --runs/--archs")
    return n_recur


def _split_metric(key: str) -> tuple[str, bool] | None:
    """lm-eval result key "acc,none" -> ("acc", is_stderr); "acc_stderr,none" -> ("acc", True); alias -> None."""
    if "," not in key:
        return None
    name, filt = key.split(",", 1)
    is_stderr = name.endswith("_stderr")
    if is_stderr:
        name = name[: -len("_stderr")]
    return (name if filt == "none" else f"{name}[{filt}]"), is_stderr


def result_rows(results: dict[str, Any], run_id: str, n_recur: int, limit: int | None, batch_size: int,
                versions: dict[str, str]) -> list[dict[str, Any]]:
    """simple_evaluate's output -> eval_results rows (stderr "N/A" -> None)."""
    from benchctl import db as dbm

    rows = []
    created = dbm.now()
    for task, metrics in results["results"].items():
        n_samples = (results.get("n-samples", {}).get(task) or {}).get("effective")
        version = versions.get(task)
        if version is None:
            v = results.get("versions", {}).get(task)
            version = None if v is None else str(v)
        values: dict[str, float] = {}
        errs: dict[str, Any] = {}
        for key, value in metrics.items():
            parsed = _split_metric(key)
            if parsed is None:
                continue
            name, is_stderr = parsed
            (errs if is_stderr else values)[name] = value
        for name, value in values.items():
            if not isinstance(value, (int, float)):
                continue
            err = errs.get(name)
            rows.append({
                "run_id": run_id, "task": task, "metric": name, "n_recur": n_recur, "limit_n": limit or 0,
                "value": float(value), "stderr": float(err) if isinstance(err, (int, float)) else None,
                "n_samples": n_samples, "task_version": version, "batch_size": batch_size,
                "lm_eval_version": lm_eval.__version__, "created_at": created,
            })
    return rows


def _store(db, rows: list[dict[str, Any]], keys: set[tuple[str, str]], n_recur: int, limit_n: int) -> None:
    """Replace every row of the (run, task) pairs in `keys` at (n_recur, limit_n) by `rows`, in one transaction."""
    from benchctl import db as dbm

    def write() -> None:
        with db.conn:
            for run_id, task in keys:
                db.conn.execute(
                    "delete from eval_results where run_id = ? and task = ? and n_recur = ? and limit_n = ?",
                    [run_id, task, n_recur, limit_n])
            if rows:
                db["eval_results"].insert_all(rows, pk=("run_id", "task", "metric", "n_recur", "limit_n"),
                                              replace=True)

    dbm.retry_locked(write)


def _stored(db, run_id: str, n_recur: int, limit_n: int) -> dict[str, set[str | None]]:
    """task -> task versions already stored for (run, n_recur, limit)."""
    out: dict[str, set[str | None]] = {}
    for r in db.query("select task, task_version from eval_results where run_id = ? and n_recur = ? and limit_n = ?",
                      [run_id, n_recur, limit_n]):
        out.setdefault(r["task"], set()).add(r["task_version"])
    return out


class _Tasks:
    """The lm-eval TaskManager for one prepared data directory: the bundled tasks generated into it, the user's
    include paths, and lm-eval's own tasks only when a requested name is not found in those (indexing lm-eval's
    ~15,000 task entries takes ~20 s)."""

    def __init__(self, prepared: datamod.Prepared, bundled: list[str], standard: list[str], n_docs: int,
                 include_paths: Sequence[Path]):
        from lm_eval.tasks import TaskManager

        self.bundled = build_bundled_tasks(prepared, bundled, n_docs=n_docs) if bundled else None
        paths = ([str(self.bundled.dir)] if self.bundled else []) + [str(Path(p).resolve()) for p in include_paths]
        self.tm = TaskManager(include_path=paths or None, include_defaults=False)
        missing = [t for t in bundled if t not in self.tm.all_tasks]
        if missing:  # lm-eval skips a YAML it cannot parse without a word
            raise EvalError(f"lm-eval did not find the generated task(s) {', '.join(missing)} in "
                            f"{self.bundled.dir if self.bundled else '-'}; the YAML there does not parse — delete "
                            "the directory and rerun")
        if any(not _matches(self.tm, name) for name in standard):
            self.tm = TaskManager(include_path=paths or None, include_defaults=True)

    def versions(self) -> dict[str, str]:
        return dict(self.bundled.versions) if self.bundled else {}


def _matches(tm, name: str) -> list[str]:
    if any(c in name for c in "*?["):
        return tm.match_tasks([name])
    return [name] if name in tm.all_tasks else []


def _resolve_standard(tm, names: list[str]) -> list[str]:
    """Expand globs (blimp_*) against lm-eval's index; unknown names are an EvalError with a suggestion."""
    out: list[str] = []
    for name in names:
        matched = _matches(tm, name)
        if not matched:
            close = difflib.get_close_matches(name, list(BUNDLED_TASKS) + tm.all_tasks, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise EvalError(f"unknown task '{name}'{hint} (bundled: {', '.join(BUNDLED_TASKS)}; or any lm-eval "
                            "task name, e.g. hellaswag, lambada_openai, blimp_*)")
        out += [m for m in matched if m not in out]
    return out


def _probe_standard(tm, names: list[str], offline: bool) -> dict[str, str]:
    """Load each standard task once (downloading its dataset if the hub is reachable); task -> error if it fails."""
    bad: dict[str, str] = {}
    with hub_offline(offline):
        for name in names:
            try:
                tm.load([name])
            except OSError as e:  # ConnectionError / FileNotFoundError from datasets: not on the hub, not cached
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                bad[name] = first[:200]
    return bad


def evaluate_runs(
    db,
    db_path: str | os.PathLike,
    *,
    tasks: Sequence[str] | None = None,
    run_ids: Sequence[str] | None = None,
    archs: Sequence[str] | None = None,
    preset: str | None = None,
    n_recur: int | None = None,
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "auto",
    force: bool = False,
    n_docs: int = DEFAULT_DOCS,
    include_paths: Sequence[str | os.PathLike] = (),
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> EvalSummary:
    """Evaluate every finished run (or the selected ones) on `tasks` and store one row per metric in eval_results.

    `tasks`: bundled names, lm-eval task names or globs, or tasks defined by YAMLs under `include_paths`.
    `n_recur` overrides the recurrence (validated for every run before any work starts); `limit` passes lm-eval's
    limit (first N documents; stored as limit_n, 0 = all). Skips (run, task, n_recur, limit) already stored with the
    same task version unless `force`. Tasks whose dataset cannot be loaded (hub unreachable and not cached) are
    listed in `EvalSummary.unavailable` and left out. `threads` sets torch's CPU threads for the evaluation and
    restores them after (tiny models gain nothing from several threads and lose a lot on a shared machine). Every
    RNG state (python, numpy, torch, CUDA) is the same after as before.
    """
    from benchctl import db as dbm
    from benchctl.checkpoint import CKPT_NAME, rng_state, run_dir, set_rng_state
    from benchctl.config import RunConfig

    t0 = time.perf_counter()
    tasks = list(dict.fromkeys(tasks or BUNDLED_TASKS))
    for name, value in (("--n-recur", n_recur), ("--limit", limit)):
        if value is not None and value < 1:
            raise EvalError(f"{name} must be >= 1, got {value}")
    if batch_size < 1:
        raise EvalError(f"--batch-size must be >= 1, got {batch_size}")
    if threads is not None and threads < 1:
        raise EvalError(f"--threads must be >= 1, got {threads}")
    if n_docs < 1:
        raise EvalError(f"n_docs must be >= 1, got {n_docs}")
    bundled = [t for t in tasks if t in BUNDLED_TASKS]
    standard = [t for t in tasks if t not in BUNDLED_TASKS]
    for name in standard:  # a typo of a bundled name is caught before lm-eval's 20-second index is built
        if name.startswith("tinystories"):
            close = difflib.get_close_matches(name, BUNDLED_TASKS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise EvalError(f"unknown task '{name}'{hint} bundled tasks: {', '.join(BUNDLED_TASKS)}")
    include_paths = [Path(p) for p in include_paths]
    for p in include_paths:
        if not p.is_dir():
            raise EvalError(f"--include-path {p} is not a directory of lm-eval task YAMLs")

    runs = dbm.finished_runs(db, run_ids=run_ids, archs=archs, preset=preset, bad_selection=EvalError,
                             none_left=EvalError, purpose="to evaluate")
    plan = []  # (run row, config, n_recur to evaluate)
    for run in runs:
        cfg = RunConfig.from_json(run["config_json"])
        plan.append((run, cfg, check_recurrence(run, cfg, n_recur)))  # every run checked before any work
    for run, _, _ in plan:
        ckpt = run_dir(Path(db_path), run["id"]) / CKPT_NAME
        if not ckpt.exists():
            raise EvalError(f"run {run['id']} is marked done but has no checkpoint at {ckpt}")

    summary = EvalSummary(tasks=tasks, limit=limit, n_recur=n_recur,
                          runs=[{"id": r["id"], "arch": r["arch"], "preset": r["preset"], "seed": r["seed"],
                                 "n_recur": n} for r, _, n in plan])
    limit_n = limit or 0
    offline = bool(standard) and not hub_reachable()
    saved_rng = rng_state()
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        managers: dict[Path, _Tasks] = {}
        resolved_standard: list[str] | None = None
        for k, (run, cfg, r) in enumerate(plan, 1):
            label = f"[{k}/{len(plan)}] {run['arch']} seed {run['seed']} ({run['id']}), n_recur {r}"
            prepared = datamod.prepare(cfg.data, cfg.model.vocab_size, progress=progress)
            if prepared.dir not in managers:
                if progress:
                    log(f"preparing tasks from the validation split in {prepared.dir}")
                with _quiet():
                    managers[prepared.dir] = _Tasks(prepared, bundled, standard, n_docs, include_paths)
                    if standard and resolved_standard is None:
                        resolved_standard = _resolve_standard(managers[prepared.dir].tm, standard)
                        if offline and progress:
                            log("the Hugging Face hub is unreachable: standard tasks run only if their dataset is "
                                "in the local cache")
                        summary.unavailable = _probe_standard(managers[prepared.dir].tm, resolved_standard,
                                                              offline)
                        if summary.unavailable:
                            why = ("the Hugging Face hub is unreachable and their dataset is not cached locally"
                                   if offline else "their dataset could not be loaded")
                            log(f"skipping {', '.join(summary.unavailable)}: {why} ("
                                + "; ".join(f"{t}: {e}" for t, e in summary.unavailable.items()) + ")")
                        summary.tasks = bundled + resolved_standard
            tm = managers[prepared.dir]
            versions = tm.versions()
            runnable = bundled + [t for t in (resolved_standard or []) if t not in summary.unavailable]
            if not runnable:
                raise EvalError("none of the requested tasks can run here: "
                                + "; ".join(f"{t}: {why}" for t, why in summary.unavailable.items()))
            have = _stored(db, run["id"], r, limit_n)
            todo = []
            for task in runnable:
                stored = have.get(task)
                current = versions.get(task)
                if not force and stored and (current is None or stored == {current}):
                    summary.skipped.append((run["id"], task))
                else:
                    todo.append(task)
            if not todo:
                if progress:
                    log(f"{label}: already evaluated ({', '.join(runnable)}); --force recomputes")
                continue
            t_run = time.perf_counter()
            ckpt = run_dir(Path(db_path), run["id"]) / CKPT_NAME
            lm = BenchctlLM(checkpoint=ckpt, n_recur=r, batch_size=batch_size, device=device, progress=progress)
            if progress:
                log(f"{label}: {', '.join(todo)}")
            with _quiet(), hub_offline(offline):
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=todo, task_manager=tm.tm, limit=limit, bootstrap_iters=BOOTSTRAP_ITERS,
                    log_samples=False, batch_size=batch_size, device=str(lm.device),
                )
            rows = result_rows(results, run["id"], r, limit, batch_size, versions)
            done_tasks = {row["task"] for row in rows}
            _store(db, rows, {(run["id"], t) for t in set(todo) | done_tasks}, r, limit_n)
            summary.evaluated += [(run["id"], t) for t in todo]
            if progress:
                log(f"{label}: done in {time.perf_counter() - t_run:.1f} s")
            del lm
    finally:
        set_rng_state(saved_rng)
        torch.set_num_threads(saved_threads)

    wanted = set(summary.tasks)
    query = "select * from eval_results where run_id = ? and n_recur = ? and limit_n = ? order by task, metric"
    for run in summary.runs:
        params = [run["id"], run["n_recur"], limit_n]
        for row in dbm.retry_locked(lambda p=params: list(db.query(query, p))):
            if row["task"] in wanted:
                summary.rows.append(row)
    summary.seconds = time.perf_counter() - t0
    return summary


# ====================================================================================================================
# The closing table

_SHOW = {  # metrics shown per bundled task, in order (the others are in the database)
    "tinystories_ppl": ("bits_per_byte", "word_perplexity"),
    "tinystories_ending": ("acc", "acc_norm"),
    "tinystories_names": ("acc", "acc_norm"),
}


def _fmt(value: float | None, stderr: float | None, metric: str) -> str:
    if value is None:
        return "-"
    digits = 2 if "perplexity" in metric else 3
    text = f"{value:.{digits}f}"
    return text + (f" ± {stderr:.{digits}f}" if stderr is not None else "")


def summary_tables(summary: EvalSummary) -> list[tuple[str, list[str], list[list[str]]]]:
    """One (task, headers, rows) per task: a row per run, a column per metric with ± stderr (one table per task
    keeps the closing output inside an 80-column terminal)."""
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    metrics: dict[str, list[str]] = {}
    for row in summary.rows:
        task, metric = row["task"], row["metric"]
        if task in _SHOW and metric not in _SHOW[task]:
            continue
        if metric not in metrics.setdefault(task, []):
            metrics[task].append(metric)
        cells[(row["run_id"], task, metric)] = row
    order = {t: i for i, t in enumerate(summary.tasks)}
    short = {"bits_per_byte": "bits/byte", "word_perplexity": "word ppl", "byte_perplexity": "byte ppl",
             "acc_mutual_info": "acc_mi"}
    tables = []
    for task in sorted(metrics, key=lambda t: (order.get(t, len(order)), t)):
        shown = _SHOW.get(task, ())
        cols = sorted(metrics[task], key=lambda m: (shown.index(m) if m in shown else len(shown), m))
        headers = ["arch", "seed", "n_recur"] + [short.get(m, m) for m in cols]
        rows = []
        for run in summary.runs:
            line = [run["arch"], str(run["seed"]), str(run["n_recur"])]
            for m in cols:
                c = cells.get((run["id"], task, m))
                line.append(_fmt(c["value"], c["stderr"], m) if c else "-")
            rows.append(line)
        tables.append((task, headers, rows))
    return tables
