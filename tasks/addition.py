"""Addition: two n-digit operands, digits reversed, zero-padded to n; the sum reversed, zero-padded to n + 1.

    prompt  "4321+0065="    (1234 + 5600, n = 4: each operand written least significant digit first)
    answer  "43860"         (6834, least significant digit first, n + 1 = 5 digits)

Follows McLeish et al. 2024 ("Transformers can do arithmetic with the right embeddings", arXiv 2405.17399) and the
looped-transformer length-generalisation setup of Fan et al. 2025 (arXiv 2409.15647): train on up to `max_digits`
digits, test on more.

Format choices. Reversed digits put the units first, so the model writes the sum in the order the carries flow and
each answer digit depends on the operand digits at its own position and on one carry; written the usual way the
first answer digit would depend on every digit. Both operands are padded to the same width n, so digit i of each
operand sits at a fixed offset from digit i of the answer at every n, and the answer always has n + 1 digits (the
last is the final carry, often 0), so the model never has to guess the length. n is drawn uniformly from
1..max_digits in distribution, then each operand uniformly from 0..10^n - 1 (leading zeros included). Known
learnable at dim 64, 4 layers, batch 64: up to 10 digits, answer loss 0.007 by step 1000.

Difficulty: {"digits": n}, the padded width. Levels: "id" (1..max_digits), then "d15", "d20" (`hard_digits`).
Lengths: prompt 2n + 2, answer n + 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require


@dataclass(frozen=True, kw_only=True)
class AdditionArgs(TaskArgs):
    max_digits: int = 10  # in distribution: widths 1..max_digits
    hard_digits: str = "15,20"  # one harder level per width


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
        top = 10**n
        a, b = rng.randrange(top), rng.randrange(top)
        prompt = f"{a:0{n}d}"[::-1] + "+" + f"{b:0{n}d}"[::-1] + "="
        return Problem(prompt, f"{a + b:0{n + 1}d}"[::-1], {"digits": n})

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
