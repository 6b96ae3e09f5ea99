"""Parameter sharing across layers (Takase & Kiyono 2021, "Lessons on Parameter Sharing across Layers in
Transformers"): a stack of N layers built from M unique blocks, each unique block applied N/M times, in one of
the paper's three orders. With M = model.n_layers and N = M * n_recur, layer i (0-based) runs block

    sequence:   i // n_recur                          (M=4, N=8: 0 0 1 1 2 2 3 3)
    cycle:      i mod M                               (0 1 2 3 0 1 2 3)
    cycle-rev:  i mod M for the first N - M layers,   (0 1 2 3 3 2 1 0)
                then the last M layers in reverse

as in the authors' fairseq code (`share_type` sequence / cycle / cycle_reverse). The paper finds cycle-rev best,
so it is the default. With n_recur = 1 every order is the plain M-block stack (the control).

Trained depth: n_recur = 4 by default, N = 16 block applications from the 4 unique blocks, the effective depth of
the study's recurrent models. The unique parameters are exactly the control's (4,212,992 in the paper preset; the
same as the control at every preset): the paper's comparison at an equal parameter count, with 4x the compute.

Adaptations to this harness: the blocks are this package's llama2.c pre-norm blocks (RoPE, SwiGLU, RMSNorm, tied
embedding, llama2.c init) instead of the paper's post-LN fairseq encoder-decoder layers with sinusoidal positions;
the model is a decoder-only causal LM, with the sharing applied to its one stack. Each position of the stack keeps
its own KV-cache slot (one per block call), as for every looped model here. The depth is fixed: a forward may run
fewer passes than trained (`n_recur` below it, the order recomputed for that N), never more, and the model exposes
no per-iteration hooks (the orders other than cycle have no repeating step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from architectures import register
from architectures.base import ArchArgs, BaseLM

ORDERS = ("sequence", "cycle", "cycle-rev")


@dataclass(frozen=True, kw_only=True)
class SharedCycleArgs(ArchArgs):
    share_order: Literal["sequence", "cycle", "cycle-rev"] = "cycle-rev"  # which unique block each layer runs


def layer_order(order: str, n_unique: int, n_recur: int) -> list[int]:
    """The unique block each of the N = n_unique * n_recur layers runs, bottom to top."""
    M, N = n_unique, n_unique * n_recur
    if order == "sequence":
        return [i // n_recur for i in range(N)]
    if order == "cycle":
        return [i % M for i in range(N)]
    if order == "cycle-rev":
        n_cycled = max(N - M, M)  # N = M: the stack itself (the authors' code builds the unique blocks first)
        return [i % M if i < n_cycled else M - 1 - (i - n_cycled) for i in range(N)]
    raise ValueError(f"model.share_order: must be one of {', '.join(ORDERS)}, got {order!r}")


@register("shared-cycle", args=SharedCycleArgs)
class SharedCycle(BaseLM):
    label = "Shared layers"
    description = "N layers from M shared blocks in sequence / cycle / cycle-rev order"

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 4

    @classmethod
    def validate_args(cls, args: Any) -> None:
        layer_order(cls.arch_args_of(args).share_order, args.n_layers, 1)

    def schedule(self, h, cos, sin, n_recur, cache):
        for b in layer_order(self.arch_args.share_order, len(self.layers), n_recur):
            h = self.layers[b](h, cos, sin, cache=cache)
        return h

    def components(self, n_recur):
        return [("blocks", self.layers, n_recur)]
