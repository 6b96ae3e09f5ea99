"""Relaxed recursive transformer (Bae et al. 2024): looped shared blocks relaxed by depth-wise LoRA.

R passes over B1..B4 (cycle layout); at pass t, block l uses its shared weights plus its own LoRA
(alpha/r) B_{l,t} A_{l,t} on all seven projections (wq wk wv wo w1 w2 w3). R*L LoRA sets (16 at rank 16 in
the paper preset), so the unique parameters are the control's plus R*L*r*(8d + 3(d+h)) = 5,462,272.
Left unset (or "auto"), the rank follows `auto_lora_rank`: the LoRA sets then add the same share of the control's
unique parameters at any width as they do at the paper's (rank 16, +29.7%), instead of a fixed rank that would add
+68% at d = 64.
With B = 0 at init the model starts as the plain looped model; `architectures.retrofit` builds it instead from a
trained deeper control (average or stepwise shared blocks, SVD of the residuals for the LoRAs).

Test-time depth. One iteration of the shared iteration API is one pass over all blocks with that pass's LoRA set
(no prelude or coda), so the model runs at any depth. Passes past the R trained sets follow an inference-only rule
(never part of the run id): `cycle` (default) uses set t mod R, `last` reuses set R-1, `none` runs the shared blocks
alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch.nn as nn

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import PROJECTIONS, Block, LoRA, block_forward_flops, block_shapes

# The paper's LoRA share: 16 sets (4 passes x 4 blocks) of rank 16 at d = 256, h = 688 hold 1,249,280 parameters,
# 29.65% of the 4,212,992 unique parameters of the control they are added to.
PAPER_LORA_SHARE = 1_249_280 / 4_212_992
# The passes the rule assumes: the architecture's default. A deeper relaxed model keeps the rank and gains one LoRA
# set per extra pass (that is the architecture), so variants differing in n_recur differ in nothing else.
_RULE_PASSES = 4


def auto_lora_rank(args: Any) -> int:
    """The LoRA rank whose sets (at the default 4 passes) add PAPER_LORA_SHARE of the plain control's unique
    parameters, rounded to the nearest integer >= 1: 16 at the paper's trunk, 7 at d = 64, h = 176, vocab 4096.

    `args` is the resolved trunk (dim, n_layers, n_heads, n_kv_heads, hidden_dim, vocab_size). The control's
    unique parameters are the tied embedding, the blocks' projections and two norms each, and the final norm."""
    shapes = block_shapes(args).values()
    control = args.vocab_size * args.dim + args.n_layers * (sum(i * o for i, o in shapes) + 2 * args.dim) + args.dim
    per_rank = _RULE_PASSES * args.n_layers * sum(i + o for i, o in shapes)
    return max(1, round(PAPER_LORA_SHARE * control / per_rank))


@dataclass(frozen=True, kw_only=True)
class RelaxedArgs(ArchArgs):
    lora_rank: int | None = None  # None ("auto") -> auto_lora_rank(trunk): 16 at the paper's trunk
    lora_alpha: float | None = None  # None -> alpha = rank (scale 1)
    lora_init: Literal["normal", "kaiming"] = "normal"  # A ~ normal(0, init_std) | kaiming; B = 0 always


