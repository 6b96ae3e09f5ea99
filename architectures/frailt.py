"""FraiLT (Fractal-Iterative Looped Transformer): R passes over the same blocks with a learned iteration vector.

Before pass t the model adds E_iter[t] (one d-vector per pass, shared by every position and block) to the
hidden state, then runs B1..B4. With R = 4 the effective depth is 16 and the unique parameters are the
control's plus R*d (4,214,016 in the paper preset).

Test-time depth. One iteration of the shared iteration API is one pass (vector + all blocks; no prelude or coda),
so FraiLT runs at any depth. Passes past the R learned vectors follow an inference-only rule (never part of the
run id): `last` (default) adds the last vector E_iter[R-1] to every extra pass, `cycle` adds E_iter[t mod R],
`none` adds no vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from architectures import register
from architectures.base import ArchArgs, BaseLM


@dataclass(frozen=True, kw_only=True)
class FraiLTArgs(ArchArgs):
    frailt_init: Literal["zeros", "normal"] = "zeros"  # init of the per-pass iteration vectors E_iter


@register("frailt", args=FraiLTArgs)
class FraiLT(BaseLM):
    label = "FraiLT"
    description = "looped blocks with a learned per-pass iteration vector"

    extrapolate_rules = ("last", "cycle", "none")

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 4

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None  # every extrapolation rule defines the passes past R

    def build_extra(self, args: Any) -> None:
        self.iter_emb = nn.Parameter(torch.zeros(args.n_recur, args.dim))  # E_iter: (R, d)

    def init_extra(self, args: Any) -> None:
        if self.arch_args.frailt_init == "normal":
            nn.init.normal_(self.iter_emb, mean=0.0, std=args.init_std)
        else:
            nn.init.zeros_(self.iter_emb)

    def schedule(self, h, cos, sin, n_recur, cache):
        for t in range(n_recur):
            h = h + self.iter_emb[t]  # (B, T, d) + (d,)
            for layer in self.layers:
                h = layer(h, cos, sin, cache=cache)
        return h

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        R = self.iter_emb.shape[0]
        k = t if t < R else {"last": R - 1, "cycle": t % R}.get(extrapolate)
        if k is not None:
            s = s + self.iter_emb[k]
        for layer in self.layers:
            s = layer(s, cos, sin, cache=cache)
        return s

    def components(self, n_recur):
        return [("blocks", self.layers, n_recur), ("depth_encoding", self.iter_emb, 1)]
