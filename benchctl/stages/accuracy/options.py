"""What `benchctl accuracy` (and the study's accuracy stage) can be asked for: one frozen `AccuracyOptions`, checked
when built, each error naming its flag.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from benchctl.core.errors import ConfigError
from benchctl.stages import RunSelection
from benchctl.stages.depth.options import check_test_depth, parse_depths

# Held-out problems scored per level: enough that one level's exact match has a 95% interval no wider than about
# ±4.4 points. The smoke preset scores fewer, to stay a smoke run.
DEFAULT_PROBLEMS = 500
TINY_PROBLEMS = 50
MAX_PROBLEMS = 100_000
# The test split's seed: every run of every architecture is scored on the same problems (task, level, seed, index).
DEFAULT_SEED = 0
# The deepest default test-time depth, as a multiple of the trained one: the logical-extrapolation curve runs from one
# iteration to this many times the trained depth.
DEPTH_FACTOR = 4


def default_depths(trained: int, limit: int | None) -> list[int]:
    """Test-time depths for a model trained at `trained` iterations: 1, the powers of two, and 1x to 4x the trained
    depth, up to `DEPTH_FACTOR` times it and the model's own limit (`max_n_recur`; a plain model runs only 1)."""
    top = DEPTH_FACTOR * trained if limit is None else min(limit, DEPTH_FACTOR * trained)
    powers = {2**k for k in range(12) if 2**k <= top}
    multiples = {k * trained for k in range(1, DEPTH_FACTOR + 1) if k * trained <= top}
    return sorted(powers | multiples | {min(trained, top)})


@dataclass(frozen=True, kw_only=True)
class AccuracyOptions:
    """Everything one `benchctl accuracy` decides. `depths` takes the command line's comma list and holds it parsed
    (None: `default_depths` per run); `levels` None is every level of each run's task."""

    select: RunSelection = field(default_factory=RunSelection)
    depths: Sequence[int] | str | None = None
    levels: Sequence[str] | None = None
    problems: int | None = None  # None: DEFAULT_PROBLEMS (TINY_PROBLEMS at the tiny preset)
    seed: int = DEFAULT_SEED
    device: str = "auto"
    yes: bool = False

    def __post_init__(self) -> None:
        if self.depths is not None:
            object.__setattr__(self, "depths", tuple(parse_depths(self.depths)))
            check_test_depth(max(self.depths), "--depths")  # type: ignore[arg-type]
        if self.levels is not None:
            object.__setattr__(self, "levels", tuple(self.levels))
        if self.problems is not None and not 1 <= self.problems <= MAX_PROBLEMS:
            raise ConfigError(f"--problems must be in [1, {MAX_PROBLEMS}], got {self.problems}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")

    def problems_for(self, preset: str) -> int:
        if self.problems is not None:
            return self.problems
        return TINY_PROBLEMS if preset == "tiny" else DEFAULT_PROBLEMS
