"""Addition: two operands of up to n digits, digits reversed, zero-padded to the level's width; the sum likewise.

    prompt  "4321000000+0065000000="    (1234 + 5600 in distribution, width 10: least significant digit first)
    answer  "43860000000"               (6834, least significant digit first, width 11)

Follows McLeish et al. 2024 ("Transformers can do arithmetic with the right embeddings", arXiv 2405.17399) and the
looped-transformer length-generalisation setup of Fan et al. 2025 (arXiv 2409.15647): train on up to `max_digits`
digits, test on more.

Format choices. Reversed digits put the units first, so the model writes the sum in the order the carries flow and
each answer digit depends on the operand digits at its own position and on one carry; written the usual way the
first answer digit would depend on every digit. Both operands are zero-padded to one width per level (pad="level":
the level's most digits, 10 in distribution, 15 and 20 above), and the answer to that width + 1, so digit i of each
operand sits at the same offset from digit i of the answer in every problem of a level, and the model never has to
find where a number ends or guess the answer's length. Known learnable at dim 64, 4 layers, batch 64: answer loss
0.007 by step 1000 with this padding. Padded to each problem's own width instead (pad="problem"), the offsets vary
with n and the same model is still near chance on whole answers at step 1000. A harder level is a width the model
never saw, which is the extrapolation it measures.

n is drawn uniformly from the level's range (1..max_digits in distribution), one operand uniformly among the
n-digit numbers and the other among 0..10^n - 1, in random order, so n is the number of digits of the larger
operand and can be read from the prompt.

Difficulty: {"digits": n}. Levels: "id" (1..max_digits), then "d15", "d20" (`hard_digits`), one n each.
Lengths: prompt 2w + 2, answer w + 1, with w the width (the level's most digits).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require


@dataclass(frozen=True, kw_only=True)
class AdditionArgs(TaskArgs):
    max_digits: int = 10  # in distribution: operands of 1..max_digits digits
    hard_digits: str = "15,20"  # one harder level per number of digits
    # zero-pad both operands to the level's most digits (one width per level: 10 in distribution), or to this
    # problem's digits (a width per problem)
    pad: Literal["level", "problem"] = "level"


@register("addition", args=AdditionArgs)
class Addition(Task):
    label = "Addition"
    description = "two-operand addition, digits reversed and zero-padded"
    source = "McLeish et al. 2024 (arXiv 2405.17399); Fan et al. 2025 (arXiv 2409.15647)"
    symbols = "0123456789+="
    args: AdditionArgs

    def validate(self) -> None:
        super().validate()
        a = self.args
        require(a.max_digits >= 1, "max_digits", f"must be >= 1, got {a.max_digits}")
        self._hard = int_list("hard_digits", a.hard_digits, above=a.max_digits)

    def levels(self) -> list[Level]:
        return [Level("id", {"digits": (1, self.args.max_digits)}, True)] + [
            Level(f"d{n}", {"digits": (n, n)}, False) for n in self._hard
        ]

    def generate(self, rng: random.Random, level: Level) -> Problem:
        lo, hi = level.knobs["digits"]
        n = rng.randint(lo, hi) if lo < hi else lo
        w = hi if self.args.pad == "level" else n
        # n digits: one operand has exactly n (so n is readable from the prompt), the other at most n
        a = rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n)
        b = rng.randrange(10**n)
        if rng.getrandbits(1):
            a, b = b, a
        prompt = f"{a:0{w}d}"[::-1] + "+" + f"{b:0{w}d}"[::-1] + "="
        return Problem(prompt, f"{a + b:0{w + 1}d}"[::-1], {"digits": n})

    def solve(self, prompt: str) -> str:
        left, sep, right = prompt.partition("+")
        if not (sep and right.endswith("=")):
            raise TaskError(f"an addition prompt is 'A+B=' with reversed digits, got {prompt!r}")
        right = right[:-1]
        n = len(left)
        if not (n and len(right) == n and left.isdigit() and right.isdigit()):
            raise TaskError(f"an addition prompt has two operands of the same width, got {prompt!r}")
        return f"{int(left[::-1]) + int(right[::-1]):0{n + 1}d}"[::-1]

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        n = level.knobs["digits"][1]
        return 2 * n + 2, n + 1

    def train_overrides(self, preset: str) -> dict[str, object]:
        # Answer loss 0.007 by step 1000 at dim 64, 4 layers, batch 64: twice that leaves room for the slower
        # architectures and for the hardest in-distribution widths.
        if preset == "small":
            return {
                "train.max_steps": 2000,
                "train.batch_size": 64,
                "train.grad_accum": 1,
                "train.warmup_steps": 100,
                "train.eval_interval": 200,
                "train.ckpt_interval": 500,
            }
        return {}
