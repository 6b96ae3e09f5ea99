"""p-hop induction: follow p induction-head hops back through a letter sequence from its last letter.

    prompt  ">>cabcdbcacbad="   (one ">" per hop, then a sequence X of `length` letters, then "=")
    answer  "c"

Follows Sanford, Hsu and Telgarsky 2024 ("Transformers, parallel computation, and logarithmic depth", ICML 2024,
arXiv 2402.09268), whose hop_k a transformer of depth O(log k) can compute, and Saunshi et al. 2025 ("Reasoning
with latent thoughts", ICLR 2025, arXiv 2502.17416), who use it to compare looped and deep models.

The hop, with 0-based positions: from position i, find the largest j < i with X[j] == X[i] and move to j + 1 (the
letter after the last earlier occurrence of the current letter: one induction-head step; Sanford et al.'s find and
hop). Start at the last position, hop p times, answer with the letter there. In the example (length 12, p = 2):
from "d" at 11 the last earlier "d" is at 4, so move to 5 ("b"); the last "b" before 5 is at 2, so move to 3: "c".

Construction (so every hop is defined, which a random sequence does not guarantee for large p): choose the chain
positions i_0 = length-1 > i_1 > ... > i_p >= 1, at least 2 apart, uniformly among such choices; choose their
letters c_0..c_p, each different from the one before (and from the one two before where two chain positions are
only 2 apart, so that neighbours differ); plant c_k at i_k and c_{k-1} at i_k - 1; fill every other position at
random so that no letter equals its neighbour (as Sanford et al. generate sequences) and no position in
[i_k, i_{k-1}) holds c_{k-1}. Then the last c_{k-1} before i_{k-1} is at i_k - 1, so hop k goes from i_{k-1} to i_k
exactly, and the answer is c_p.

Format choices. The hop count is written in unary (p copies of ">"), not as a number: a harder level then shows
the model more of a token it was trained on, where a digit it never saw in that place would fail for a reason
unrelated to depth. It comes first, as Sanford et al.'s hop-count token does, so the last letter is always the one
just before "=", where the answer is predicted. The sequence length stays `length` at every level, so a harder level
changes only the number of hops (p hops need length >= 2p + 2). Letters are a..z; the tokenizer holds all 26
whatever `alphabet` is, so one vocabulary serves every setting.

Sizes. The answer is one token, so a problem trains the model on one prediction, and induction has to be found
from that sparse signal: with 4 letters and 24 positions a dim-64, 4-layer model learns 1 and 2 hops within a few
thousand steps, where 8 letters, 48 positions and 1 to 4 hops showed no progress at all in 2000. Two hops take two
chained induction steps, about the most 4 layers hold without a cleverer algorithm; 4 and 8 hops then ask for two
and four times the trained depth.

Difficulty: {"hops": p, "length": length}. Levels: "id" (1..max_hops), then "p4", "p8" (`hard_hops`).
Lengths: prompt p + length + 1, answer 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require

LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TO_LETTER = bytes.maketrans(bytes(range(26)), LETTERS.encode())


@dataclass(frozen=True, kw_only=True)
class PhopArgs(TaskArgs):
    alphabet: int = 4  # letters a.. used in sequences (4..26)
    length: int = 24  # letters per sequence, at every level
    max_hops: int = 2  # in distribution: 1..max_hops hops
    hard_hops: str = "4,8"  # one harder level per hop count


@register("phop", args=PhopArgs)
class Phop(Task):
    label = "p-hop"
    description = "p-hop induction: follow p induction hops back from the last letter"
    source = "Sanford, Hsu, Telgarsky 2024 (arXiv 2402.09268); Saunshi et al. 2025 (arXiv 2502.17416)"
    symbols = LETTERS + ">="
    args: PhopArgs

    def validate(self) -> None:
        super().validate()
        a = self.args
        require(4 <= a.alphabet <= 26, "alphabet", f"must be in [4, 26], got {a.alphabet}")
        require(a.max_hops >= 1, "max_hops", f"must be >= 1, got {a.max_hops}")
        self._hard = int_list("hard_hops", a.hard_hops, above=a.max_hops)
        most = max((a.max_hops, *self._hard))
        require(
            a.length >= 2 * most + 2,
            "length",
            f"must be >= 2 x the most hops + 2 = {2 * most + 2} to fit a {most}-hop chain, got {a.length}",
        )
        self._letters = range(a.alphabet)
        self._allowed: dict[tuple[int, int, int], tuple[int, ...]] = {}  # (left, right, avoided) -> the others

    def levels(self) -> list[Level]:
        a = self.args
        return [Level("id", {"hops": (1, a.max_hops), "length": (a.length, a.length)}, True)] + [
            Level(f"p{p}", {"hops": (p, p), "length": (a.length, a.length)}, False) for p in self._hard
        ]

    def generate(self, rng: random.Random, level: Level) -> Problem:
        A, N = self.args.alphabet, self.args.length
        lo, hi = level.knobs["hops"]
        p = rng.randint(lo, hi) if lo < hi else lo
        # chain positions, ascending (i_p .. i_1), >= 2 apart, in [1, N-3]: a sorted sample of p values from
        # [1, N-2-p] spread by +0, +1, ..., +(p-1)
        ys = sorted(rng.sample(range(1, N - 1 - p), p))
        pos = [y + t for t, y in enumerate(ys)][::-1]  # i_1 > i_2 > ... > i_p
        # chain letters: c_k != c_{k-1}, and != c_{k-2} where i_k is 2 before i_{k-1} (then c_k sits next to the
        # c_{k-2} planted at i_{k-1} - 1, and neighbours differ)
        chain = [rng.randrange(A)]  # c_0
        prev = N - 1
        for k, i in enumerate(pos, start=1):
            banned = sorted({chain[-1], chain[-2]}) if k > 1 and prev - i == 2 else [chain[-1]]
            c = rng.randrange(A - len(banned))
            for b in banned:
                if c >= b:
                    c += 1
            chain.append(c)
            prev = i
        X = [-1] * N
        avoid = [-1] * N  # the letter a free position must not hold: c_{k-1} in [i_k, i_{k-1})
        X[N - 1] = chain[0]
        prev = N - 1
        for k, i in enumerate(pos, start=1):
            X[i] = chain[k]
            X[i - 1] = chain[k - 1]
            avoid[i:prev] = [chain[k - 1]] * (prev - i)
            prev = i
        # fill left to right, each free position uniformly among the letters that differ from both neighbours and
        # from the avoided one (at most 3 of >= 4 excluded)
        right = X[1:] + [-1]  # planted right neighbours (free ones are filled later, and checked then)
        allowed, letters, uniform = self._allowed, self._letters, rng.random
        left = -1
        for t in range(N):
            c = X[t]
            if c < 0:
                near = (left, right[t], avoid[t])
                options = allowed.get(near)
                if options is None:
                    options = allowed[near] = tuple(x for x in letters if x not in near)
                c = X[t] = options[int(uniform() * len(options))]  # as random.choices draws
            left = c
        seq = bytes(X).translate(_TO_LETTER).decode("ascii")
        return Problem(">" * p + seq + "=", LETTERS[chain[p]], {"hops": p, "length": N})

    def solve(self, prompt: str) -> str:
        seq = prompt.lstrip(">")[:-1]
        p = len(prompt) - len(seq) - 1
        if not (prompt.endswith("=") and p >= 1 and seq.isalpha() and seq.islower()):
            raise TaskError(f"a p-hop prompt is one '>' per hop, then letters, then '=', got {prompt!r}")
        i = len(seq) - 1
        for k in range(1, p + 1):
            j = seq.rfind(seq[i], 0, i)
            if j < 0:
                raise TaskError(f"hop {k} of {prompt!r} is undefined: {seq[i]!r} at {i} has no earlier occurrence")
            i = j + 1
        return seq[i]

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        return level.knobs["length"][1] + level.knobs["hops"][1] + 1, 1

    def train_overrides(self, preset: str) -> dict[str, object]:
        # One supervised token per problem: 1 and 2 hops at the defaults are mostly learned by 4000 steps, with
        # the answer loss still falling.
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
