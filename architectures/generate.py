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
  token kept), or after `max_new_tokens` (one limit, or one per row); finished rows leave the batch and the KV
  cache (`KVCache.select_rows`).

Test-time depth: `n_recur` may exceed the trained depth (with the architecture's `extrapolate` rule), and `exit`
(an `ExitRule`) runs every forward through `BaseLM.iterate` with the per-token adaptive exit; each `Generation`
then carries `mean_depth`, the mean exit iteration over every position the model processed for that row (prompt
and generated tokens). Every iteration is still computed (see `BaseLM.iterate`), so the mean depth is what an
implementation skipping exited tokens would spend, not what this one did.

Two implementations of the same procedure. The decode path (`fast=True`, the default) runs under
`torch.inference_mode` through `BaseLM.decode`: a `StaticKVCache` preallocated to the context, written in place
and read up to the filled span (`SPAN_STEP`), RoPE rows gathered by a position tensor, no autograd Function, the
head on the last position only, and finished rows looked for every `check_every` tokens instead of after every
token (the rows that finished in between keep running until then and their extra tokens are discarded, so each
row's tokens are the same). Its per-token step can be
compiled (`compile=True`: inductor; on a CPU with a C++ wrapper, on CUDA as CUDA graphs where inductor records them;
see `compile_attempts`),
falling back to eager with the reason logged and reported. The reference path (`fast=False`) is the plain KV-cached
loop under `torch.no_grad()`, dropping finished rows at once; the decode path falls back to it, with the reason
reported, when the generation would run past the context window (where the window slides and every step re-encodes
it without a cache) or the model has no `decode`. Where other rows' draws depend on the batch's shape (random
initial states drawn for the whole batch, or sampling from the global RNG), the decode path looks for finished rows
after every token, so it draws exactly what the reference path draws.

`dtype` casts a copy of the weights once before generating (RoPE tables stay float32); casting the model once
with `cast_for_inference` and passing no dtype avoids the copy for callers that generate many batches. Under an
enclosing autocast both paths run as autocast says.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from architectures.base import ExitRule
from architectures.blocks import KVCache, StaticKVCache, is_column_major

log = logging.getLogger(__name__)

# Tokens between two looks for finished rows on the decode path: each look reads the new tokens on the host (a
# device sync), and rows that finished in between run on until then, wasting at most this many steps each.
DEFAULT_CHECK_EVERY = 8

# The decode path's attention reads each row's cache up to the next multiple of this many positions past the last
# written one (`StaticKVCache.span`), not the whole context: a compiled step compiles once more for each new length,
# and its first steps at a new length evaluate every guard, so the step is large enough to make both rare.
SPAN_STEP = 32


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
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    n_recur: int | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    extrapolate: str | None = None,
    exit: ExitRule | None = None,
    fast: bool = True,
    compile: bool = False,
    dtype: torch.dtype | None = None,
    check_every: int = DEFAULT_CHECK_EVERY,
    report: DecodeReport | None = None,
) -> list[Generation]:
    """Complete each prompt (token ids) with one KV-cached forward per step; one `Generation` per prompt, in order.

    Row i samples from `generators[i]` (None: the global RNG); temperature 0 is greedy. `should_stop(i, new)` is
    asked after each new token of prompt i with its new tokens so far (that token included); True finishes the row
    keeping the token. `extrapolate` picks the rule for depths past the trained one (None: the architecture's
    default); `exit` turns on the per-token adaptive exit with `n_recur` as the maximum depth.

    `fast` picks the decode path (default) or the reference path, `compile` compiles the decode path's step,
    `dtype` casts a copy of the weights for this call, `check_every` is the decode path's tokens between looks for
    finished rows (see the module docstring). `report`, when given, is filled with what ran.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
    if min(limits) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {min(limits)}")
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    rep = report if report is not None else DecodeReport()
    weights = next(model.parameters()).dtype
    if dtype is not None and dtype != weights:
        model = cast_for_inference(copy.deepcopy(model), dtype)
    device = next(model.parameters()).device
    rep.dtype = _dtype_name(next(model.parameters()).dtype)
    rep.autocast = (
        _dtype_name(torch.get_autocast_dtype(device.type))
        if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)
        else None
    )
    why_not = "asked for (fast=False)" if not fast else _fast_unavailable(model, prompts, limits)
    rep.compiled, rep.check_every = False, None
    rep.prefill_tokens = rep.decode_tokens = 0
    rep.prefill_seconds = rep.decode_seconds = 0.0
    if why_not is not None:
        rep.path, rep.reason = "reference", why_not
        with torch.no_grad():
            return _Decoder(model, prompts, limits, n_recur, generators, extrapolate, exit).run(
                temperature, top_k, top_p, stop_ids, should_stop, rep
            )
    rep.path, rep.reason = "fast", ""
    with torch.inference_mode():
        dec = _FastDecoder(model, prompts, limits, n_recur, generators, extrapolate, exit)
        return dec.run(temperature, top_k, top_p, stop_ids, should_stop, compile, check_every, rep)


@dataclass
class DecodeReport:
    """What one `generate` call ran: filled in by it when passed as `report`."""

    path: str = ""  # "fast" (the decode path) | "reference"
    reason: str = ""  # why the reference path ran, or why the decode path's step was not compiled ("" otherwise)
    compiled: bool = False  # the decode path's per-token step ran compiled
    compile_mode: str = ""  # how it was compiled: cpp-wrapper or python-wrapper (CPU), cudagraphs or inductor (CUDA)
    dtype: str = ""  # the weights' dtype during generation, e.g. "float32"
    autocast: str | None = None  # the enclosing autocast's dtype, None without autocast
    check_every: int | None = None  # tokens between looks for finished rows (decode path)
    # Timing, asked for by setting `timing` (on CUDA each phase boundary then synchronises the device): the prefill is
    # the forward over the prompts' common part; the decode phase everything after it (token choice, one forward per
    # step, finished rows), in which `decode_tokens` tokens were fed (live rows summed over the steps).
    timing: bool = False
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def _clock(self, device: torch.device) -> float:
        if self.timing and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def cast_for_inference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model`'s parameters (in place) to `dtype` for generation, keeping its RoPE tables in float32 (positions
    rotate in float32 whatever the weights' dtype, as in training under autocast), and lay its linear weights out for
    inference (`inference_layout`); returns the model, in eval mode."""
    model.to(dtype)
    for name in ("rope_cos", "rope_sin"):
        buf = getattr(model, name, None)
        if isinstance(buf, torch.Tensor):
            setattr(model, name, buf.float())
    inference_layout(model)
    return model.eval()


def inference_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Store every `nn.Linear` weight (out, in) column-major, in place: the same shape and values, with `in` the
    contiguous dimension of its transpose. A linear layer computes x W^T; with W row-major that is a GEMM on a
    transposed operand, which the CPU BLAS runs markedly slower for the few rows of a decode step than the same
    product on a contiguous (in, out) matrix. A weight tied to an embedding keeps working as one (a lookup reads its
    rows strided). Training keeps the row-major layout: this is for a model that only generates or scores."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not is_column_major(m.weight):
            m.weight.data = m.weight.data.t().contiguous().t()
    return model


def _fast_unavailable(model: torch.nn.Module, prompts: Sequence[Sequence[int]], limits: list[int]) -> str | None:
    """Why the decode path cannot run this call (None: it can)."""
    if not callable(getattr(model, "decode", None)):
        return f"{type(model).__name__} has no decode method"
    args: Any = getattr(model, "args", None)
    ctx = int(args.max_seq_len)
    need, i = max((len(p) + n - 1, i) for i, (p, n) in enumerate(zip(prompts, limits)))  # positions the forwards
    if need > ctx:  # see: all but the last new token
        return (
            f"a {len(prompts[i])}-token prompt plus {limits[i]} new tokens needs {need} positions, the context has "
            f"{ctx}: past it the window slides, re-encoding without a cache"
        )
    return None


def compiler_unavailable(device: torch.device) -> str | None:
    """Why `torch.compile` cannot compile the decode step on this device (None: it may)."""
    if device.type == "cpu":
        names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(shutil.which(c) for c in names if c):
            return "no C++ compiler found (inductor needs one to compile for a CPU)"
    elif device.type != "cuda":
        return f"compiling is only set up for cpu and cuda, not {device.type}"
    return None


def _decode_step(
    model: torch.nn.Module, tokens: torch.Tensor, cache: StaticKVCache, pos: torch.Tensor, kw: dict, greedy: bool
):
    """One forward of the decode path: what is compiled. The model is an argument, not a closure's, so a cached
    compiled step does not keep its model alive. `greedy`: the step returns each row's most likely next token (B,)
    instead of its logits (B, V), so a compiled step picks it inside the graph and the loop makes no call for it."""
    logits, depths = model.decode(tokens, cache, pos, **kw)  # type: ignore[operator]  # a BaseLM: checked before
    return (logits.argmax(dim=-1) if greedy else logits), depths


# Compiled steps, per model and per (device type, n_recur, extrapolate, exit, wrapper): a later generate call with the
# same settings reuses the compiled graphs instead of compiling again.
_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, Callable[..., Any]]] = weakref.WeakKeyDictionary()
# Why compiling failed, per model and the same keys: a later call goes straight to the next way (or eager) instead of
# compiling, and failing, all over again.
_FAILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, str]] = weakref.WeakKeyDictionary()


