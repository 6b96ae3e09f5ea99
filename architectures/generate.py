"""The one generation routine: batched, KV-cached sampling for any architecture of the zoo.

Used by story sampling, the lm-eval adapter's generation requests and the tests, so every caller gets the same
tokens for the same seeds. Follows karpathy/llama2.c's sampler (temperature, top-k, optional nucleus top-p; past
the context the window slides, re-encoding the last `max_seq_len` tokens each step) with three additions:

- Ragged prefill. Prompts need not have equal lengths: the batch starts at the shortest prompt and feeds each
  longer prompt's remaining tokens in place of samples, so every row is exactly its own prompt followed by its own
  samples, with no padding and no attention mask.
- One torch.Generator per row. Row b draws from `generators[b]` only, so its sample does not depend on which other
  prompts share its batch (up to floating-point differences between batch shapes).
- Early exit per row. A row finishes at a stop id (excluded from its tokens), when `should_stop` says so (the
  token kept), or after `max_new_tokens`; finished rows leave the batch and the KV cache (`KVCache.select_rows`).

Test-time depth: `n_recur` may exceed the trained depth (with the architecture's `extrapolate` rule), and `exit`
(an `ExitRule`) runs every forward through `BaseLM.iterate` with the per-token adaptive exit; each `Generation`
then carries `mean_depth`, the mean exit iteration over every position the model processed for that row (prompt
and generated tokens). Every iteration is still computed (see `BaseLM.iterate`), so the mean depth is what an
implementation skipping exited tokens would spend, not what this one did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from architectures.base import ExitRule
from architectures.blocks import KVCache


@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # the new tokens, the stop token excluded
    finish_reason: str  # "eos" (a stop id or should_stop) | "length"
    mean_depth: float | None = None  # with an adaptive exit: mean exit iteration over the positions processed


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering of logits (B, V); removed entries become -inf."""
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = F.softmax(sorted_logits, dim=-1)
        remove = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row from logits (B, V): greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    n_recur: int | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    extrapolate: str | None = None,
    exit: ExitRule | None = None,
) -> list[Generation]:
    """Complete each prompt (token ids) with one KV-cached forward per step; one `Generation` per prompt, in order.

    Row i samples from `generators[i]` (None: the global RNG); temperature 0 is greedy. `should_stop(i, new)` is
    asked after each new token of prompt i with its new tokens so far (that token included); True finishes the row
    keeping the token. `extrapolate` picks the rule for depths past the trained one (None: the architecture's
    default); `exit` turns on the per-token adaptive exit with `n_recur` as the maximum depth. Runs under
    `torch.no_grad()`.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts")
    with torch.no_grad():
        return _Decoder(model, prompts, max_new_tokens, n_recur, generators, extrapolate, exit).run(
            temperature, top_k, top_p, stop_ids, should_stop
        )


class _Decoder:
    """The live batch of one `generate` call: token buffer, prompt lengths, rows still running and their cache."""

    def __init__(self, model, prompts, max_new_tokens, n_recur, generators, extrapolate=None, exit=None):
        self.model, self.n_recur, self.max_new = model, n_recur, max_new_tokens
        self.extrapolate, self.exit = extrapolate, exit
        device = next(model.parameters()).device
        self.ctx = model.args.max_seq_len
        B = len(prompts)
        plen = [len(p) for p in prompts]
        self.seq = torch.zeros(B, max(plen) + max_new_tokens, dtype=torch.long, device=device)  # (B, T_total)
        for b, p in enumerate(prompts):
            self.seq[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.plen = torch.tensor(plen, device=device)  # (B,)
        self.rows = list(range(B))  # original index of each live row
        self.gens = list(generators) if generators is not None else [None] * B
        self.results: list[Generation | None] = [None] * B
        self.T = min(plen)  # tokens per row fed so far; all live rows share positions
        self.cache: KVCache | None = KVCache(self.ctx)
        self.depth_sum = torch.zeros(B, dtype=torch.float64, device=device)  # (B,) exit depths of processed positions
        self.depth_n = torch.zeros(B, dtype=torch.long, device=device)

    def _forward(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Logits (b, T, V) of one forward, at the requested depth or with the adaptive exit."""
        if self.exit is None:
            extra = {} if self.extrapolate is None else {"extrapolate": self.extrapolate}
            return self.model(tokens, n_recur=self.n_recur, cache=cache, **extra)[0]
        out = self.model.iterate(
            tokens, n_recur=self.n_recur, cache=cache, extrapolate=self.extrapolate, exit=self.exit
        )
        self.depth_sum += out.depths.sum(-1).double()
        self.depth_n += out.depths.shape[-1]
        return out.logits

    def run(self, temperature, top_k, top_p, stop_ids, should_stop) -> list[Generation]:
        seq, T, ctx = self.seq, self.T, self.ctx
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=seq.device)
        logits = self._forward(seq[:, max(0, T - ctx) : T], self.cache)
        if T >= ctx:
            self.cache = None  # no room left: slide the window from here on
        while True:
            sampling = self.T >= self.plen  # (b,) rows past their prompt choose token T; the others are fed theirs
            tok = self._next_tokens(logits[:, -1, :], sampling, temperature, top_k, top_p)
            self.seq[:, self.T] = tok
            is_stop = sampling & torch.isin(tok, stop)
            n_new = self.T + 1 - self.plen  # (b,) new tokens so far, stop token included
            finished = is_stop | (sampling & (n_new >= self.max_new))
            if should_stop is not None:
                asked = self._asked(should_stop, sampling & ~is_stop)
                is_stop, finished = is_stop | asked, finished | asked
            if bool(finished.any()) and not self._finish(finished, is_stop, stop):
                break
            self.T += 1
            logits = self._step()
        return [r for r in self.results if r is not None]

    def _next_tokens(self, last, sampling, temperature, top_k, top_p) -> torch.Tensor:
        """Token T of every live row: its prompt's token, or a sample from `last` (b, V) for rows past the prompt."""
        tok = self.seq[:, self.T].clone()  # (b,)
        if bool(sampling.any()):
            if temperature <= 0:
                tok = torch.where(sampling, last.argmax(dim=-1), tok)
            else:
                probs = F.softmax(filter_logits(last, temperature, top_k, top_p), dim=-1)  # (b, V)
                for r in sampling.nonzero().flatten().tolist():  # one draw per row, from that row's own stream
                    tok[r] = torch.multinomial(probs[r], 1, generator=self.gens[r])[0]
        return tok

    def _asked(self, should_stop, candidates: torch.Tensor) -> torch.Tensor:
        """Rows (among candidates) whose caller-side rule says the generation is complete with this token."""
        out = torch.zeros_like(candidates)
        for r in candidates.nonzero().flatten().tolist():
            start = int(self.plen[r])
            out[r] = bool(should_stop(self.rows[r], self.seq[r, start : self.T + 1].tolist()))
        return out

    def _finish(self, finished: torch.Tensor, is_stop: torch.Tensor, stop: torch.Tensor) -> bool:
        """Record the finished rows and drop them from the batch and the cache; False when none is left."""
        for r in finished.nonzero().flatten().tolist():
            start = int(self.plen[r])
            dropped = bool(is_stop[r]) and bool(torch.isin(self.seq[r, self.T], stop))  # a stop id is not kept
            end = self.T + (0 if dropped else 1)
            depth = float(self.depth_sum[r] / self.depth_n[r]) if self.exit is not None else None
            self.results[self.rows[r]] = Generation(
                self.seq[r, start:end].tolist(), "eos" if bool(is_stop[r]) else "length", depth
            )
        keep = (~finished).nonzero().flatten()  # (b',)
        if keep.numel() == 0:
            return False
        self.seq, self.plen = self.seq[keep], self.plen[keep]
        self.depth_sum, self.depth_n = self.depth_sum[keep], self.depth_n[keep]
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.gens = [self.gens[i] for i in keep.tolist()]
        if self.cache is not None:
            self.cache.select_rows(keep)
        return True

    def _step(self) -> torch.Tensor:
        """Logits after feeding token T-1: one cached token while the context has room, else the slid window."""
        T, ctx = self.T, self.ctx
        if self.cache is not None and self.cache.pos < ctx:
            return self._forward(self.seq[:, T - 1 : T], self.cache)
        self.cache = None
        return self._forward(self.seq[:, max(0, T - ctx) : T], None)
