"""The base language model every architecture shares: embedding -> schedule of blocks -> final norm -> tied head.

Follows karpathy/llama2.c `Transformer`: token embedding tied with the output head, `n_layers` unique
`Block`s, final RMSNorm, init N(0, 0.02) for every Linear/Embedding with `w3` and `wo` re-drawn from
N(0, 0.02 / sqrt(2 * n_layers)) (llama2.c scales w3, not w2; we keep the quirk, with n_layers = unique blocks).

A subclass says only how its blocks are scheduled (`schedule`), which extra parameters it has
(`build_extra`/`init_extra`), how those count (`components`) and how much compute a token costs
(`flop_terms`). Sharing is one module called in a loop, never aliased copies.

`args` is any object with the trunk fields (dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size,
max_seq_len, norm_eps, rope_theta, dropout, init_std, n_recur) and, optionally, `arch_args`: an instance of the
architecture's own frozen arguments dataclass (`args_cls`, bound by `@register`); without it the model uses that
dataclass's defaults. benchctl's `ModelArgs` is one such object, but this package never imports benchctl.

Test-time recurrence. A recurrent architecture also exposes its schedule as prelude -> n iterations of a step ->
coda through three hooks (`prelude`, `core_step`, `coda`), so shared code can run it to any depth and look at the
state after each iteration: `iterate` runs depths past the trained one (with the architecture's extrapolation rule)
and the per-token adaptive exit. `schedule` stays the training path, bit-identical and fast; an architecture that
does not implement the hooks runs at its fixed depth only.

Adaptive computation. A training forward can say more than its next-token loss, through three calls an architecture
makes from inside its forward (`schedule`): `add_aux_loss(name, value, weight)` (a term the trainer adds to the loss it
optimises, e.g. a ponder cost or a router's balancing loss), `add_metric(name, value)` (a scalar the run records per
logged step, e.g. the mean ponder time) and `add_compute(forward_flops_per_token)` (the compute a piece of the schedule
really ran, when it depends on the data). The caller collects them with `take_stats()` after the forward. Whether the
training forward is causal is declared (`causal_training`, `inference_rule`) and checked by the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.blocks import AnyCache, Block, RMSNorm, StaticKVCache, block_forward_flops, precompute_rope
from architectures.kernels import IGNORE_INDEX, linear_cross_entropy, when_dynamo_loads


@dataclass(frozen=True, kw_only=True)
class ArchArgs:
    """Base of an architecture's own arguments: subclass it as a frozen dataclass, one field per argument.

    A field annotated `Literal["a", "b"]` lists its choices (the config layer checks them); everything else
    (ranges, shapes that involve the trunk) is the architecture's `validate_args`. The field names become the
    user-facing keys `model.<field>` and must not reuse a trunk field's name.
    """


class RecurrenceError(ValueError):
    """A test-time recurrence the architecture cannot run (e.g. more passes than it has depth encodings for)."""


Params = nn.Module | nn.Parameter | Iterable[nn.Module | nn.Parameter]

EXIT_RULES = ("kl", "latent")


@dataclass(frozen=True)
class ExitRule:
    """Per-token adaptive exit (the zero-shot exit of Geiping et al. 2025): a token stops iterating once its
    criterion falls below `threshold`; threshold <= 0 never exits.

    kl:     KL(previous || current) of the token's next-token distributions at successive iterations, summed over
            the vocabulary (the first iteration is compared against the uniform distribution).
    latent: ||s_prev - s_cur|| / ||s_cur|| of the recurrent state.
    """

    rule: str
    threshold: float

    def __post_init__(self) -> None:
        if self.rule not in EXIT_RULES:
            raise ValueError(f"unknown exit rule {self.rule!r}; choose one of {', '.join(EXIT_RULES)}")
        if not self.threshold >= 0:
            raise ValueError(f"exit threshold must be >= 0, got {self.threshold}")


@dataclass
class ForwardStats:
    """What one forward reported beyond its next-token loss (filled by `BaseLM.add_aux_loss`, `add_metric` and
    `add_compute`, collected with `BaseLM.take_stats`).

    aux:     name -> (term, weight): a scalar term (a 0-d tensor that carries gradients in training) and the weight it
             enters the optimised loss with; the optimised loss is cross-entropy + sum(weight * term).
    metrics: name -> scalar (a float or a 0-d tensor; tensors are detached when they are read).
    compute: (forward FLOPs per token of the sequence, takes part in backward) for each piece of the schedule the
             forward really ran, head excluded, the format of `BaseLM.flop_terms`; None when the architecture
             reported none (its compute is then the analytic count).
    """

    aux: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)
    compute: list[tuple[float, bool]] | None = None

    def aux_total(self) -> torch.Tensor | None:
        """sum(weight * term) over the auxiliary terms (None when there are none): what the trainer adds to the
        cross-entropy it optimises."""
        total: torch.Tensor | None = None
        for term, weight in self.aux.values():
            total = weight * term if total is None else total + weight * term
        return total

    def scalars(self) -> dict[str, float]:
        """Every auxiliary term (unweighted, as `aux/<name>`) and metric (as `arch/<name>`) as plain floats: the
        names a run's `metrics` table stores them under."""
        out = {f"aux/{k}": float(v.detach()) for k, (v, _) in self.aux.items()}
        out.update(
            {f"arch/{k}": float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in self.metrics.items()}
        )
        return out


