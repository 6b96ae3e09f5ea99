"""Control: the plain llama2.c transformer, blocks B1 B2 B3 B4 once each (effective depth 4).

Unique parameters V*d + L*P_blk + d (4,212,992 in the paper preset).
"""

from __future__ import annotations

from typing import Any

from architectures import register
from architectures.base import BaseLM


@register("control")
class Control(BaseLM):
    label = "Control"
    description = "plain transformer, each block once"

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
