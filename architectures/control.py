"""Control: the plain llama2.c transformer, blocks B1 B2 B3 B4 once each (effective depth 4).

Unique parameters V*d + L*P_blk + d (4,212,992 in the paper preset).
"""

from __future__ import annotations

from typing import Any, cast

from architectures import register
from architectures.base import BaseLM
from architectures.blocks import Block


@register("control")
class Control(BaseLM):
    label = "Control"
    description = "plain transformer, each block once"
    # A plain Llama: `benchctl export` writes it as transformers' LlamaForCausalLM and as llama2.c's model.bin.
    export_formats = ("hf", "llama2c")

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 1

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return 1

    @classmethod
    def validate_args(cls, args: Any) -> None:
        # Anything else would be recorded (run id, n_recur column, effective depth) but never run.
        if args.n_recur != 1:
            raise ValueError(
                f"model.n_recur: the control runs each block once, so it must be 1 (got {args.n_recur}); "
                "for a deeper control raise model.n_layers"
            )

    def schedule(self, h, cos, sin, n_recur, cache):
        for layer in self.layers:
            h = layer(h, cos, sin, cache=cache)
        return h

    def unrolled(self, n_recur: int | None = None, extrapolate: str | None = None) -> list[tuple[Block, None]]:
        """The schedule as a plain stack of block calls (block, LoRA set): each block once, no LoRA."""
        self.resolve_n_recur(n_recur)
        return [(cast(Block, layer), None) for layer in self.layers]
