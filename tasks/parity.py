"""Parity of a bit string, whole (one answer bit) or as prefix parities (one answer bit per input bit).

    mode="parity"   prompt "10110="   answer "1"       (three ones: odd)
    mode="prefix"   prompt "10110="   answer "11011"   (answer[i] = parity of prompt[0..i])

The whole-string parity is the classic task transformers find hard to learn and to extend to longer inputs (every
input bit changes the answer), used with looped models by Fan et al. 2025 (arXiv 2409.15647). The prefix version is
the DeepThinking prefix-sums task (Schwarzschild et al. 2021, arXiv 2106.04537; Bansal et al. 2022, arXiv
2202.05826), where the answer is a sequence and per-position accuracy shows how far into a longer input a model
stays right.

Format choices. Bits are written as "0"/"1" with no separators, most natural order (first bit first); prefix
parities are in the same order, so answer bit i depends on prompt bits 0..i, which an autoregressive model can
compute as its previous answer bit XOR one input bit. Lengths are drawn uniformly from min_length..max_length in
distribution, each bit uniformly at random.

Lengths from 1, not 8. Whole-string parity gives gradient descent almost nothing to follow on long strings alone:
on 8 to 16 bits a dim-64, 4-layer control stayed at chance for 4000 steps. The short strings of 1 to 16 bits are a
curriculum inside every batch, and the same model then got every length it was trained on right by step 3000 (and
stayed at chance on 32 and 64 bits). Their few distinct prompts cost nothing: the split still holds prompts apart.

Difficulty: {"length": n}. Levels: "id" (min_length..max_length), then "l32", "l64" (`hard_lengths`).
Lengths: prompt n + 1, answer 1 (parity) or n (prefix).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require


@dataclass(frozen=True, kw_only=True)
class ParityArgs(TaskArgs):
    mode: Literal["parity", "prefix"] = "parity"
    min_length: int = 1  # short strings make whole-string parity learnable (module docstring)
    max_length: int = 16  # in distribution: min_length..max_length bits
    hard_lengths: str = "32,64"  # one harder level per length


def prefix_parities(bits: int, n: int) -> int:
    """The prefix parities of an n-bit string read most significant bit first, as an integer of the same layout:
    bit i (from the top) = XOR of bits 0..i, by log2(n) shift-and-XOR steps instead of n."""
    shift = 1
    while shift < n:
        bits ^= bits >> shift
        shift *= 2
    return bits


@register("parity", args=ParityArgs)
class Parity(Task):
    label = "Parity"
    description = "parity of a bit string (mode=parity) or its prefix parities (mode=prefix)"
    source = (
        "Fan et al. 2025 (arXiv 2409.15647); Schwarzschild et al. 2021 (arXiv 2106.04537); "
        "Bansal et al. 2022 (arXiv 2202.05826)"
    )
    symbols = "01="
    args: ParityArgs

    def __init__(self, args: TaskArgs | None = None):
        super().__init__(args)
        # per instance: the answer is a sequence only in prefix mode
        self.sequence_answer = self.args.mode == "prefix"  # type: ignore[misc]  # instance shadows the ClassVar

    def validate(self) -> None:
        super().validate()
        a = self.args
        require(a.min_length >= 1, "min_length", f"must be >= 1, got {a.min_length}")
        require(
            a.max_length >= a.min_length,
            "max_length",
            f"must be >= task.min_length={a.min_length}, got {a.max_length}",
        )
        self._hard = int_list("hard_lengths", a.hard_lengths, above=a.max_length)

    def levels(self) -> list[Level]:
        a = self.args
        return [Level("id", {"length": (a.min_length, a.max_length)}, True)] + [
            Level(f"l{n}", {"length": (n, n)}, False) for n in self._hard
        ]

    def generate(self, rng: random.Random, level: Level) -> Problem:
        lo, hi = level.knobs["length"]
        n = rng.randint(lo, hi) if lo < hi else lo
        bits = rng.getrandbits(n)
        return Problem(f"{bits:0{n}b}=", self._answer(bits, n), {"length": n})

    def _answer(self, bits: int, n: int) -> str:
        if self.args.mode == "prefix":
            return f"{prefix_parities(bits, n):0{n}b}"
        return str(bits.bit_count() & 1)

    def solve(self, prompt: str) -> str:
        body = prompt[:-1]
        if not (prompt.endswith("=") and body and set(body) <= {"0", "1"}):
            raise TaskError(f"a parity prompt is bits, then '=', got {prompt!r}")
        return self._answer(int(body, 2), len(body))

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        n = level.knobs["length"][1]
        return n + 1, n if self.args.mode == "prefix" else 1

    def train_overrides(self, preset: str) -> dict[str, object]:
        # Prefix parities are local once written out (one XOR per answer bit) and learned early; whole-string
        # parity is the hard one, learned between steps 2000 and 3000 in a first run, so it gets twice the steps.
        if preset == "small":
            steps = 2000 if self.args.mode == "prefix" else 4000
            return {
                "train.max_steps": steps,
                "train.batch_size": 64,
                "train.grad_accum": 1,
                "train.warmup_steps": 100,
                "train.eval_interval": steps // 10,
                "train.ckpt_interval": steps // 4,
            }
        return {}