class IterOutput(NamedTuple):
    logits: torch.Tensor | None  # (B, T, V), None when return_logits=False
    loss: torch.Tensor | None
    depths: torch.Tensor  # (B, T) int64: the iteration each token's state froze at (n_recur when it never exited)


def count(obj: Params) -> int:
    if isinstance(obj, nn.Parameter):
        return obj.numel()
    if isinstance(obj, nn.Module):
        return sum(p.numel() for p in obj.parameters())
    return sum(count(o) for o in obj)


class BaseLM(nn.Module):
    """embedding -> `schedule` -> final norm -> tied head. What a subclass must keep true:

    - `components(n_recur)` covers every parameter of the model (beyond the embedding and final norm, which the
      base adds): `param_report` checks that the components sum to the model's parameter count and raises
      otherwise, so a forgotten parameter is a failing test, not a wrong table.
    - The default `flop_terms` counts only the `Block`s found in components named "blocks", times their uses per
      token. A component of the architecture's own that does matmuls (an adapter, LoRA, a gate applied to
      activations) needs a `flop_terms` override, or its compute is missing from FLOPs/token (the tests compare
      the count with torch's flop counter).
    - `max_n_recur` defaults to the trained depth (`args.n_recur`): an architecture that can run deeper at test
      time (or only at depth 1) says so by overriding it.
    - Every parameter with two or more dimensions gets weight decay in training, everything else (norm gains,
      biases) none, whatever component it belongs to; a new matrix- or vector-shaped parameter is decayed or not
      by its shape alone.
    - The training forward is causal (`causal_training = True`: changing token t never changes the logits or the
      loss before t, in train mode), or the architecture sets `causal_training = False` and names in
      `inference_rule` the causal rule its evaluation and generation use instead (checked in eval mode).
    - An architecture that reports auxiliary losses, metrics or the compute it really ran (`add_aux_loss`,
      `add_metric`, `add_compute`; see `ForwardStats`) sets `reports_stats = True`: every forward then starts with
      empty stats, and the trainer stays eager under `train.compile` auto (a depth decided by the data would
      recompile or break the graph at every step).
    """

    name: ClassVar[str] = ""  # set by @register
    label: ClassVar[str] = ""  # human-readable name for tables and figures
    description: ClassVar[str] = ""
    args_cls: ClassVar[type[ArchArgs]] = ArchArgs  # the architecture's own arguments, set by @register
    # Inference-only rules for iterations past the trained depth, the default first. They never change what is
    # trained, so they are not arguments (not in the run id); callers pass one to `forward`/`iterate`.
    extrapolate_rules: ClassVar[tuple[str, ...]] = ()
    # True when an inference forward draws random numbers whose shape includes the batch (an initial state per row):
    # then which rows are still in the batch changes what every row draws, and generation must drop finished rows
    # at the token they finish to draw what the reference path draws.
    draws_random_state: ClassVar[bool] = False
    # The causality contract (checked by the registry tests). True: the training forward is causal. False: it is not
    # (e.g. top-k routing over the whole sequence lets a later token decide an earlier token's depth), and
    # `inference_rule` says, in a sentence, what causal rule evaluation and generation (eval mode) use instead.
    causal_training: ClassVar[bool] = True
    inference_rule: ClassVar[str] = ""
    # True when the recurrent state the prelude returns is an initial state that does not carry the token (the token
    # enters every step through the context instead): then a token's state may start from another token's final state
    # (warm start, `architectures.inference`). False for looped models, whose state is the token's own embedding.
    warm_startable: ClassVar[bool] = False
    # True when the forward reports auxiliary losses, metrics or its compute (`add_aux_loss`, `add_metric`,
    # `add_compute`): each forward then starts from empty stats.
    reports_stats: ClassVar[bool] = False
    # True when the compute a forward spends depends on the data (per-token halting or routing): `flops_per_token`
    # (every token at full depth) is then an upper bound, and what it spent is what it reports with `add_compute`.
    adaptive_compute: ClassVar[bool] = False
    rope_cos: torch.Tensor  # buffers (register_buffer in __init__), declared for the type checker
    rope_sin: torch.Tensor

    # ---- class-level hooks used by the config layer ------------------------------------------------------------

    @classmethod
    def arch_args_of(cls, args: Any) -> Any:
        """The architecture's own arguments carried by `args` (its dataclass's defaults when it carries none)."""
        own = getattr(args, "arch_args", None)
        return cls.args_cls() if own is None else own

    @classmethod
    def resolve_arch_args(cls, arch_args: Any, trunk: Any = None) -> Any:
        """Make the architecture's "auto" arguments explicit (e.g. a LoRA alpha that defaults to the rank); `trunk`
        is the resolved trunk (dim, hidden_dim, ...) for arguments whose default depends on the model's shape."""
        return arch_args

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        """The recurrence the architecture trains with when the config leaves it unset."""
        return 1

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        """The largest recurrence allowed at evaluation (None = unbounded); by default the trained depth."""
        return args.n_recur

    @classmethod
    def validate_args(cls, args: Any) -> None:
        """Raise ValueError subclasses (the config layer turns them into errors naming the key)."""

    @classmethod
    def iterable(cls) -> bool:
        """True when the architecture implements the iteration hooks (depth sweeps and adaptive exit apply);
        False: it runs at its fixed depth only."""
        return cls.core_step is not BaseLM.core_step

    @classmethod
    def resolve_extrapolate(cls, rule: str | None) -> str | None:
        """The extrapolation rule to use (the default for None); None for an architecture that has none."""
        if not cls.extrapolate_rules:
            if rule not in (None, "none"):
                raise RecurrenceError(f"{cls.name}: has no extrapolation rules (got {rule!r})")
            return None
        if rule is None:
            return cls.extrapolate_rules[0]
        if rule not in cls.extrapolate_rules:
            raise RecurrenceError(
                f"{cls.name}: extrapolate must be one of {', '.join(cls.extrapolate_rules)}; got {rule!r}"
            )
        return rule

    # ---- construction ----------------------------------------------------------------------------------------------

    def __init__(self, args: Any):
        super().__init__()
        self.args = args
        self.arch_args = self.arch_args_of(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, feeds_matmul=True)  # the head
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight  # tied embeddings (one tensor, as in llama2.c)
        self.dropout = nn.Dropout(args.dropout)
        cos, sin = precompute_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.build_extra(args)
        # Built on the meta device (shapes only: a weight surgery checked before any training, FLOPs counted on
        # meta inputs) there are no values to initialise, and meta's init ops run as Python decompositions,
        # milliseconds each. (`architectures.build_shapes` is the cheaper way to count: no meta device at all.)
        if self.output.weight.is_meta:
            return
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("w3.weight") or pn.endswith("wo.weight"):
                nn.init.normal_(p, mean=0.0, std=args.init_std / math.sqrt(2 * args.n_layers))
        self.init_extra(args)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.args.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.args.init_std)

    def build_extra(self, args: Any) -> None:
        """Create the architecture's own parameters (depth encodings, adapters, LoRA)."""

    def init_extra(self, args: Any) -> None:
        """Initialise them after the llama2.c init has run over every Linear/Embedding."""

    # ---- forward ---------------------------------------------------------------------------------------------------

    def resolve_n_recur(self, n_recur: int | None) -> int:
        if n_recur is None:
            return self.args.n_recur
        if n_recur < 1:
            raise RecurrenceError(f"{self.name}: n_recur must be >= 1, got {n_recur}")
        limit = self.max_n_recur(self.args)
        if limit is not None and n_recur > limit:
            raise RecurrenceError(
                f"{self.name}: n_recur={n_recur} is beyond what this model was built for "
                f"(at most {limit}; it was trained with {self.args.n_recur})"
            )
        return n_recur

    def schedule(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_recur: int, cache: AnyCache | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        n_recur: int | None = None,
        cache: AnyCache | None = None,
        return_logits: bool = True,
        extrapolate: str | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """tokens (B, T) -> logits (B, T, V) and, given targets (B, T), the mean cross-entropy (ignore index -1).

        `return_logits=False` (with targets) returns (None, loss) and computes the loss through the head without
        materialising the logits (`linear_cross_entropy`): what training and validation use. Past the trained
        depth an architecture with extrapolation rules runs through `iterate` with `extrapolate` (None: default).
        """
        if type(self).reports_stats:  # a class constant: no work at all for the architectures that report nothing
            self.__dict__.pop("_forward_stats", None)
        n = self.resolve_n_recur(n_recur)
        if n > self.args.n_recur and self.extrapolate_rules:
            out = self.iterate(
                tokens, targets, n_recur=n, cache=cache, return_logits=return_logits, extrapolate=extrapolate
            )
            return out.logits, out.loss
        if extrapolate is not None:
            self.resolve_extrapolate(extrapolate)  # a bad rule is an error even where it would not apply
        B, T = tokens.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.args.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the context of {self.args.max_seq_len}")
        cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        if cache is not None:
            cache.begin()
        h = self.embed(tokens)  # (B, T, d)
        h = self.schedule(h, cos, sin, n, cache)
        if cache is not None:
            cache.advance(T)
        return self._head(self.norm(h), targets, return_logits)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings (B, T, d), after dropout. Under torch.compile on a CPU they are looked up outside the
        compiled graph: inductor fuses the embedding's backward into the first norm's with atomic adds, whose order
        between threads varies from run to run, so compiled runs would stop being reproducible (the eager backward
        accumulates in a fixed order, and is a negligible share of the step)."""
        if tokens.device.type == "cpu" and torch.compiler.is_compiling() and torch.is_grad_enabled():
            return _eager_embed(self.tok_embeddings, self.dropout, tokens)
        return self.dropout(self.tok_embeddings(tokens))

    def _head(
        self, h: torch.Tensor, targets: torch.Tensor | None, return_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Normed hidden states (B, T, d) -> (logits or None, mean cross-entropy or None)."""
        B, T, _ = h.shape
        if targets is not None and not return_logits:
            return None, linear_cross_entropy(h.reshape(B * T, -1), self.output.weight, targets.reshape(-1))
        logits = self.output(h)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return logits, loss

    # ---- what a forward reports beyond its loss (adaptive computation) ---------------------------------------------

    def _stats(self) -> ForwardStats:
        if not type(self).reports_stats:
            raise TypeError(f"{self.name}: set `reports_stats = True` on the class to report stats from its forward")
        stats = self.__dict__.get("_forward_stats")
        if stats is None:
            stats = ForwardStats()
            self.__dict__["_forward_stats"] = stats  # a plain attribute: never a submodule, buffer or state
        return stats

    def add_aux_loss(self, name: str, value: torch.Tensor, weight: float) -> None:
        """Report an auxiliary training loss from inside the forward: `value` a scalar term (mean over the tokens,
        with its graph), `weight` its coefficient. The trainer optimises cross-entropy + sum(weight * value) and
        records the term per logged step as `aux/<name>`; the validation loss stays the plain cross-entropy, with the
        terms measured on validation data beside it (`val_aux/<name>`). Reporting a name twice in one forward adds
        the values (e.g. a loss per recursion step)."""
        stats = self._stats()
        if name in stats.aux:
            old, w = stats.aux[name]
            if w != weight:
                raise ValueError(f"{self.name}: auxiliary loss {name!r} reported with weights {w} and {weight}")
            value = old + value
        stats.aux[name] = (value, float(weight))

    def add_metric(self, name: str, value: torch.Tensor | float) -> None:
        """Report a named scalar about this forward (mean ponder time, the fraction of tokens at a depth, a router's
        load imbalance); the run records it per logged step as `arch/<name>` (averaged over the step's micro-batches)
        and the report draws it. Reporting a name twice in one forward keeps the last value."""
        self._stats().metrics[name] = value

    def add_compute(self, forward_flops_per_token: float | torch.Tensor, backward: bool | None = None) -> None:
        """Report compute a piece of the forward really ran: its forward FLOPs per token of the sequence (the
        convention of `flop_terms`: 2 per multiply-add, attention over the scores it computed) and whether it takes
        part in the backward pass (None: whether autograd is recording here, so work under `torch.no_grad()` counts
        once). Once an architecture reports any compute in a forward, that forward's compute is the sum of what it
        reported plus the head; otherwise it is the analytic `flops_per_token`."""
        stats = self._stats()
        if stats.compute is None:
            stats.compute = []
        f = (
            float(forward_flops_per_token.detach())
            if torch.is_tensor(forward_flops_per_token)
            else float(forward_flops_per_token)
        )
        stats.compute.append((f, torch.is_grad_enabled() if backward is None else bool(backward)))

    def take_stats(self) -> ForwardStats:
        """What the last forward reported (empty when it reported nothing), and forget it."""
        stats = self.__dict__.pop("_forward_stats", None)
        return stats if stats is not None else ForwardStats()

    def spent_flops_per_token(
        self, stats: ForwardStats, seq_len: int | None = None, n_recur: int | None = None, training: bool = True
    ) -> float:
        """FLOPs per token a forward (+ backward when `training`) really spent: the compute it reported plus the head,
        or, when it reported none, the analytic count at `n_recur` (`flops_per_token`, the upper bound)."""
        if stats.compute is None:
            return self.flops_per_token(seq_len, n_recur, training)
        # the head takes part in the backward pass when the forward built a graph at all
        head = (2.0 * self.args.dim * self.args.vocab_size, any(bwd for _, bwd in stats.compute))
        terms = stats.compute + [head]
        return float(sum(f * (3 if bwd and training else 1) for f, bwd in terms))

    def block_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one `Block` application over a sequence of `seq_len` tokens (what a token
        pays for one block it passes through; attention grows with the tokens it attends over)."""
        return block_forward_flops(self.args, seq_len)

    # ---- iteration hooks (test-time recurrence) --------------------------------------------------------------------

    def prelude(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AnyCache | None
    ) -> tuple[torch.Tensor, Any]:
        """Embedded tokens (B, T, d) -> (initial recurrent state s0, context every step reads). Looped models:
        (h, None)."""
        return h, None

    def core_step(
        self,
        s: torch.Tensor,
        ctx: Any,
        t: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: AnyCache | None,
        extrapolate: str | None,
    ) -> torch.Tensor:
        """Iteration t (0-based) of the recurrence: state (B, T, d) -> next state. `extrapolate` (resolved) says
        what iterations t >= the trained depth use in place of depth-specific parameters."""
        raise NotImplementedError(f"{self.name} does not expose its recurrence (fixed depth)")

    def coda(self, s: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AnyCache | None) -> torch.Tensor:
        """Final recurrent state -> hidden states before the final norm. Looped models: the state itself."""
        return s

    def iterate(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        n_recur: int | None = None,
        cache: AnyCache | None = None,
        return_logits: bool = True,
        extrapolate: str | None = None,
        exit: ExitRule | None = None,
    ) -> IterOutput:
        """`forward` through the iteration hooks: any depth (with the extrapolation rule), optionally with the
        per-token adaptive exit; returns the logits, loss and each token's exit depth.

        Exit. After each iteration every token still iterating computes its criterion (`ExitRule`); for `kl` its
        next-token distribution comes from the coda, final norm and head applied to the current state (looped
        models: final norm and head). A token that exits is FROZEN: its state stops changing, so its output is the
        state at its exit depth. Attention stays well-defined for the tokens still iterating because the exited
        tokens' keys/values at later iterations are computed from their frozen state (every iteration still runs
        over every token; Huginn instead copies the cache entries of the last iteration it computed). So no
        arithmetic is skipped here: the mean exit depth is the compute an implementation that skips exited tokens
        would spend. Threshold 0 never exits and reproduces the full-depth forward exactly. Under a KV cache all
        `n_recur` iterations always run, so every forward of a generation uses the same cache slots.
        """
        cls = type(self)
        if cls.reports_stats:
            self.__dict__.pop("_forward_stats", None)
        if not cls.iterable():
            raise RecurrenceError(f"{self.name}: runs at a fixed depth; it has no iteration hooks")
        n = self.resolve_n_recur(n_recur)
        rule = self.resolve_extrapolate(extrapolate)
        B, T = tokens.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.args.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the context of {self.args.max_seq_len}")
        cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        if cache is not None:
            cache.begin()
        h, depths = self._iterate(tokens, cos, sin, cache, n, rule, exit)
        if cache is not None:
            cache.advance(T)
        logits, loss = self._head(self.norm(h), targets, return_logits)
        return IterOutput(logits, loss, depths)

    def _iterate(
        self,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: AnyCache | None,
        n: int,
        rule: str | None,
        exit: ExitRule | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`iterate`'s body: tokens (B, T) -> (hidden states before the final norm, exit depths (B, T))."""
        B, T = tokens.shape
        s, ctx = self.prelude(self.embed(tokens), cos, sin, cache)
        checking = exit if exit is not None and exit.threshold > 0 else None  # None: no token ever exits
        coda_slots = _SlotScope(cache)
        depths = torch.full((B, T), n, dtype=torch.long, device=tokens.device)
        active = torch.ones(B, T, dtype=torch.bool, device=tokens.device)
        prev: torch.Tensor | None = None
        for t in range(n):
            new = self.core_step(s, ctx, t, cos, sin, cache, rule)
            if checking is None:
                s = new
                continue
            if checking.rule == "kl":
                with coda_slots:
                    cur = F.log_softmax(self.output(self.norm(self.coda(new, cos, sin, cache))).float(), dim=-1)
                if prev is None:  # iteration 1 is compared against the uniform distribution
                    prev = torch.full(
                        (B, T, self.args.vocab_size), -math.log(self.args.vocab_size), device=tokens.device
                    )
                crit = F.kl_div(cur, prev, log_target=True, reduction="none").sum(-1)  # KL(prev || cur), (B, T)
                prev = cur
            else:
                crit = (new - s).float().norm(dim=-1) / new.float().norm(dim=-1).clamp_min(1e-12)
            s = torch.where(active[..., None], new, s)  # frozen tokens keep their state
            done = active & (crit < checking.threshold)
            depths = torch.where(done, torch.full_like(depths, t + 1), depths)
            active = active & ~done
            if cache is None and not bool(active.any()):
                break  # nothing left to iterate and no cache that later forwards would read
        with coda_slots:
            h = self.coda(s, cos, sin, cache)
        return h, depths

    # ---- the decode path -------------------------------------------------------------------------------------------

    def decode(
        self,
        tokens: torch.Tensor,
        cache: StaticKVCache,
        pos: torch.Tensor,
        *,
        n_recur: int | None = None,
        extrapolate: str | None = None,
        exit: ExitRule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One inference forward of `architectures.generate`'s decode path: tokens (B, T) at positions
        pos .. pos + T - 1 (`pos` a 0-d long tensor) -> (logits of the last position (B, V), each token's exit depth
        (B, T) with `exit`, else None).

        The same maths as `forward` with a `KVCache` at that position (or `iterate` with `exit`, or past the trained
        depth with an extrapolation rule), arranged for inference: RoPE rows gathered from the precomputed tables by
        a position tensor, keys and values written in place into `cache`'s preallocated slots, the head applied to
        the last position only. Nothing depends on a Python position, so one compiled graph serves every step.
        Neither `pos` nor `cache.pos` is advanced here (the caller does both). Meant for `torch.inference_mode`.
        """
        if type(self).reports_stats:
            self.__dict__.pop("_forward_stats", None)  # each step reports afresh, as each forward does
        n = self.resolve_n_recur(n_recur)
        T = tokens.shape[1]
        positions = pos + torch.arange(T, device=tokens.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        cache.begin(positions)
        depths: torch.Tensor | None = None
        if exit is not None or (n > self.args.n_recur and self.extrapolate_rules):
            h, depths = self._iterate(tokens, cos, sin, cache, n, self.resolve_extrapolate(extrapolate), exit)
        else:
            if extrapolate is not None:
                self.resolve_extrapolate(extrapolate)  # a bad rule is an error even where it would not apply
            h = self.schedule(self.embed(tokens), cos, sin, n, cache)
        return self.output(self.norm(h[:, -1])), depths

    # ---- accounting ------------------------------------------------------------------------------------------------

    def components(self, n_recur: int) -> list[tuple[str, Params, int]]:
        """(component, parameters, times applied per token at recurrence n_recur), beyond embedding and final norm.

        Must cover every parameter (checked by `param_report`). A name may repeat (e.g. blocks applied once and
        blocks applied n_recur times); reports add the counts of a repeated name.
        """
        return [("blocks", self.layers, 1)]

    def effective_depth(self, n_recur: int | None = None) -> int:
        """Block applications per token: each component's uses times the `Block`s it holds, whatever its name."""
        n = self.resolve_n_recur(n_recur)
        return sum(uses * _n_blocks(obj) for _, obj, uses in self.components(n))

    def param_report(self, n_recur: int | None = None) -> dict[str, Any]:
        """Unique parameters by component (tied embedding counted once) and effective (unrolled) parameters."""
        n = self.resolve_n_recur(n_recur)
        parts: list[tuple[str, Params, int]] = [("embedding", self.tok_embeddings, 1)]
        parts += self.components(n)
        parts.append(("final_norm", self.norm, 1))
        unique: dict[str, int] = {}
        effective = 0
        for name, obj, uses in parts:
            c = count(obj)
            unique[name] = unique.get(name, 0) + c
            effective += c * uses
        total = sum(p.numel() for p in self.parameters())
        if total != sum(unique.values()):  # a component list that misses a parameter is a bug in the arch file
            raise AssertionError(f"{self.name}: components sum to {sum(unique.values())}, model has {total}")
        return {"components": unique, "total": total, "effective": effective, "n_recur": n}

    def flop_terms(self, n_recur: int, seq_len: int) -> list[tuple[float, bool]]:
        """(forward FLOPs per token, takes part in backward) for each piece of the schedule, head excluded.

        Default: every `Block` in the "blocks" components, times its uses per token. An architecture whose own
        parameters do matmuls (adapters, LoRA) or that runs part of its schedule without gradients overrides this.
        """
        calls = sum(uses * _n_blocks(obj) for name, obj, uses in self.components(n_recur) if name == "blocks")
        return [(calls * block_forward_flops(self.args, seq_len), True)]

    def flops_per_token(self, seq_len: int | None = None, n_recur: int | None = None, training: bool = True) -> float:
        """Training FLOPs per token (forward + backward = 3x forward where gradients flow), recurrence included.

        Counted analytically and checked against torch.utils.flop_counter in the tests: every projection and its
        LoRA, the adapter, attention over the full T x T score matrix, and the tied head; elementwise ops and the
        embedding lookup are not counted (the usual convention).
        """
        T = seq_len or self.args.max_seq_len
        n = self.resolve_n_recur(n_recur)
        terms = self.flop_terms(n, T) + [(2.0 * self.args.dim * self.args.vocab_size, True)]
        if not training:
            return float(sum(f for f, _ in terms))
        return float(sum(f * (3 if bwd else 1) for f, bwd in terms))


def _embed(embedding: nn.Module, dropout: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return dropout(embedding(tokens))


_eager_embed: Callable[..., torch.Tensor] = _embed  # left out of compiled graphs once dynamo loads (the loss's reason)


def _disable_embed() -> None:
    global _eager_embed
    _eager_embed = torch.compiler.disable(_embed)


when_dynamo_loads(_disable_embed)


class _SlotScope:
    """Gives the coda the same KV-cache slots every time it runs within one forward: the exit check probes the coda
    after each iteration and the final coda overwrites what the probes wrote at these positions, so the cache ends
    up holding the coda's keys/values of each token's final (frozen) state."""

    def __init__(self, cache: AnyCache | None):
        self.cache = cache
        self.start: int | None = None
        self.resume = 0

    def __enter__(self) -> None:
        if self.cache is not None:
            self.resume = self.cache._next
            if self.start is not None:
                self.cache._next = self.start
            else:
                self.start = self.resume

    def __exit__(self, *exc: Any) -> None:
        if self.cache is not None and self.start != self.resume:  # a rewound probe: continue where the steps were
            self.cache._next = self.resume


def _n_blocks(obj: Params) -> int:
    """How many `Block` modules a component holds (a parameter holds none)."""
    mods = [obj] if isinstance(obj, (nn.Module, nn.Parameter)) else list(obj)
    return sum(isinstance(m, Block) for mod in mods if isinstance(mod, nn.Module) for m in mod.modules())
