"""Sum: n single-digit operands added at once; the total reversed and zero-padded to a fixed width.

    prompt  "7+5+9+3="     (n = 4)
    answer  "420"          (24, least significant digit first, padded to 3 digits)

Follows the n-ary addition task of Saunshi et al. 2025 ("Reasoning with latent thoughts: on the power of looped
transformers", ICLR 2025), where the number of operands is the depth knob: a model that adds one operand per layer
(or per loop) needs more depth for more operands. Operands are single digits so that the only difficulty is their
number. Known learnable at dim 64, 4 layers, batch 64: 2 to 8 operands, answer loss 0.076 by step 2500.

Format choices. The total is written least significant digit first, like `addition`, so the first answer token is
the sum mod 10 and the next ones follow from it and the carry. It is padded to the width of the largest total any
level can reach (9 x the most operands of any level: 144 -> 3 digits at the defaults), so every level's answer has
the same length and a harder level changes only the number of operands, not the answer's shape. The width is fixed
by the knobs, so `solve` reads it from them; the operands come from the prompt. The operands are separated by "+"
so that the count is visible (and one operand is one token pair, at every n).

Difficulty: {"operands": n}. Levels: "id" (min_operands..max_operands), then "n12", "n16" (`hard_operands`).
Lengths: prompt 2n, answer the fixed width.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require


@dataclass(frozen=True, kw_only=True)
class SumArgs(TaskArgs):
    min_operands: int = 2
    max_operands: int = 8  # in distribution: min_operands..max_operands single digits
    hard_operands: str = "12,16"  # one harder level per count


@register("sum", args=SumArgs)
class NarySum(Task):
    label = "Sum"
    description = "n-ary addition of single digits, total reversed and zero-padded"
    source = "Saunshi et al. 2025 (ICLR 2025, arXiv 2502.17416)"
    symbols = "0123456789+="
    args: SumArgs

    def validate(self) -> None:
        super().validate()
        a = self.args
        require(a.min_operands >= 1, "min_operands", f"must be >= 1, got {a.min_operands}")
        require(
            a.max_operands >= a.min_operands,
            "max_operands",
            f"must be >= task.min_operands={a.min_operands}, got {a.max_operands}",
        )
        self._hard = int_list("hard_operands", a.hard_operands, above=a.max_operands)
        self.width = len(str(9 * max((a.max_operands, *self._hard))))

    def levels(self) -> list[Level]:
        a = self.args
        return [Level("id", {"operands": (a.min_operands, a.max_operands)}, True)] + [
            Level(f"n{n}", {"operands": (n, n)}, False) for n in self._hard
        ]

    def generate(self, rng: random.Random, level: Level) -> Problem:
        lo, hi = level.knobs["operands"]
        n = rng.randint(lo, hi) if lo < hi else lo
        digits = f"{rng.randrange(10**n):0{n}d}"  # n independent uniform digits in one draw
        return Problem("+".join(digits) + "=", self._answer(sum(map(int, digits))), {"operands": n})

    def _answer(self, total: int) -> str:
        return f"{total:0{self.width}d}"[::-1]

    def solve(self, prompt: str) -> str:
        body = prompt[:-1].split("+")
        if not (prompt.endswith("=") and all(len(d) == 1 and d.isdigit() for d in body)):
            raise TaskError(f"a sum prompt is single digits joined by '+' and ending in '=', got {prompt!r}")
        total = sum(map(int, body))
        if len(str(total)) > self.width:
            raise TaskError(f"the total of {prompt!r} has more than this task's {self.width} answer digits")
        return self._answer(total)

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        return 2 * level.knobs["operands"][1], self.width

    def train_overrides(self, preset: str) -> dict[str, object]:
        # Answer loss 0.076 by step 2500 at dim 64, 4 layers, batch 64 (2 to 8 operands): 4000 steps to get it
        # near zero.
        if preset == "small":
            return {
                "train.max_steps": 4000,
                "train.batch_size": 64,
                "train.grad_accum": 1,
                "train.warmup_steps": 100,
                "train.eval_interval": 400,
                "train.ckpt_interval": 1000,
            }
        return {}