def compile_attempts(device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    """(name, inductor options) to try in order for the decode step on `device`.

    fallback_random: random ops (three-part's initial state) draw from torch's own generator, as in eager, so a
    compiled generation draws the same numbers. On a CUDA device triton.cudagraphs (what mode="reduce-overhead" sets)
    replays each step as one graph launch; inductor leaves a graph out of CUDA graphs with no more than a logged
    warning when it cannot record it (an input the step writes that is not a static address, say), so
    `cudagraph_or_error` makes that an error and the next way, the same kernels launched one by one (`inductor`),
    runs and is reported as such. On a CPU the generated code that calls the kernels is C++ (cpp_wrapper) first: a
    decode step of a small model is a few dozen small kernels, and the Python wrapper calling them one by one costs
    about as much as the kernels themselves; where that build fails, the Python wrapper.
    """
    base: dict[str, Any] = {"fallback_random": True}
    if device.type == "cuda":
        graphs = {**base, "triton.cudagraphs": True, "triton.cudagraph_or_error": True}
        return [("cudagraphs", graphs), ("inductor", base)]
    # the wrapper built apart from the kernels: one C++ unit holding both took minutes to build for the recurrent
    # models (every kernel compiled again inside the wrapper at -O3) and ran no faster
    cpp = {**base, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}
    return [("cpp-wrapper", cpp), ("python-wrapper", base)]


# A copy of the step function per model structure (class, arguments) and settings. Dynamo keeps compiled graphs per
# code object, at most recompile_limit of them (8), and past that runs the function eagerly: sharing
# `_decode_step`'s, the architectures of one process (a bench over the zoo) would use that limit up between them.
# Models of one structure share their copy, and so its graphs (the guards do not tell such models apart): the runs of
# one architecture in a study compile once.
_STEP_FNS: dict[tuple[Any, ...], Callable[..., Any]] = {}


def _compiled_step(model: torch.nn.Module, key: tuple[Any, ...], options: dict[str, Any]) -> Callable[..., Any]:
    per_model = _COMPILED.setdefault(model, {})
    if key not in per_model:
        structure = (type(model), repr(getattr(model, "args", None)), key)
        step = _STEP_FNS.get(structure)
        if step is None:
            code = _decode_step.__code__.replace()
            step = _STEP_FNS[structure] = types.FunctionType(code, _decode_step.__globals__, _decode_step.__name__)
        per_model[key] = torch.compile(step, backend="inductor", options=options)
    return per_model[key]


def _static(t: torch.Tensor) -> torch.Tensor:
    """`t` if it was made by `_static` before, else a copy of it in ordinary memory marked as a static address."""
    if getattr(t, "_benchctl_static", False):
        return t
    c = t.clone()
    torch._dynamo.mark_static_address(c)
    c._benchctl_static = True  # type: ignore[attr-defined]
    return c


def _static_cache(cache: StaticKVCache) -> None:
    """The cache's tensors as static addresses, before a step replayed as a CUDA graph: the step writes its slots in
    place, which inductor records only for static inputs. A copy is made once per tensor: the first time, and after
    rows leave the batch (`select_rows`)."""
    cache.k = [_static(t) for t in cache.k]
    cache.v = [_static(t) for t in cache.v]
    if cache._keys is not None:
        cache._keys = _static(cache._keys)


def _out_of_graph_memory(out: Any, cache: StaticKVCache) -> Any:
    """After a step replayed as a CUDA graph: its outputs, and any cache tensor it created, copied out of the graphs'
    memory pool, which the next step's replay reuses (CUDA graph trees start a new generation at every call of an
    inference step, freeing the last one's outputs)."""
    _static_cache(cache)
    if isinstance(out, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


# A step whose inputs have the shapes, dtypes and devices of the step before it (same batch, same model, same
# settings) runs the graph that step ran: after this many calls with every guard evaluated, the decode loop skips
# the guards that cannot tell its graph from the others compiled for this function (torch.compiler.set_stance's
# skip_guard_eval_unsafe), which saves a tenth of a small model's step on a CPU. The count restarts whenever rows
# leave the batch, the one change of input shapes within a generation.
FULL_GUARD_CALLS = 2


class _FastDecoder:
    """The decode path's live batch: token buffer (host-side prompt lengths), rows still running and their static
    cache. Same procedure and results as `_Decoder`; see the module docstring for how it differs."""

    def __init__(self, model, prompts, max_new_tokens, n_recur, generators, extrapolate=None, exit=None):
        self.model, self.max_new = model, list(max_new_tokens)  # per row
        self.kw = {"n_recur": n_recur, "extrapolate": extrapolate, "exit": exit}
        self.exit = exit
        device = self.device = next(model.parameters()).device
        self.ctx = model.args.max_seq_len
        B = len(prompts)
        self.plen = [len(p) for p in prompts]  # host-side: no sync to know which rows are still in their prompt
        self.end = max(p + n for p, n in zip(self.plen, self.max_new))  # every row has finished before this index
        self.seq = torch.zeros(B, self.end, dtype=torch.long, device=device)  # (B, T_total)
        for b, p in enumerate(prompts):
            self.seq[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.plen_t = torch.tensor(self.plen, device=device)  # (B,)
        self.rows = list(range(B))
        self.gens = list(generators) if generators is not None else [None] * B
        self.results: list[Generation | None] = [None] * B
        self.T = min(self.plen)
        self.cache = StaticKVCache(self.ctx)
        self.guard_calls = 0  # compiled steps run with every guard since the batch last changed (FULL_GUARD_CALLS)
        self.skipping: contextlib.ExitStack | None = None  # while compiled steps run with guards skipped
        self.greedy = False  # the steps return picked tokens, not logits (set by `run`)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # position of the next forward's first token
        # exit depth of every position each row processed (adaptive exit only)
        self.depth_at = torch.zeros(B, self.end, dtype=torch.float64, device=device) if exit is not None else None

    def _forward(self, step, tokens: torch.Tensor) -> torch.Tensor:
        T0, T = int(self.cache.pos), tokens.shape[1]
        span = min(self.ctx, -(-(T0 + T) // SPAN_STEP) * SPAN_STEP)
        if span != self.cache.span:
            # a new attended length: a compiled step checks every guard again (its graph for the old length would
            # otherwise run on, reading the old length)
            self.cache.span = span
            self.guard_calls = 0
        logits, depths = step(tokens, self.cache, self.pos)
        if self.depth_at is not None and depths is not None:
            self.depth_at[:, T0 : T0 + T] = depths.double()
        self.cache.advance(T)
        self.pos += T
        return logits

    def _step_fn(self, compile: bool, rep: DecodeReport) -> Callable[..., Any]:
        model, kw, greedy = self.model, self.kw, self.greedy

        def step(tokens, cache, pos):
            return _decode_step(model, tokens, cache, pos, kw, greedy)

        if not compile:
            rep.reason = "not asked for (compile=False)"
            return step
        why = compiler_unavailable(self.device)
        if why is not None:
            rep.reason = why
            log.warning("generate: decode step runs eager: %s", why)
            return step
        attempts = compile_attempts(self.device)
        failed: list[str] = []
        current: list[Any] = []  # (key, compiled step) of the way being used, once found

        def guarded(tokens, cache, pos):
            while current or attempts:
                if not current:
                    name, options = attempts[0]
                    key = (self.device.type, kw["n_recur"], kw["extrapolate"], kw["exit"], greedy, name)
                    known = _FAILED.get(model, {}).get(key)
                    if known is not None:  # failed for this model and settings before: not tried again every call
                        attempts.pop(0)
                        failed.append(known)
                        continue
                    current[:] = [key, _compiled_step(model, key, options)]
                key, compiled = current
                name = key[-1]
                try:
                    if name == "cudagraphs":
                        _static_cache(cache)
                    out = self._call_compiled(compiled, tokens, cache, pos)
                    if name == "cudagraphs":
                        out = _out_of_graph_memory(out, cache)
                except Exception as e:  # compilation failed (no toolchain, an unsupported op): the next way, then eager
                    if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):
                        limit = torch._dynamo.config.recompile_limit
                        reason = f"the step needs more than {limit} compiled graphs (torch._dynamo recompile_limit)"
                    else:
                        reason = f"compilation failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                    _COMPILED.get(model, {}).pop(key, None)
                    _FAILED.setdefault(model, {})[key] = reason
                    current.clear()
                    attempts.pop(0)
                    failed.append(reason)  # the last one is reported when every attempt failed
                    log.warning("generate: decode step (%s) not compiled: %s", name, reason)
                    continue
                rep.compiled, rep.reason, rep.compile_mode = True, "", name
                return out
            rep.compiled, rep.reason, rep.compile_mode = False, failed[-1], ""
            return step(tokens, cache, pos)

        return guarded

    def _call_compiled(self, compiled, tokens, cache, pos):
        """One compiled step; past the first FULL_GUARD_CALLS since the batch last changed, without the guards that
        cannot tell graphs apart. Should that find no graph (a change the count missed), the step is run again with
        every guard evaluated, which compiles what it needs.

        The stance that skips guards is entered once for a stretch of such steps (entering it costs about as much
        as a small model's argmax) and left before anything else runs: a step with every guard, the look for
        finished rows (`should_stop` is the caller's code), the end of the generation."""
        model, kw, greedy = self.model, self.kw, self.greedy
        if self.guard_calls >= FULL_GUARD_CALLS:
            if self.skipping is None:
                self.skipping = contextlib.ExitStack()
                self.skipping.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
            try:
                return compiled(model, tokens, cache, pos, kw, greedy)
            except Exception:
                self.guard_calls = 0
        self._stop_skipping_guards()
        # a step that checks every guard may compile a new graph: past dynamo's limit of graphs it would run the
        # step eagerly without a word, so it raises instead, and the caller reports the fallback
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = compiled(model, tokens, cache, pos, kw, greedy)
        self.guard_calls += 1
        return out

    def _stop_skipping_guards(self) -> None:
        """Leave the stance that skips guards, if in it: later compiled steps check every guard."""
        if self.skipping is not None:
            self.skipping.close()
            self.skipping = None

    def run(self, temperature, top_k, top_p, stop_ids, should_stop, compile, check_every, rep) -> list[Generation]:
        stop = set(stop_ids)
        B = len(self.rows)
        # rows whose draws depend on which other rows are still in the batch: look after every token (see docstring)
        shared_rng = temperature > 0 and any(g is None for g in self.gens)
        if B > 1 and (shared_rng or getattr(self.model, "draws_random_state", False)):
            check_every = 1
        rep.check_every = check_every
        self.greedy = temperature <= 0
        # the prefill runs eager: its length differs from the steps', and it creates the cache's slots
        eager = self._step_fn(False, DecodeReport())
        t0 = rep._clock(self.device)
        out = self._forward(eager, self.seq[:, : self.T])  # greedy: the picked tokens, else the logits
        t1 = rep._clock(self.device)
        rep.prefill_tokens, rep.prefill_seconds = B * self.T, t1 - t0
        step = self._step_fn(compile, rep)
        checked = self.T  # first token index not yet looked at
        try:
            while True:
                tok = self._next_tokens(out, temperature, top_k, top_p)
                self.seq[:, self.T] = tok
                self.T += 1
                if self.T - checked >= check_every or self.T == self.end:
                    self._stop_skipping_guards()
                    if not self._check(checked, stop, should_stop):
                        break
                    checked = self.T
                    tok = self.seq[:, self.T - 1]  # the rows still running
                if tok.stride(0) != 1:
                    # standard strides every step, whatever tok is a view of (a compiled step guards on strides,
                    # even those of a batch of one)
                    tok = tok.clone(memory_format=torch.contiguous_format)
                out = self._forward(step, tok.view(-1, 1))
                rep.decode_tokens += tok.shape[0]
        finally:
            self._stop_skipping_guards()
        rep.decode_seconds = rep._clock(self.device) - t1
        return [r for r in self.results if r is not None]

    def _next_tokens(self, last, temperature, top_k, top_p) -> torch.Tensor:
        """Token T of every live row: its prompt's token, or for rows past the prompt the step's pick (greedy: `last`
        holds the picked tokens (b,)) or a sample from `last` (b, V)."""
        T = self.T
        if self.greedy:
            if all(T >= p for p in self.plen):
                return last
            return torch.where(self.plen_t <= T, last, self.seq[:, T])
        tok = self.seq[:, T].clone()
        rows = [r for r, p in enumerate(self.plen) if T >= p]
        if rows:
            probs = F.softmax(filter_logits(last, temperature, top_k, top_p), dim=-1)  # (b, V)
            for r in rows:  # one draw per row, from that row's own stream
                tok[r] = torch.multinomial(probs[r], 1, generator=self.gens[r])[0]
        return tok

    def _check(self, first: int, stop: set[int], should_stop) -> bool:
        """Look at tokens first .. T-1 of every live row, in order, for the first that finishes it (a stop id,
        dropped; `should_stop`, kept; the length limit); record finished rows and drop them from the batch and the
        cache. False when no row is left."""
        toks = self.seq[:, : self.T].tolist()  # one read of the new tokens (and the prompts) per look
        done: list[int] = []
        for r, row in enumerate(toks):
            start = self.plen[r]
            for t in range(max(first, start), self.T):
                t_id = row[t]
                end, reason = None, ""
                if t_id in stop:
                    end, reason = t, "eos"
                elif should_stop is not None and should_stop(self.rows[r], row[start : t + 1]):
                    end, reason = t + 1, "eos"
                elif t + 1 - start >= self.max_new[r]:
                    end, reason = t + 1, "length"
                if end is not None:
                    depth = None
                    if self.depth_at is not None:  # positions processed before token t was chosen: 0 .. t-1
                        depth = float(self.depth_at[r, :t].mean())
                    self.results[self.rows[r]] = Generation(row[start:end], reason, depth)
                    done.append(r)
                    break
        if not done:
            return True
        keep_list = [r for r in range(len(self.rows)) if r not in set(done)]
        if not keep_list:
            return False
        keep = torch.tensor(keep_list, device=self.device)
        self.seq, self.plen_t = self.seq[keep], self.plen_t[keep]
        self.plen = [self.plen[r] for r in keep_list]
        self.max_new = [self.max_new[r] for r in keep_list]
        self.rows = [self.rows[r] for r in keep_list]
        self.gens = [self.gens[r] for r in keep_list]
        if self.depth_at is not None:
            self.depth_at = self.depth_at[keep]
        self.cache.select_rows(keep)
        self.guard_calls = 0  # new input shapes: the next steps evaluate every guard again
        return True


class _Decoder:
    """The live batch of one `generate` call: token buffer, prompt lengths, rows still running and their cache."""

    def __init__(self, model, prompts, max_new_tokens, n_recur, generators, extrapolate=None, exit=None):
        self.model, self.n_recur = model, n_recur
        self.extrapolate, self.exit = extrapolate, exit
        device = next(model.parameters()).device
        self.ctx = model.args.max_seq_len
        B = len(prompts)
        plen = [len(p) for p in prompts]
        self.max_new = torch.tensor(list(max_new_tokens), device=device)  # (B,) each row's limit
        self.seq = torch.zeros(B, max(p + n for p, n in zip(plen, max_new_tokens)), dtype=torch.long, device=device)
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

    def run(self, temperature, top_k, top_p, stop_ids, should_stop, rep: DecodeReport) -> list[Generation]:
        seq, T, ctx = self.seq, self.T, self.ctx
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=seq.device)
        t0 = rep._clock(seq.device)
        logits = self._forward(seq[:, max(0, T - ctx) : T], self.cache)
        t1 = rep._clock(seq.device)
        rep.prefill_tokens, rep.prefill_seconds = seq.shape[0] * min(T, ctx), t1 - t0
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
            rep.decode_tokens += self.seq.shape[0]
        rep.decode_seconds = rep._clock(seq.device) - t1
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
        self.seq, self.plen, self.max_new = self.seq[keep], self.plen[keep], self.max_new[keep]
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
