"""Tiny Recursive Model (Jolicoeur-Martineau 2025, "Less is More: Recursive Reasoning with Tiny Networks")
adapted to next-token prediction.

The original (SamsungSAILMontreal/TinyRecursiveModels, models/recursive_reasoning/trm.py), per supervision step:

    x = sqrt(d) * embed(tokens)                        the question
    repeat T times (the first T-1 without gradients):
        repeat n times:  z = net(z + y + x)            refine the latent reasoning state from (x, y, z)
        y = net(y + z)                                 then the answer state from (y, z)
    logits = head(y)

where `net` is ONE tiny network (2 post-norm blocks, h = rms(h + attn(h)); h = rms(h + mlp(h))) used for both
updates, and y0, z0 are fixed random vectors (truncated normal, std 1, not trained). Deep supervision runs up to
N_sup = 16 such steps on the same puzzle, each with its own loss and optimiser step, carrying (y, z) detached from
one step to the next; a Q-head learns when to halt.

How it maps to a causal LM here:
- the puzzle is the sequence, the answer state y is a per-position next-token state and attention is causal (the
  puzzle model attends both ways), so every update of every position only reads positions up to its own;
- `model.n_recur` is N_sup, the supervision steps: the answer is improved n_recur times, each step a full T-cycle
  recursion started from the previous step's detached (y, z). In training every step's answer is scored: the final
  step's cross-entropy is the model's loss, the earlier steps' mean cross-entropy is the auxiliary term
  `deep_supervision` with weight N_sup - 1, so the optimised loss is the sum of the N_sup per-step losses, as TRM
  sums them. TRM takes an optimiser step after each supervision step (its carry comes from slightly older weights);
  here the N_sup steps share one optimiser step, the standard single-update form of deep supervision;
- one iteration of the shared iteration API is one supervision step on the state [y ; z] (B, T, 2d), so evaluation
  can run more improvement steps than trained (`n_recur` past it, no per-step parameters to extrapolate) and the
  per-token adaptive exit (KL between successive answers, or the latent change) stands in for TRM's learned halting;
- left out: the Q-head halting and its loss (TRM evaluates with all N_sup steps anyway; in training halting only
  decides when a puzzle in the batch is replaced by a new one, which a fixed-batch LM trainer has no counterpart
  of), the puzzle embeddings, EMA of the weights, and the MLP-mixer variant;
- the network is the trunk's llama2.c sublayers (RoPE, SwiGLU, llama2.c init) arranged post-norm as TRM's, with the
  norms' learned gains (TRM's norms have none; the gains start at one) and the harness's final norm before the tied
  head (TRM's head reads y directly);
- the question x starts at std 1, beside y0 and z0 at std 1, as in TRM. TRM gets there with sqrt(d) times an
  embedding initialised at std 1 / sqrt(d); here the embedding is also the tied output head and keeps the harness's
  llama2.c init (std `init_std`, 0.02), so x is the embedding divided by `init_std` (`model.context_scale = "unit"`).
  TRM's literal sqrt(d) times this embedding (`context_scale = "sqrt-dim"`) starts x at 0.02 * sqrt(d), 0.08 at
  d = 16: the unit-RMS states then drown the token, and a small model stays at the unigram loss, ignoring its input;
- the network is all `model.n_layers` unique blocks (TRM: 2), so the unique parameters equal the control's at every
  preset (y0 and z0 are buffers, not parameters); `model.n_layers=2` gives TRM's tiny network.

Trained depth: N_sup = n_recur = 2 supervision steps of T = 2 cycles of n = 2 latent updates (TRM: 16, 3, 6), so
2 * 2 * (2 + 1) = 12 network applications, 48 block applications per token in the paper preset, half of them with
gradients; chosen to keep the training compute within about twice the study's recurrent models' while keeping
every loop of the method (more than one latent update, a gradient-free cycle, more than one supervised step).

Compute: every cycle reports what it ran (`add_compute`; a gradient-free cycle counts once, a cycle with a graph three
times in training), and so does the head on each earlier answer, so a run's training FLOPs are what its forwards
really did; in training that equals the analytic count (`flop_terms`), which evaluation forwards stay below (they
score only the final answer). The training loss the trainer optimises, cross-entropy + (N_sup - 1) * the
`deep_supervision` term, is what backpropagates through every step's last cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import Block, block_forward_flops

CONTEXT_SCALES = ("unit", "sqrt-dim")


@dataclass(frozen=True, kw_only=True)
class TRMArgs(ArchArgs):
    n_latent: int = 2  # n: latent updates z <- net(z + y + x) per cycle (TRM: 6)
    n_cycles: int = 2  # T: cycles per supervision step, the first T - 1 without gradients (TRM: 3)
    # how the tied embedding becomes the question x: "unit" divides by init_std (x starts at std 1, as TRM's does),
    # "sqrt-dim" multiplies by sqrt(d) (TRM's formula on this harness's std-0.02 embedding; x starts near 0)
    context_scale: str = "unit"


class PostNormBlock(Block):
    """TRM's block: h = norm(h + attn(h)); h = norm(h + mlp(h)), on the llama2.c block's parts (its two norms move
    after the residual additions, so their outputs are the residual stream, not a matmul's input)."""

    def __init__(self, layer_id: int, args: Any):
        super().__init__(layer_id, args)
        self.attention_norm.feeds_matmul = False
        self.ffn_norm.feeds_matmul = False

    def forward(self, x, cos, sin, lora=None, cache=None):
        h = self.attention_norm(x + self.attention(x, cos, sin, lora, cache))
        return self.ffn_norm(h + self.feed_forward(h, lora))


@register("trm", args=TRMArgs)
class TRM(BaseLM):
    label = "TRM"
    description = "tiny recursive model: one network refines a latent then the answer, deep supervision"
    reports_stats = True
    warm_startable = True  # the state [y ; z] starts from learned vectors, the token enters every step through x
    y_init: torch.Tensor
    z_init: torch.Tensor

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 2

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None

    @classmethod
    def validate_args(cls, args: Any) -> None:
        a = cls.arch_args_of(args)
        for key in ("n_latent", "n_cycles"):
            if getattr(a, key) < 1:
                raise ValueError(f"model.{key}: must be >= 1, got {getattr(a, key)}")
        if a.context_scale not in CONTEXT_SCALES:
            names = ", ".join(CONTEXT_SCALES)
            raise ValueError(f"model.context_scale: must be one of {names}, got {a.context_scale!r}")

    def build_extra(self, args: Any) -> None:
        self.layers = nn.ModuleList(PostNormBlock(i, args) for i in range(args.n_layers))
        self.register_buffer("y_init", torch.empty(args.dim))
        self.register_buffer("z_init", torch.empty(args.dim))
        self._targets: torch.Tensor | None = None
        self._fused = True

    def init_extra(self, args: Any) -> None:
        # TRM's trunc_normal_init_ (JAX's): a standard normal truncated at +-2, rescaled to std exactly 1
        phi2 = math.exp(-2.0) / math.sqrt(2 * math.pi)  # the standard normal density at 2
        var = 1 - 4 * phi2 / math.erf(2 / math.sqrt(2))  # variance of the standard normal truncated at +-2
        for buf in (self.y_init, self.z_init):
            nn.init.trunc_normal_(buf, mean=0.0, std=1.0, a=-2.0, b=2.0)
            buf.div_(math.sqrt(var))

    def forward(self, tokens, targets=None, **kw):
        # the deep-supervision losses need the targets inside the schedule, and score the earlier answers the way
        # the caller scores the last (through the logits, or the fused head loss)
        self._targets, self._fused = targets, not kw.get("return_logits", True)
        try:
            return super().forward(tokens, targets, **kw)
        finally:
            self._targets = None

    # ---- the recursion ------------------------------------------------------------------------------------------

    def net(self, h, cos, sin, cache):
        for layer in self.layers:
            h = layer(h, cos, sin, cache=cache)
        return h

    def cycle(self, x, y, z, cos, sin, cache):
        for _ in range(self.arch_args.n_latent):
            z = self.net(z + y + x, cos, sin, cache)
        y = self.net(y + z, cos, sin, cache)
        # reported per cycle: a cycle under no_grad counts once, a cycle with a graph takes part in backward
        self.add_compute(self._cycle_flops(x.shape[1]))
        return y, z

    def supervision_step(self, x, y, z, cos, sin, cache):
        """T cycles from (y, z), gradients through the last only."""
        with torch.no_grad():
            for _ in range(self.arch_args.n_cycles - 1):
                y, z = self.cycle(x, y, z, cos, sin, cache)
        return self.cycle(x, y, z, cos, sin, cache)

    def prelude(self, h, cos, sin, cache):
        x = h * self._context_scale()
        y0, z0 = self.y_init.to(x.dtype).expand_as(x), self.z_init.to(x.dtype).expand_as(x)
        return torch.cat([y0, z0], dim=-1), x  # state [y ; z] (B, T, 2d), context x

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        y, z = s.chunk(2, dim=-1)
        y, z = self.supervision_step(ctx, y, z, cos, sin, cache)
        return torch.cat([y, z], dim=-1)

    def coda(self, s, cos, sin, cache):
        return s.chunk(2, dim=-1)[0]  # the answer state y

    def schedule(self, h, cos, sin, n_recur, cache):
        s, x = self.prelude(h, cos, sin, cache)
        y, z = s.chunk(2, dim=-1)
        scored = self.training and self._targets is not None
        early: list[torch.Tensor] = []
        for step in range(n_recur):
            y, z = self.supervision_step(x, y, z, cos, sin, cache)
            if step < n_recur - 1:
                if scored:
                    early.append(self._step_loss(y))
                y, z = y.detach(), z.detach()  # TRM's carry: no gradient between supervision steps
        if early:
            term = torch.stack(early).mean()
            self.add_aux_loss("deep_supervision", term, weight=float(len(early)))
        return y

    def _step_loss(self, y: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of an intermediate answer, through the final norm and the tied head."""
        _, loss = self._head(self.norm(y), self._targets, return_logits=not self._fused)
        assert loss is not None
        self.add_compute(2.0 * self.args.dim * self.args.vocab_size)  # the head on an earlier answer
        return loss

    def _context_scale(self) -> float:
        if self.arch_args.context_scale == "unit":
            return 1.0 / self.args.init_std
        return math.sqrt(self.args.dim)

    # ---- accounting ---------------------------------------------------------------------------------------------

    def components(self, n_recur):
        a = self.arch_args
        return [("blocks", self.layers, n_recur * a.n_cycles * (a.n_latent + 1))]

    def _cycle_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one cycle: n + 1 passes over the network."""
        return (self.arch_args.n_latent + 1) * len(self.layers) * block_forward_flops(self.args, seq_len)

    def flop_terms(self, n_recur, seq_len):
        """Per supervision step: T - 1 cycles without gradients, the last with; each cycle n + 1 network passes.
        A training forward also scores the n_recur - 1 earlier answers through the head (deep supervision)."""
        a = self.arch_args
        per_cycle = self._cycle_flops(seq_len)
        head = 2.0 * self.args.dim * self.args.vocab_size
        return [
            (n_recur * (a.n_cycles - 1) * per_cycle, False),
            (n_recur * per_cycle, True),
            ((n_recur - 1) * head, True),
        ]
