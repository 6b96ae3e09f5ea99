"""Relaxed recursive transformer (Bae et al. 2024): looped shared blocks relaxed by depth-wise LoRA.

R passes over B1..B4 (cycle layout); at pass t, block l uses its shared weights plus its own LoRA
(alpha/r) B_{l,t} A_{l,t} on all seven projections (wq wk wv wo w1 w2 w3). R*L LoRA sets (16 at rank 16 in
the paper preset), so the unique parameters are the control's plus R*L*r*(8d + 3(d+h)) = 5,462,272.
With B = 0 at init the model starts as the plain looped model. SVD/average/stepwise initialisation from a trained control ("retrofit") is not
implemented: models here train from scratch.

Test-time depth. One iteration of the shared iteration API is one pass over all blocks with that pass's LoRA set
(no prelude or coda), so the model runs at any depth. Passes past the R trained sets follow an inference-only rule
(never part of the run id): `cycle` (default) uses set t mod R, `last` reuses set R-1, `none` runs the shared blocks
alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch.nn as nn

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import PROJECTIONS, LoRA, block_forward_flops, block_shapes


@dataclass(frozen=True, kw_only=True)
class RelaxedArgs(ArchArgs):
    lora_rank: int = 16
    lora_alpha: float | None = None  # None -> alpha = rank (scale 1)
    lora_init: Literal["normal", "kaiming"] = "normal"  # A ~ normal(0, init_std) | kaiming; B = 0 always


@register("relaxed", args=RelaxedArgs)
class Relaxed(BaseLM):
    label = "Relaxed"
    description = "looped blocks with a LoRA per pass and block"

    extrapolate_rules = ("cycle", "last", "none")

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 4

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None  # every extrapolation rule defines the passes past R

    @classmethod
    def resolve_arch_args(cls, arch_args: RelaxedArgs) -> RelaxedArgs:
        if arch_args.lora_alpha is None:
            return dataclasses.replace(arch_args, lora_alpha=float(arch_args.lora_rank))
        return arch_args

    @classmethod
    def validate_args(cls, args: Any) -> None:
        rank = cls.arch_args_of(args).lora_rank
        if rank < 1:
            raise ValueError(f"model.lora_rank: must be >= 1, got {rank}")

    def build_extra(self, args: Any) -> None:
        shapes = block_shapes(args)
        own = self.resolve_arch_args(self.arch_args)
        # lora[t][l][proj]: one set per (pass t, block l)
        self.lora = nn.ModuleList(
            nn.ModuleList(
                nn.ModuleDict({p: LoRA(*shapes[p], own.lora_rank, own.lora_alpha) for p in PROJECTIONS})
                for _ in range(args.n_layers)
            )
            for _ in range(args.n_recur)
        )

    def init_extra(self, args: Any) -> None:
        for m in self.lora.modules():
            if isinstance(m, LoRA):
                m.reset_parameters(self.arch_args.lora_init, args.init_std)

    def schedule(self, h, cos, sin, n_recur, cache):
        for t in range(n_recur):
            for l, layer in enumerate(self.layers):
                h = layer(h, cos, sin, lora=self.lora[t][l], cache=cache)
        return h

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        R = len(self.lora)
        k = t if t < R else {"cycle": t % R, "last": R - 1}.get(extrapolate)
        for l, layer in enumerate(self.layers):
            s = layer(s, cos, sin, lora=None if k is None else self.lora[k][l], cache=cache)
        return s

    def components(self, n_recur):
        return [("blocks", self.layers, n_recur), ("lora", self.lora, 1)]

    def flop_terms(self, n_recur, seq_len):
        a = self.args
        return [(n_recur * a.n_layers * block_forward_flops(a, seq_len, lora_rank=self.arch_args.lora_rank), True)]