@register("relaxed", args=RelaxedArgs)
class Relaxed(BaseLM):
    label = "Relaxed"
    description = "looped blocks with a LoRA per pass and block"

    extrapolate_rules = ("cycle", "last", "none")
    # Unrolled, with each pass's LoRA merged into its shared weights, it is a plain Llama of n_recur * n_layers blocks:
    # `benchctl export` writes that as transformers' LlamaForCausalLM and as llama2.c's model.bin.
    export_formats = ("hf", "llama2c")

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 4

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None  # every extrapolation rule defines the passes past R

    @staticmethod
    def lora_rank_alpha(arch_args: RelaxedArgs, trunk: Any = None) -> tuple[int, float]:
        """The LoRA rank and alpha with "auto" (None) resolved: the rank by `auto_lora_rank`, alpha = rank."""
        rank = arch_args.lora_rank
        if rank is None:
            if trunk is None:  # a bug in the caller: the rule needs the trunk's shapes
                raise ValueError("model.lora_rank: 'auto' needs the model's trunk arguments to resolve")
            rank = auto_lora_rank(trunk)
        return rank, float(rank) if arch_args.lora_alpha is None else arch_args.lora_alpha

    @classmethod
    def resolve_arch_args(cls, arch_args: RelaxedArgs, trunk: Any = None) -> RelaxedArgs:
        rank, alpha = cls.lora_rank_alpha(arch_args, trunk)
        if (rank, alpha) == (arch_args.lora_rank, arch_args.lora_alpha):
            return arch_args
        return dataclasses.replace(arch_args, lora_rank=rank, lora_alpha=alpha)

    @classmethod
    def validate_args(cls, args: Any) -> None:
        rank, _ = cls.lora_rank_alpha(cls.arch_args_of(args), args)
        if rank < 1:
            raise ValueError(f"model.lora_rank: must be >= 1, got {rank}")

    def build_extra(self, args: Any) -> None:
        shapes = block_shapes(args)
        self.arch_args = self.resolve_arch_args(self.arch_args, args)
        rank, alpha = self.lora_rank_alpha(self.arch_args)
        # lora[t][b][proj]: one set per (pass t, block b)
        self.lora = nn.ModuleList(
            nn.ModuleList(
                nn.ModuleDict({p: LoRA(*shapes[p], rank, alpha) for p in PROJECTIONS}) for _ in range(args.n_layers)
            )
            for _ in range(args.n_recur)
        )

    def lora_at(self, t: int, block: int) -> nn.ModuleDict:
        """The LoRA set of pass t and block `block` (torch types the nested ModuleLists' items as plain Modules)."""
        return cast(nn.ModuleDict, cast(nn.ModuleList, self.lora[t])[block])

    def init_extra(self, args: Any) -> None:
        for m in self.lora.modules():
            if isinstance(m, LoRA):
                m.reset_parameters(self.arch_args.lora_init, args.init_std)

    def schedule(self, h, cos, sin, n_recur, cache):
        for t in range(n_recur):
            for b, layer in enumerate(self.layers):
                h = layer(h, cos, sin, lora=self.lora_at(t, b), cache=cache)
        return h

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        R = len(self.lora)
        k = t if t < R else {"cycle": t % R, "last": R - 1}.get(extrapolate)
        for b, layer in enumerate(self.layers):
            s = layer(s, cos, sin, lora=None if k is None else self.lora_at(k, b), cache=cache)
        return s

    def unrolled(
        self, n_recur: int | None = None, extrapolate: str | None = None
    ) -> list[tuple[Block, nn.ModuleDict | None]]:
        """The schedule as a plain stack of block calls (block, LoRA set or None), pass by pass, at `n_recur` passes
        (default: as trained) with the extrapolation rule `core_step` uses past the trained ones."""
        n = self.resolve_n_recur(n_recur)
        rule = self.resolve_extrapolate(extrapolate)
        R = len(self.lora)
        calls: list[tuple[Block, nn.ModuleDict | None]] = []
        for t in range(n):
            k = t if t < R else {"cycle": t % R, "last": R - 1}.get(rule or "none")
            calls += [
                (cast(Block, layer), None if k is None else self.lora_at(k, b)) for b, layer in enumerate(self.layers)
            ]
        return calls

    def components(self, n_recur):
        return [("blocks", self.layers, n_recur), ("lora", self.lora, 1)]

    def flop_terms(self, n_recur, seq_len):
        a = self.args
        return [(n_recur * a.n_layers * block_forward_flops(a, seq_len, lora_rank=self.arch_args.lora_rank), True)]
