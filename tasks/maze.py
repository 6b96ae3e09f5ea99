"""Maze: mark the shortest path from S to G in a small grid maze.

    prompt  #######      answer  #######
            #.....#              #*****#
            #.###.#              #*###*#
            #.#.#.#              #*#.#*#      (rows joined by newlines; the prompt ends in "=")
            #.#.#.#              #*#.#*#
            #..G#S#              #**G#S#
            #######              #######

Follows the DeepThinking maze task (Schwarzschild et al. 2021, arXiv 2106.04537; Bansal et al. 2022, arXiv
2202.05826), scaled down to sizes a small character-level model handles, and the maze benchmarks of the recurrent
reasoning models HRM (Wang et al. 2025, arXiv 2506.21734) and TRM (Jolicoeur-Martineau 2025, arXiv 2510.04871):
train on one size, test on bigger ones, where a model that iterates the path search should keep working.

Generation: a perfect maze (exactly one path between any two open cells) by randomised depth-first search over the
cells at odd coordinates of a size x size grid, walls '#' everywhere else, including the border; S and G at two
distinct random cells. The answer is the same grid with every cell strictly between S and G on their path marked
'*'; because the maze is perfect, that path is the unique shortest one, so the answer is unique.

Format choices. The grid is written row by row with a newline between rows, in the prompt and in the answer: the
row separator lets a model find the cell above or below at any size, where a fixed row width would have to be
learned from the training size alone. The answer repeats the whole grid (as DeepThinking's output mask does), so
per-position accuracy is meaningful. Sequence lengths grow as size^2: size 7 is a 56-character prompt and a
55-character answer (113 tokens with <bos>, <eos>), size 9 is 181 tokens, size 11 is 265. Size 7 has 3 x 3 cells:
192 perfect mazes and 72 ordered (S, G) pairs, about 14k distinct problems, of which the held-out splits take 1/8.

Difficulty: {"size": size, "path": the number of moves from S to G}. Levels: "id" (`size`), then "s9", "s11"
(`hard_sizes`), each one size.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks import register
from tasks.base import Level, Problem, Task, TaskArgs, TaskError, int_list, require

MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))


@dataclass(frozen=True, kw_only=True)
class MazeArgs(TaskArgs):
    size: int = 7  # in distribution: size x size grids (odd, >= 5)
    hard_sizes: str = "9,11"  # one harder level per size


def _layout(size: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """The cells of a size x size maze as flat grid indices, and each cell's neighbours (cell number, index of the
    wall between them)."""
    m = (size - 1) // 2
    cells = [(2 * r + 1) * size + 2 * c + 1 for r in range(m) for c in range(m)]
    nbrs: list[list[tuple[int, int]]] = []
    for r in range(m):
        for c in range(m):
            here = cells[r * m + c]
            out = []
            for dr, dc in MOVES:
                rr, cc = r + dr, c + dc
                if 0 <= rr < m and 0 <= cc < m:
                    out.append((rr * m + cc, here + dr * size + dc))
            nbrs.append(out)
    return cells, nbrs


@register("maze", args=MazeArgs)
class Maze(Task):
    label = "Maze"
    description = "mark the unique shortest path from S to G in a perfect grid maze"
    source = (
        "Schwarzschild et al. 2021 (arXiv 2106.04537); Bansal et al. 2022 (arXiv 2202.05826); "
        "Wang et al. 2025, HRM (arXiv 2506.21734); Jolicoeur-Martineau 2025, TRM (arXiv 2510.04871)"
    )
    symbols = "#.SG*\n="
    sequence_answer = True
    args: MazeArgs

    def validate(self) -> None:
        super().validate()
        a = self.args
        require(a.size >= 5 and a.size % 2 == 1, "size", f"must be odd and >= 5, got {a.size}")
        self._hard = int_list("hard_sizes", a.hard_sizes, above=a.size)
        for s in self._hard:
            require(s % 2 == 1, "hard_sizes", f"values must be odd, got {s} in {a.hard_sizes!r}")
        self._layouts = {s: _layout(s) for s in (a.size, *self._hard)}

    def levels(self) -> list[Level]:
        s = self.args.size
        return [Level("id", {"size": (s, s)}, True)] + [Level(f"s{n}", {"size": (n, n)}, False) for n in self._hard]

    def generate(self, rng: random.Random, level: Level) -> Problem:
        lo, hi = level.knobs["size"]
        size = rng.choice(range(lo, hi + 1, 2)) if lo < hi else lo
        cells, nbrs = self._layouts[size] if size in self._layouts else _layout(size)
        n = len(cells)
        grid = ["#"] * (size * size)
        parent = [-1] * n  # the depth-first search tree, for the path
        wall_to_parent = [-1] * n
        root = rng.randrange(n)
        seen = [False] * n
        seen[root] = True
        grid[cells[root]] = "."
        stack = [root]
        randrange = rng.randrange
        while stack:
            cur = stack[-1]
            options = [(c, w) for c, w in nbrs[cur] if not seen[c]]
            if not options:
                stack.pop()
                continue
            nxt, wall = options[randrange(len(options))] if len(options) > 1 else options[0]
            seen[nxt] = True
            parent[nxt], wall_to_parent[nxt] = cur, wall
            grid[wall] = grid[cells[nxt]] = "."
            stack.append(nxt)
        s, g = rng.sample(range(n), 2)
        # the tree path: S up to the common ancestor, then down to G
        up_s = [s]
        while parent[up_s[-1]] >= 0:
            up_s.append(parent[up_s[-1]])
        on_s = {c: k for k, c in enumerate(up_s)}
        up_g = [g]
        while up_g[-1] not in on_s:
            up_g.append(parent[up_g[-1]])
        meet = up_g[-1]
        route = up_s[: on_s[meet] + 1] + up_g[-2::-1]  # cells S .. meet .. G
        answer = grid[:]
        for a, b in zip(route, route[1:]):
            answer[wall_to_parent[a] if parent[a] == b else wall_to_parent[b]] = "*"
            answer[cells[b]] = "*"
        grid[cells[s]] = answer[cells[s]] = "S"
        grid[cells[g]] = answer[cells[g]] = "G"
        moves = 2 * (len(route) - 1)
        return Problem(_text(grid, size) + "=", _text(answer, size), {"size": size, "path": moves})

    def solve(self, prompt: str) -> str:
        """Breadth-first search from S; the path to G through the first-found parents (any grid of '#', '.', one
        'S' and one 'G', rows of one width; in a perfect maze that path is the only one)."""
        rows = prompt[:-1].split("\n")
        width = len(rows[0])
        text = "".join(rows)
        if not (prompt.endswith("=") and width and all(len(r) == width for r in rows) and set(text) <= set("#.SG")):
            raise TaskError(
                f"a maze prompt is equal-width rows of '#', '.', 'S', 'G' joined by newlines, then '=', got {prompt!r}"
            )
        if text.count("S") != 1 or text.count("G") != 1:
            raise TaskError(f"a maze prompt has exactly one 'S' and one 'G', got {prompt!r}")
        start, goal = text.index("S"), text.index("G")
        height = len(rows)
        came = {start: start}
        frontier = [start]
        while frontier and goal not in came:
            nxt = []
            for here in frontier:
                r, c = divmod(here, width)
                for dr, dc in MOVES:
                    rr, cc = r + dr, c + dc
                    there = rr * width + cc
                    if 0 <= rr < height and 0 <= cc < width and text[there] != "#" and there not in came:
                        came[there] = here
                        nxt.append(there)
            frontier = nxt
        if goal not in came:
            raise TaskError(f"the maze in {prompt!r} has no path from S to G")
        out = list(text)
        here = came[goal]
        while here != start:
            out[here] = "*"
            here = came[here]
        return _text(out, width)

    def max_prompt_answer(self, level: Level) -> tuple[int, int]:
        s = level.knobs["size"][1]
        return s * s + s, s * s + s - 1  # s rows of s, s - 1 newlines, and the prompt's "="

    def train_overrides(self, preset: str) -> dict[str, object]:
        # The longest sequences of the five tasks (113 tokens at size 7), so the fewest steps: copying the grid is
        # learned within a few hundred, marking the path takes longer.
        if preset == "small":
            return {
                "train.max_steps": 1500,
                "train.batch_size": 64,
                "train.grad_accum": 1,
                "train.warmup_steps": 100,
                "train.eval_interval": 150,
                "train.ckpt_interval": 500,
            }
        return {}


def _text(grid: list[str], width: int) -> str:
    return "\n".join("".join(grid[i : i + width]) for i in range(0, len(grid), width))
