"""Generation and evaluation that really skip: what recurrence costs and saves at inference.

`BaseLM.iterate`'s adaptive exit computes every iteration for every token (an exited token's state is frozen, but its
keys and values are still computed at every later iteration, so every other token can attend to them). This module
runs the same iteration hooks (`prelude`, `core_step`, `coda`) with a token that has exited NOT computed at later
iterations: each iteration runs on the tokens still active only, gathered per batch row (padded to the row with the
most; the padding's results are discarded and its keys and values written to a slot position nobody reads).

What an active token at iteration i attends to, for every earlier position, is an explicit **KV strategy** (`kv`):

- `full`: every (position, iteration) entry is computed and cached, exited positions included (their frozen state's
  keys and values, as `iterate` does): exact, and nothing is skipped;
- `last`: an exited position's entries for deeper iterations are those of its last computed iteration (copied into
  the deeper slots when it exits);
- `budget:K`: K cache slots per core block call; iteration i writes and reads slot i mod K, so a slot holds, for every
  position, the latest iteration that wrote it (an exited position's last computed entry fills every slot it would
  have written later, as for `last`);
- `first`: every iteration reads the entries of the first iteration (one slot per core block call); later iterations
  compute only their queries from the current state (no key or value projections: `StaticKVCache.reuses_kv`).

The blocks outside the recurrence (prelude, coda) keep one slot per block call, as in `generate`. Every strategy at
threshold 0 (no token exits) is its own non-skipping reference (tests/test_inference.py writes those references out
plainly), and `full` at threshold 0 is today's `iterate`/`generate`.

Compute is counted per token as spent: each phase's matmul FLOPs per token (measured once per model and setting with
torch's flop counter on a one-token forward) plus attention over the keys the token really attends to (its position
+ 1; 4 * keys * n_heads * head_dim per block call, the convention of `block_forward_flops`), for every iteration the
token really computed. With the `kl` exit rule each computed iteration also pays its probe (coda, final norm and
head). The KV bytes are what the cache holds for the positions cached: slots x rows x positions x kv heads x head dim
x 2 (keys and values) x element size (the cache is preallocated to the generation's length; the count is of the
positions filled, at their largest).

Warm start (`warm_start=True`): a token's recurrent state starts from the previous token's final state (before the
coda) instead of the architecture's initial state, for the architectures whose initial state does not carry the token
(`BaseLM.warm_startable`); each token then depends on the one before it, so every forward runs one token at a time
(the prompt too).

Fixed-depth architectures (no iteration hooks) run the default setting only (trained depth, no exit, `full`), through
their `schedule` with the same cache and counting, so they can stand beside the others as the reference.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from architectures.base import EXIT_RULES, BaseLM, ExitRule, RecurrenceError
from architectures.blocks import StaticKVCache
from architectures.generate import sample_next
from architectures.kernels import IGNORE_INDEX

KV_STRATEGIES = ("full", "last", "budget:K", "first")
DEFAULT_EXIT_RULE = EXIT_RULES[0]  # "kl": the rule a setting without `exit_rule` uses


def _parse_kv(kv: str) -> tuple[str, int | None]:
    """("full" | "last" | "budget" | "first", the budget K or None); ValueError for anything else."""
    if kv in ("full", "last", "first"):
        return kv, None
    if kv.startswith("budget:"):
        text = kv.removeprefix("budget:")
        try:
            k = int(text)
        except ValueError:
            k = 0
        if k >= 1 and str(k) == text:
            return "budget", k
        raise ValueError(f"kv strategy {kv!r}: the budget must be a whole number >= 1, e.g. budget:2")
    raise ValueError(f"unknown kv strategy {kv!r}; choose one of {', '.join(KV_STRATEGIES)}")


@dataclass(frozen=True)
class InferenceSetting:
    """How a model runs at inference: depth, per-token exit, KV strategy and warm start (see the module docstring)."""

    n_recur: int | None = None  # None: the trained depth
    exit_threshold: float = 0.0  # 0: never exit (full depth)
    exit_rule: str | None = None  # None: the default rule ("kl")
    kv: str = "full"  # "full" | "last" | "budget:K" | "first"
    warm_start: bool = False

    def __post_init__(self) -> None:
        if self.n_recur is not None and (isinstance(self.n_recur, bool) or self.n_recur < 1):
            raise ValueError(f"n_recur must be >= 1 (or None for the trained depth), got {self.n_recur!r}")
        if not (isinstance(self.exit_threshold, (int, float)) and self.exit_threshold >= 0):
            raise ValueError(f"exit threshold must be >= 0, got {self.exit_threshold!r}")
        if self.exit_rule is not None and self.exit_rule not in EXIT_RULES:
            raise ValueError(f"unknown exit rule {self.exit_rule!r}; choose one of {', '.join(EXIT_RULES)}")
        _parse_kv(self.kv)

    @property
    def rule(self) -> str:
        return self.exit_rule or DEFAULT_EXIT_RULE

    def exit(self) -> ExitRule | None:
        """The `ExitRule` of this setting, None when no token ever exits (threshold 0)."""
        return ExitRule(self.rule, float(self.exit_threshold)) if self.exit_threshold > 0 else None

    def label(self) -> str:
        """Short stable text, e.g. "n=4 exit=0.001 kv=last"; `parse` reads it back. Defaults are left out (the
        default setting is "n=trained")."""
        parts = [f"n={self.n_recur}" if self.n_recur is not None else "n=trained"]
        if self.exit_threshold > 0:
            parts.append(f"exit={self.exit_threshold:g}")
        if self.exit_rule is not None:
            parts.append(f"rule={self.exit_rule}")
        if self.kv != "full":
            parts.append(f"kv={self.kv}")
        if self.warm_start:
            parts.append("warm")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> InferenceSetting:
        """The setting a `label` names: space-separated `n=<int|trained>`, `exit=<float>`, `rule=<kl|latent>`,
        `kv=<strategy>`, `warm`, each at most once, any order; an empty text is the default setting."""
        kw: dict[str, Any] = {}
        keys = {"n": "n_recur", "exit": "exit_threshold", "rule": "exit_rule", "kv": "kv"}
        for word in text.split():
            value: Any
            if word == "warm":
                name, value = "warm_start", True
            elif "=" in word and word.split("=", 1)[0] in keys:
                key, raw = word.split("=", 1)
                name = keys[key]
                value = raw
                try:
                    if key == "n":
                        value = None if raw == "trained" else int(raw)
                    elif key == "exit":
                        value = float(raw)
                except ValueError:
                    raise ValueError(f"inference setting {text!r}: {key}= needs a number, got {raw!r}") from None
            else:
                raise ValueError(
                    f"inference setting {text!r}: cannot read {word!r} (expected n=<int|trained>, exit=<threshold>, "
                    f"rule=<{'|'.join(EXIT_RULES)}>, kv=<{'|'.join(KV_STRATEGIES)}> or warm)"
                )
            if name in kw:
                raise ValueError(f"inference setting {text!r}: {word.split('=')[0]} given twice")
            kw[name] = value
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"inference setting {text!r}: {e}") from None


@dataclass
class InferenceResult:
    tokens: list[list[int]]  # generated tokens per prompt (a stop id excluded)
    flops_per_token: float  # forward FLOPs spent per token the decode phase produced (see `generate_adaptive`)
    kv_bytes: int  # peak KV-cache bytes held
    mean_depth: float  # mean iterations computed per token the decode phase produced
    prefill_seconds: float
    decode_seconds: float
    new_tokens: int
    # mean exit depth over the same tokens (the iteration each token's state froze at); equals mean_depth except
    # under `full`, which computes every iteration of an exited token too
    mean_exit_depth: float = 0.0


@dataclass
class SpeculativeResult(InferenceResult):
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # of which the verifier accepted
    acceptance_rate: float = 0.0  # accepted / proposed (0 when nothing was proposed)


def supports(model: BaseLM, setting: InferenceSetting) -> str | None:
    """None if `model` can run `setting`, else a one-line reason."""
    cls = type(model)
    name = getattr(model, "name", cls.__name__)
    if not cls.iterable():
        default = setting.n_recur in (None, model.args.n_recur) and setting.exit_threshold == 0
        if default and setting.kv == "full" and not setting.warm_start:
            return None
        return f"{name}: fixed-depth architecture (no iteration hooks): only its trained depth, no exit, kv=full"
    try:
        model.resolve_n_recur(setting.n_recur)
    except RecurrenceError as e:
        return str(e)
    if setting.warm_start and not cls.warm_startable:
        return f"{name}: no warm start: its recurrent state starts from the token itself, not an initial state"
    return None


def kv_slots(model: BaseLM, setting: InferenceSetting) -> int:
    """Cache slots (one (keys, values) pair of rows x positions each) the setting declares: one per block call of the
    prelude and coda, and per block call of the recurrent step n (full, last), min(K, n) (budget:K) or 1 (first)."""
    costs = _costs(model, setting)
    kind, k = _parse_kv(setting.kv)
    n = costs.n
    per_step = {"full": n, "last": n, "first": 1, "budget": min(k or 1, n)}[kind]
    return costs.outer_calls + per_step * costs.step_calls


def kv_bytes_per_token(model: BaseLM, setting: InferenceSetting) -> int:
    """KV-cache bytes the setting holds per cached position and row (its `kv_slots` x kv heads x head dim x 2 x the
    weights' element size)."""
    a = model.args
    elem = next(model.parameters()).element_size()
    return kv_slots(model, setting) * a.n_kv_heads * (a.dim // a.n_heads) * 2 * elem


# ---- the cache ------------------------------------------------------------------------------------------------------


class _Cache(StaticKVCache):
    """The engine's KV cache. A `StaticKVCache` to the blocks (`Attention.attend` writes through `write` and reads the
    whole returned keys under the returned mask), but its slots are named by phase, iteration and block call, so the
    KV strategy decides which slot an iteration writes and reads, and queries may be any positions of each row (the
    gathered active tokens). Slots hold `capacity + 1` positions: the last one takes the padding's writes and is never
    read."""

    def __init__(self, kind: str, budget: int | None, capacity: int, rows: int):
        super().__init__(capacity)
        self.kind, self.budget, self.capacity, self.rows = kind, budget, capacity, rows
        self.slots: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.phase: tuple[str, int] = ("p", 0)
        self.calls = 0
        self.writes = 0  # block calls (attention) since `reset_count`
        self.widx: torch.Tensor | None = None  # (B, m) slot position each query writes
        self.qrows: torch.Tensor | None = None  # the rows the queries belong to (None: every row, in order)
        self.qmask: torch.Tensor | None = None  # (B, 1, m, L)
        self.L = 0

    def queries(self, qpos: torch.Tensor, valid: torch.Tensor | None, L: int, rows: torch.Tensor | None = None) -> None:
        """The next block calls' queries: positions (b, m) of each of the rows `rows` (None: every row), which are
        real (`valid`, None: all), and the number of key positions to read (one past the largest real position)."""
        self.qrows = rows
        self.widx = qpos if valid is None else torch.where(valid, qpos, torch.full_like(qpos, self.capacity))
        keys = torch.arange(L, device=qpos.device)
        self.qmask = (keys[None, None, None, :] <= qpos[:, None, :, None]).contiguous()
        self.L = L

    def begin_phase(self, phase: str, iteration: int = 0) -> None:
        self.phase, self.calls = (phase, iteration), 0

    def reuses_kv(self) -> bool:
        # `first` past the first iteration: the block computes its queries only
        return self.kind == "first" and self.phase[0] == "r" and self.phase[1] > 0

    def _key(self, j: int) -> tuple[tuple[Any, ...], bool]:
        """(slot key of block call j of the current phase, whether this call writes it)."""
        phase, it = self.phase
        if phase != "r":
            return (phase, j), True
        if self.kind == "first":
            return ("r", 0, j), it == 0
        if self.kind == "budget":
            assert self.budget is not None
            return ("r", it % self.budget, j), True
        return ("r", it, j), True

    def _slot(self, key: tuple[Any, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.slots:
            _, H, _, D = like.shape
            z = like.new_zeros(self.rows, H, self.capacity + 1, D)
            self.slots[key] = (z, z.clone())
        return self.slots[key]

    def write(self, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.widx is None or self.qmask is None:
            raise RuntimeError("the engine sets the queries before a forward")
        key, writes = self._key(self.calls)
        self.calls += 1
        self.writes += 1
        if k is None or v is None:
            if writes or key not in self.slots:
                raise RuntimeError(f"block call {key} has no stored keys and values to reuse")
            ck, cv = self.slots[key]
            return self._read(ck), self._read(cv), self.qmask
        ck, cv = self._slot(key, k)
        if writes:
            if self.qrows is None:
                B, H, m, D = k.shape
                idx = self.widx[:, None, :, None].expand(B, H, m, D)
                ck.scatter_(2, idx, k.to(ck.dtype))
                cv.scatter_(2, idx, v.to(cv.dtype))
            else:  # (b, 1) rows x (b, m) positions index (b, m, H, D)
                r = self.qrows[:, None]
                ck[r, :, self.widx] = k.transpose(1, 2).to(ck.dtype)
                cv[r, :, self.widx] = v.transpose(1, 2).to(cv.dtype)
        return self._read(ck), self._read(cv), self.qmask

    def _read(self, c: torch.Tensor) -> torch.Tensor:
        return c[:, :, : self.L] if self.qrows is None else c[self.qrows, :, : self.L]

    def copy_exited(self, it: int, n: int, step_calls: int, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Positions `pos` of rows `rows` exited after iteration `it`: fill the recurrent slots their iterations
        it+1 .. n-1 would have written with iteration it's entries (`last`, `budget`)."""
        if self.kind not in ("last", "budget") or rows.numel() == 0:
            return
        for j in range(step_calls):
            src_key = ("r", it if self.kind == "last" else it % (self.budget or 1), j)
            if src_key not in self.slots:
                continue
            sk, sv = self.slots[src_key]
            targets = {("r", i if self.kind == "last" else i % (self.budget or 1), j) for i in range(it + 1, n)}
            for key in targets - {src_key}:
                ck, cv = self._slot(key, sk)
                ck[rows, :, pos] = sk[rows, :, pos]
                cv[rows, :, pos] = sv[rows, :, pos]

    def select_rows(self, keep: torch.Tensor) -> None:
        self.slots = {key: (k[keep], v[keep]) for key, (k, v) in self.slots.items()}
        self.rows = int(keep.numel())

    def bytes_held(self, rows: int) -> int:
        """Bytes of the slots' entries for the positions cached so far, `rows` rows."""
        total = 0
        for k, _ in self.slots.values():
            _, H, _, D = k.shape
            total += 2 * rows * H * self.pos * D * k.element_size()
        return total


# ---- compute per phase ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    """What a token pays for each phase it runs at context S (the keys it attends to): `lin + per_key * S` forward
    FLOPs, with lin the phase's matmuls (attention excluded) and per_key the attention of its block calls; and the block
    calls per phase (the cache slots it takes)."""

    n: int
    prelude: tuple[float, float]  # (lin, per_key)
    steps: tuple[tuple[float, float], ...]  # per iteration t
    coda: tuple[float, float]
    head: float
    prelude_calls: int
    step_calls: int
    coda_calls: int

    @property
    def outer_calls(self) -> int:
        return self.prelude_calls + self.coda_calls

    @staticmethod
    def _at(cost: tuple[float, float], keys: float, tokens: float) -> float:
        return cost[0] * tokens + cost[1] * keys

    def prelude_at(self, keys: float, tokens: float) -> float:
        """FLOPs of the prelude over `tokens` tokens attending to `keys` keys in all."""
        return self._at(self.prelude, keys, tokens)

    def step_at(self, t: int, keys: float, tokens: float) -> float:
        return self._at(self.steps[t], keys, tokens)

    def coda_at(self, keys: float, tokens: float) -> float:
        return self._at(self.coda, keys, tokens)


_COSTS: weakref.WeakKeyDictionary[BaseLM, dict[tuple[int, str], _Costs]] = weakref.WeakKeyDictionary()


def _matmul_flops(fc: FlopCounterMode) -> float:
    # attention is added per key (torch's count of it depends on the device's SDPA kernel: none for a masked CPU call)
    counts = fc.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in counts.items() if "attention" not in str(op)))


def _costs(model: BaseLM, setting: InferenceSetting) -> _Costs:
    """Measure the phases once on a one-token forward with torch's flop counter (cached per model, depth and KV
    strategy); attention is 4 * n_heads * head_dim per key and block call. A fixed-depth model's schedule is counted
    analytically (`flops_per_token` at context S, linear in S), its block calls by the cache."""
    iterable = type(model).iterable()
    n = model.resolve_n_recur(setting.n_recur)
    key = (n, setting.kv if iterable else "full")
    per_model = _COSTS.setdefault(model, {})
    if key in per_model:
        return per_model[key]
    a = model.args
    attn = 4.0 * a.n_heads * (a.dim // a.n_heads)
    device = next(model.parameters()).device
    kind, budget = _parse_kv(setting.kv)
    cache = _Cache(kind, budget, 1, 1)
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
    cos, sin = model.rope_cos[:1], model.rope_sin[:1]
    cache.queries(torch.zeros(1, 1, dtype=torch.long, device=device), None, 1)
    steps: list[tuple[float, float]] = []
    calls: dict[str, int] = {"p": 0, "r": 0, "c": 0}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode():

        def run(phase: str, it: int, fn: Any) -> tuple[tuple[float, float], Any]:
            cache.begin_phase(phase, it)
            before = cache.writes
            with FlopCounterMode(display=False) as fc:
                out = fn()
            calls[phase] = cache.writes - before
            return (_matmul_flops(fc), calls[phase] * attn), out

        h = model.embed(tokens)
        if iterable:
            rule = model.resolve_extrapolate(None)
            pre, (s, ctx) = run("p", 0, lambda: model.prelude(h, cos, sin, cache))
            for t in range(n):
                f, s = run("r", t, lambda t=t, s=s: model.core_step(s, ctx, t, cos, sin, cache, rule))
                steps.append(f)
            coda, _ = run("c", 0, lambda: model.coda(s, cos, sin, cache))
        else:
            run("p", 0, lambda: model.schedule(h, cos, sin, n, cache))
            f1, f2 = (model.flops_per_token(S, n, training=False) - 2.0 * a.dim * a.vocab_size for S in (1, 2))
            pre, coda = (2 * f1 - f2, f2 - f1), (0.0, 0.0)
        model.__dict__.pop("_forward_stats", None)
    out = _Costs(
        n=n,
        prelude=pre,
        steps=tuple(steps),
        coda=coda,
        head=2.0 * a.dim * a.vocab_size,
        prelude_calls=calls["p"],
        step_calls=calls["r"],
        coda_calls=calls["c"],
    )
    per_model[key] = out
    return out


# ---- the engine -----------------------------------------------------------------------------------------------------


class _Engine:
    """One model, one cache, any number of forwards with a setting whose KV strategy is the cache's."""

    def __init__(self, model: BaseLM, setting: InferenceSetting, rows: int, capacity: int):
        why = supports(model, setting)
        if why is not None:
            raise RecurrenceError(why)
        self.model = model
        self.iterable = type(model).iterable()
        self.kind, budget = _parse_kv(setting.kv)
        self.cache = _Cache(self.kind, budget, capacity, rows)
        self.device = next(model.parameters()).device
        self.rows = rows
        self.flops = 0.0  # spent since the last `take`
        self.depth_sum = 0.0  # iterations computed since the last `take` (token-iterations)
        self.exit_sum = 0.0  # exit depths since the last `take`, summed over tokens
        self.kv_peak = 0
        self.last_state: torch.Tensor | None = None  # (B, 1, ds): each row's final state of its last token

    def take(self) -> tuple[float, float, float]:
        """(FLOPs, iterations computed, exit depths) since the last call, summed over tokens."""
        out = (self.flops, self.depth_sum, self.exit_sum)
        self.flops, self.depth_sum, self.exit_sum = 0.0, 0.0, 0.0
        return out

    def select_rows(self, keep: torch.Tensor) -> None:
        self.cache.select_rows(keep)
        if self.last_state is not None:
            self.last_state = self.last_state[keep]
        self.rows = int(keep.numel())

    def forward(self, tokens: torch.Tensor, setting: InferenceSetting) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) at the cache's position -> (hidden states before the final norm (B, T, d), depths (B, T)).
        With warm start the tokens run one at a time."""
        if setting.warm_start and tokens.shape[1] > 1:
            hs, ds = zip(*(self.forward(tokens[:, i : i + 1], setting) for i in range(tokens.shape[1])))
            return torch.cat(hs, 1), torch.cat(ds, 1)
        h, depths = self._forward(tokens, setting)
        self.exit_sum += float(depths.sum())
        self.kv_peak = max(self.kv_peak, self.cache.bytes_held(self.rows))
        return h, depths

    def _forward(self, tokens: torch.Tensor, setting: InferenceSetting) -> tuple[torch.Tensor, torch.Tensor]:
        model, cache = self.model, self.cache
        costs = _costs(model, setting)
        n = costs.n
        B, T = tokens.shape
        p0 = cache.pos
        if p0 + T > cache.capacity:
            raise ValueError(f"sequence of {p0 + T} tokens exceeds the cache's {cache.capacity} positions")
        if model.reports_stats:
            model.__dict__.pop("_forward_stats", None)
        positions = torch.arange(p0, p0 + T, device=tokens.device)
        cos, sin = model.rope_cos[positions], model.rope_sin[positions]
        qpos = positions.expand(B, T)
        keys_all = B * (T * p0 + T * (T + 1) / 2)  # keys the B x T tokens attend to in all
        cache.queries(qpos, None, p0 + T)
        cache.begin_phase("p")
        h = model.embed(tokens)
        if not self.iterable:
            h = model.schedule(h, cos, sin, n, cache)
            cache.begin_phase("c")
            self.flops += costs.prelude_at(keys_all, B * T)
            self.depth_sum += n * B * T
            cache.advance(T)
            model.__dict__.pop("_forward_stats", None)
            return h, torch.full((B, T), n, dtype=torch.long, device=tokens.device)
        rule = model.resolve_extrapolate(None)
        s, ctx = model.prelude(h, cos, sin, cache)
        self.flops += costs.prelude_at(keys_all, B * T)
        if setting.warm_start and self.last_state is not None:
            s = self.last_state.to(s.dtype)
        exit = setting.exit()
        skip = self.kind != "full"
        depths = torch.full((B, T), n, dtype=torch.long, device=tokens.device)
        active = torch.ones(B, T, dtype=torch.bool, device=tokens.device)
        prev: torch.Tensor | None = None  # (B, T, V) log-probabilities of the last probe (kl)
        rel = torch.arange(T, device=tokens.device)
        n_act, keys_act = float(B * T), keys_all
        for t in range(n):
            gathered = skip and exit is not None and n_act < B * T
            rows: torch.Tensor | None = None
            idx: torch.Tensor | None = None
            valid: torch.Tensor | None = None
            if gathered and T == 1:  # one token per row (a decode step): run the rows still active
                rows = active[:, 0].nonzero().flatten()
                q, c_a, s_a, x, ctx_a = qpos[rows], cos, sin, s[rows], _rows(ctx, rows, B)
                cache.queries(q, None, p0 + T, rows)
            elif gathered:
                counts = active.sum(1)
                m = int(counts.max())
                order = torch.sort((~active).to(torch.int8), dim=1, stable=True).indices  # active first, in order
                idx = order[:, :m]  # (B, m)
                valid = rel[None, :m] < counts[:, None]
                q = torch.where(valid, p0 + idx, torch.zeros_like(idx))
                c_a, s_a = model.rope_cos[q], model.rope_sin[q]
                x = s.gather(1, idx[..., None].expand(B, m, s.shape[-1]))
                ctx_a = _gather(ctx, idx, B, T)
                cache.queries(q, valid, int(q.max()) + 1)
            else:
                q, c_a, s_a, x, ctx_a = qpos, cos, sin, s, ctx
                cache.queries(qpos, None, p0 + T)
            cache.begin_phase("r", t)
            new = model.core_step(x, ctx_a, t, c_a, s_a, cache, rule)
            # `full` computes every token (exited ones on their frozen state); the others only the active ones
            self.flops += costs.step_at(t, keys_act if skip else keys_all, n_act if skip else B * T)
            self.depth_sum += n_act if skip else B * T
            if exit is None:
                s = new
                continue
            if exit.rule == "kl":
                cache.begin_phase("c")
                cur = F.log_softmax(model.output(model.norm(model.coda(new, c_a, s_a, cache))).float(), dim=-1)
                self.flops += costs.coda_at(keys_act if skip else keys_all, n_act if skip else B * T)
                self.flops += costs.head * (n_act if skip else B * T)
                if prev is None:
                    prev = torch.full(
                        (B, T, model.args.vocab_size), -math.log(model.args.vocab_size), device=tokens.device
                    )
                if rows is not None:
                    prev_x = prev[rows]
                elif idx is not None:
                    prev_x = prev.gather(1, idx[..., None].expand(B, idx.shape[1], prev.shape[-1]))
                else:
                    prev_x = prev
                crit = F.kl_div(cur, prev_x, log_target=True, reduction="none").sum(-1)
                if rows is not None:
                    prev = prev.index_copy(0, rows, cur)
                elif idx is not None:
                    prev = prev.scatter(1, idx[..., None].expand_as(cur), cur)
                else:
                    prev = cur
            else:
                crit = (new - x).float().norm(dim=-1) / new.float().norm(dim=-1).clamp_min(1e-12)
            if rows is not None:
                s = s.index_copy(0, rows, new)
                done = torch.zeros_like(active).index_copy(0, rows, crit < exit.threshold)
            elif idx is None:
                s = torch.where(active[..., None], new, s)
                done = active & (crit < exit.threshold)
            else:
                assert valid is not None
                kept = torch.where(valid[..., None], new, x)  # padding writes back its own state: no change
                s = s.scatter(1, idx[..., None].expand_as(kept), kept)
                done = torch.zeros_like(active).scatter(1, idx, valid & (crit < exit.threshold))
            depths = torch.where(done, torch.full_like(depths, t + 1), depths)
            active = active & ~done
            if skip:
                rows, pos = done.nonzero(as_tuple=True)
                cache.copy_exited(t, n, costs.step_calls, rows, p0 + pos)
            stats = torch.stack([active.sum(), (active * (positions + 1)).sum()]).tolist()
            n_act, keys_act = float(stats[0]), float(stats[1])
            if skip and n_act == 0:
                break
        cache.queries(qpos, None, p0 + T)
        cache.begin_phase("c")
        h = model.coda(s, cos, sin, cache)
        self.flops += costs.coda_at(keys_all, B * T)
        self.last_state = s[:, -1:]
        cache.advance(T)
        model.__dict__.pop("_forward_stats", None)
        return h, depths


def _rows(ctx: Any, rows: torch.Tensor, B: int) -> Any:
    """The context of the rows `rows`: a (B, ...) tensor is indexed; anything else is passed as it is."""
    return ctx[rows] if torch.is_tensor(ctx) and ctx.dim() >= 1 and ctx.shape[0] == B else ctx


def _gather(ctx: Any, idx: torch.Tensor, B: int, T: int) -> Any:
    """The context of the gathered tokens: a (B, T, ...) tensor is gathered along positions; anything else is
    passed as it is."""
    if torch.is_tensor(ctx) and ctx.dim() >= 2 and tuple(ctx.shape[:2]) == (B, T):
        shape = (B, idx.shape[1], *ctx.shape[2:])
        return ctx.gather(1, idx.view(B, -1, *([1] * (ctx.dim() - 2))).expand(shape))
    return ctx


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---- the API --------------------------------------------------------------------------------------------------------


def generate_adaptive(
    model: BaseLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    setting: InferenceSetting,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] = (),
) -> InferenceResult:
    """Complete each prompt with `max_new_tokens` tokens (fewer when a row draws a stop id, which is not kept) under
    `setting`, skipping exited tokens. Prompts may differ in length: the batch starts at the shortest and feeds each
    longer prompt's tokens in place of samples (as `generate` does). Finished rows leave the batch.

    `flops_per_token` and `mean_depth` are over the decode phase: the forwards after the prefill, per token they fed
    (each produces the next token of its row); with no decode step (one new token) over the prefill's tokens.
    `prefill_seconds` is the forward over the prompts' common part, `decode_seconds` everything after it."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    plen = [len(p) for p in prompts]
    end = max(plen) + max_new_tokens
    if end - 1 > model.args.max_seq_len:
        raise ValueError(
            f"prompt plus {max_new_tokens} new tokens needs {end - 1} positions, the context has "
            f"{model.args.max_seq_len}"
        )
    B = len(prompts)
    stop = set(stop_ids)
    with torch.inference_mode():
        eng = _Engine(model, setting, B, end - 1)
        seq = torch.zeros(B, end, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            seq[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        live = list(range(B))
        out: list[list[int] | None] = [None] * B
        T = min(plen)
        t0 = _clock(device)
        h, _ = eng.forward(seq[:, :T], setting)
        logits = model.output(model.norm(h[:, -1]))
        eng.flops += _costs(model, setting).head * B
        t1 = _clock(device)
        pre_flops, pre_depth, pre_exit = eng.take()
        pre_tokens = B * T
        fed = 0
        while True:
            rows_plen = torch.tensor([plen[r] for r in live], device=device)
            sampled = sample_next(logits, temperature, top_k, top_p, generator)
            tok = torch.where(rows_plen <= T, sampled, seq[:, T])
            seq[:, T] = tok
            T += 1
            toks = tok.tolist()
            done = []
            for i, r in enumerate(live):
                if T <= plen[r]:
                    continue
                if toks[i] in stop:
                    out[r] = seq[i, plen[r] : T - 1].tolist()
                    done.append(i)
                elif T - plen[r] >= max_new_tokens:
                    out[r] = seq[i, plen[r] : T].tolist()
                    done.append(i)
            if done:
                keep_list = [i for i in range(len(live)) if i not in done]
                if not keep_list:
                    break
                keep = torch.tensor(keep_list, device=device)
                seq = seq[keep]
                live = [live[i] for i in keep_list]
                eng.select_rows(keep)
            h, _ = eng.forward(seq[:, T - 1 : T], setting)
            logits = model.output(model.norm(h[:, -1]))
            eng.flops += _costs(model, setting).head * len(live)
            fed += len(live)
        t2 = _clock(device)
    dec_flops, dec_depth, dec_exit = eng.take()
    tokens = [o if o is not None else [] for o in out]
    if fed:
        flops, depth, exit_depth, per = dec_flops, dec_depth, dec_exit, fed
    else:
        flops, depth, exit_depth, per = pre_flops, pre_depth, pre_exit, pre_tokens
    return InferenceResult(
        tokens=tokens,
        flops_per_token=flops / per,
        kv_bytes=eng.kv_peak,
        mean_depth=depth / per,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        new_tokens=sum(len(t) for t in tokens),
        mean_exit_depth=exit_depth / per,
    )


def reads_like_generation(setting: InferenceSetting) -> bool:
    """Whether one forward over a whole sequence reads the cache as generating it token by token would.

    Not under `budget:K`: in one forward every position's iteration i writes slot i mod K and the positions read
    each other's fresh entries, so the slots never hold another iteration's keys; generating, an earlier position's
    slot holds the last iteration that wrote it. Every other strategy (and the exits) reads the same entries either
    way."""
    return _parse_kv(setting.kv)[0] != "budget"


def evaluate_adaptive(
    model: BaseLM, tokens: torch.Tensor, targets: torch.Tensor, setting: InferenceSetting
) -> tuple[float, float, float]:
    """Teacher-forced: (mean cross-entropy over the targets (ignore index -1), forward FLOPs spent per token, mean
    iterations computed per token) over tokens (B, T) under `setting`, exited tokens skipped: one forward over the
    sequence, or one token at a time where that is what generation reads (`reads_like_generation`)."""
    B, T = tokens.shape
    with torch.inference_mode():
        eng = _Engine(model, setting, B, T)
        if reads_like_generation(setting):
            h, _ = eng.forward(tokens, setting)
        else:
            h = torch.cat([eng.forward(tokens[:, i : i + 1], setting)[0] for i in range(T)], 1)
        logits = model.output(model.norm(h)).float()
        eng.flops += _costs(model, setting).head * B * T
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    flops, depth, _ = eng.take()
    return float(loss), flops / (B * T), depth / (B * T)


def speculative_generate(
    model: BaseLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    draft: InferenceSetting,
    k: int,
    verify: InferenceSetting | None = None,
) -> SpeculativeResult:
    """Greedy self-speculative decoding, one prompt at a time: `draft` proposes k tokens (one forward each, e.g. at a
    shallow depth), `verify` (default: the trained depth, no exit) runs them in one forward and keeps the longest
    prefix that agrees with its own greedy choices, plus its own next token. The tokens are those of greedy decoding
    under `verify` where a forward's result does not depend on how tokens are grouped into forwards (kv full, last,
    first; no random initial state). Draft and verifier share one cache (the verifier's forward overwrites every
    entry the drafts wrote), so both use the same KV strategy; warm start is not supported here.

    `flops_per_token` and `mean_depth` count drafts and verifications together per token the decode phase produced
    (every new token but each prompt's first, which the prefill produces)."""
    verify = verify if verify is not None else InferenceSetting()
    for what, st in (("draft", draft), ("verifier", verify)):
        why = supports(model, st)
        if why is not None:
            raise RecurrenceError(f"{what}: {why}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if draft.kv != verify.kv:
        raise ValueError(f"draft and verifier share one cache: kv {draft.kv!r} and {verify.kv!r} differ")
    if draft.warm_start or verify.warm_start:
        raise ValueError("speculative decoding does not support warm start")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    out: list[list[int]] = []
    proposed = accepted = 0
    flops = depth = exit_depth = 0.0
    produced = 0
    kv_peak = 0
    pre_s = dec_s = 0.0
    with torch.inference_mode():
        for prompt in prompts:
            P = len(prompt)
            if P == 0:
                raise ValueError("every prompt needs at least one token")
            if P + max_new_tokens > model.args.max_seq_len:  # the verifier also feeds the last draft
                raise ValueError(f"prompt plus {max_new_tokens} new tokens exceed the context")
            # the verifier may look k tokens past the last one kept
            eng = _Engine(model, verify, 1, P + max_new_tokens + k)
            head = _costs(model, verify).head
            t0 = _clock(device)
            h, _ = eng.forward(torch.tensor([list(prompt)], device=device), verify)
            nxt = int(model.output(model.norm(h[:, -1])).argmax(-1))
            t1 = _clock(device)
            eng.take()
            new = [nxt]
            while len(new) < max_new_tokens:
                base = eng.cache.pos  # position of `nxt`, not yet fed
                drafts: list[int] = []
                feed = nxt
                for _ in range(min(k, max_new_tokens - len(new))):
                    h, _ = eng.forward(torch.tensor([[feed]], device=device), draft)
                    feed = int(model.output(model.norm(h[:, -1])).argmax(-1))
                    eng.flops += head
                    drafts.append(feed)
                eng.cache.pos = base
                h, _ = eng.forward(torch.tensor([[nxt, *drafts]], device=device), verify)
                choice = model.output(model.norm(h[0])).argmax(-1).tolist()  # greedy after each fed token
                eng.flops += head * len(choice)
                a = 0
                while a < len(drafts) and drafts[a] == choice[a]:
                    a += 1
                proposed += len(drafts)
                accepted += a
                eng.cache.pos = base + 1 + a  # entries past the kept tokens are overwritten later
                kept = drafts[:a] + [choice[a]]
                new.extend(kept)
                nxt = new[-1]
            new = new[:max_new_tokens]
            t2 = _clock(device)
            f, d, e = eng.take()
            flops, depth, exit_depth, produced = flops + f, depth + d, exit_depth + e, produced + len(new) - 1
            kv_peak = max(kv_peak, eng.kv_peak)
            pre_s, dec_s = pre_s + (t1 - t0), dec_s + (t2 - t1)
            out.append(new)
    per = max(produced, 1)
    return SpeculativeResult(
        tokens=out,
        flops_per_token=flops / per,
        kv_bytes=kv_peak,
        mean_depth=depth / per,
        prefill_seconds=pre_s,
        decode_seconds=dec_s,
        new_tokens=sum(len(t) for t in out),
        mean_exit_depth=exit_depth / per,
        proposed=proposed,
        accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else 0.0,
    )


__all__ = [
    "KV_STRATEGIES",
    "InferenceResult",
    "InferenceSetting",
    "SpeculativeResult",
    "evaluate_adaptive",
    "reads_like_generation",
    "generate_adaptive",
    "kv_bytes_per_token",
    "kv_slots",
    "speculative_generate",
    "supports",
]
