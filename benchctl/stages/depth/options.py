"""What `benchctl depth` (and the study's depth stage) can be asked for: one frozen `DepthOptions`, checked when
built, each error naming its flag. The comma lists of the command line (`--depths 1,2,4`) are parsed here.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchctl.core.config import is_smoke
from benchctl.core.errors import ConfigError, did_you_mean
from benchctl.stages import RunSelection

DEFAULT_DEPTHS = (1, 2, 4, 8, 16, 32)
DEFAULT_THRESHOLDS = (1e-2, 1e-3, 1e-4)
# A smoke run (the tiny preset) sweeps depth 1 beside each run's trained depth and twice it (which the default sweep
# adds too), and the exit at one threshold: every path of the stage and its report, on a fraction of the forwards.
SMOKE_DEPTHS = (1,)
SMOKE_THRESHOLDS = (1e-2,)
EXIT_RULES = ("kl", "latent")
# The deepest test-time recurrence `depth` and `sample` accept: far past any trained depth here (the presets train 4 to
# 16 iterations), a bound on a typo (100000) that would otherwise run for days. Below it, work estimated at over an
# hour asks first (--yes answers).
MAX_TEST_DEPTH = 1024


def parse_depths(text: str | Sequence[int] | None, option: str = "--depths") -> list[int]:
    """ "1,2,4" -> [1, 2, 4]: positive integers, duplicates dropped; a ConfigError naming the option otherwise."""
    if text is None:
        return list(DEFAULT_DEPTHS)
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else [str(p) for p in text]
    try:
        out = [int(p) for p in parts if p]
    except ValueError:
        raise ConfigError(f"{option}: expected a comma list of integers >= 1, got {text!r}") from None
    if not out or any(d < 1 for d in out):
        raise ConfigError(f"{option}: expected a comma list of integers >= 1, got {text!r}")
    check_test_depth(max(out), option)
    return sorted(set(out))


def check_test_depth(depth: int, option: str) -> None:
    if depth > MAX_TEST_DEPTH:
        raise ConfigError(f"{option}: at most {MAX_TEST_DEPTH} iterations, got {depth}")


def parse_thresholds(text: str | Sequence[float] | None) -> list[float]:
    if text is None:
        return list(DEFAULT_THRESHOLDS)
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else [str(p) for p in text]
    try:
        out = [float(p) for p in parts if p]
    except ValueError:
        raise ConfigError(f"--thresholds: expected a comma list of numbers >= 0, got {text!r}") from None
    if not out or any(not (t >= 0 and math.isfinite(t)) for t in out):
        raise ConfigError(f"--thresholds: expected a comma list of numbers >= 0, got {text!r}")
    return sorted(set(out), reverse=True)


def check_exit_rule(rule: str | None) -> str | None:
    if rule is not None and rule not in EXIT_RULES:
        raise ConfigError(
            f"--exit: unknown rule '{rule}'{did_you_mean(rule, EXIT_RULES)} choose {' or '.join(EXIT_RULES)}"
        )
    return rule


def check_extrapolate(rule: str | None) -> str | None:
    """A rule no registered architecture knows is an error, even for a selection that would not use it."""
    if rule is None:
        return None
    import architectures  # torch: kept out of 'benchctl --help', which imports this module

    known = sorted({r for a in architectures.names() for r in architectures.get(a).extrapolate_rules})
    if rule not in known:
        raise ConfigError(
            f"--extrapolate: unknown rule '{rule}'{did_you_mean(rule, known)} (known: {', '.join(known)})"
        )
    return rule


@dataclass(frozen=True, kw_only=True)
class DepthOptions:
    """Everything one `benchctl depth` decides. `depths` and `thresholds` take the command line's comma lists (or
    numbers) and hold them parsed, as sorted tuples."""

    select: RunSelection = field(default_factory=RunSelection)
    depths: Sequence[int] | str | None = None  # None: `sweep` and each run's trained depth and twice it
    sweep: Sequence[int] = DEFAULT_DEPTHS  # the fixed depths of the default sweep (without `depths`)
    exit_rule: str | None = None  # kl | latent: the adaptive exit at each threshold instead of fixed depths
    thresholds: Sequence[float] | str | None = None  # None: DEFAULT_THRESHOLDS
    max_depth: int | None = None  # with an exit rule (None: each run's trained depth)
    windows: int | None = None  # the first N of the run's fixed validation windows (None: all)
    extrapolate: str | None = None  # the rule past the trained depth (None: each architecture's default)
    device: str = "auto"
    yes: bool = False  # start work estimated at over an hour without asking

    def __post_init__(self) -> None:
        if self.depths is not None:
            object.__setattr__(self, "depths", tuple(parse_depths(self.depths)))
        object.__setattr__(self, "sweep", tuple(parse_depths(self.sweep)))
        object.__setattr__(self, "thresholds", tuple(parse_thresholds(self.thresholds)))
        check_exit_rule(self.exit_rule)
        check_extrapolate(self.extrapolate)
        if self.max_depth is not None and self.max_depth < 1:
            raise ConfigError(f"--max-depth must be >= 1, got {self.max_depth}")
        if self.max_depth is not None:
            check_test_depth(self.max_depth, "--max-depth")
        if self.windows is not None and self.windows < 1:
            raise ConfigError(f"--windows must be >= 1, got {self.windows}")


def for_study(preset: str | None, select: RunSelection, exit_rule: str | None) -> DepthOptions:
    """What the study's depth stage measures for the runs `select` names at `preset` (fixed depths, or the exit
    rule's thresholds): the short smoke sweep at the smoke preset, the defaults otherwise."""
    if is_smoke(preset):
        return DepthOptions(select=select, exit_rule=exit_rule, sweep=SMOKE_DEPTHS, thresholds=SMOKE_THRESHOLDS)
    return DepthOptions(select=select, exit_rule=exit_rule)
