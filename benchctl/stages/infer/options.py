"""What `benchctl infer` (and the study's infer stage) can be asked for: one frozen `InferOptions`, checked when
built, each error naming its flag. The comma lists of the command line (`--kv full,last`) are parsed here.

The defaults are sized for a `small` study on a 2-core CPU: 16 prompts of 16 tokens from the run's own validation
windows, 16 greedy new tokens each, timed at batch 1 on the first 4 prompts and at batch 16 on all of them; the
teacher-forced loss on the first 16 validation windows; the latent view on 2 windows, 4 tokens each. Per recurrent
run that is 14 settings: full depth; the kl exit at thresholds 0, 1e-3 and 1e-2 under each KV strategy (full, last,
budget:2, first; threshold 0 with `full` is full depth itself); speculative drafting at depths 1 and 2 with k = 4.

A tiny study is a smoke run, so its infer stage measures the short set `SMOKE` declares instead (`for_study`): full
depth, one exit setting and one speculative draft per recurrent run, on a few short prompts, each timed once.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchctl.core.config import is_smoke
from benchctl.core.errors import ConfigError, did_you_mean
from benchctl.stages import RunSelection

DEFAULT_THRESHOLDS = (0.0, 1e-3, 1e-2)
DEFAULT_KV = ("full", "last", "budget:2", "first")
DEFAULT_DRAFTS = (1, 2)
EXIT_RULES = ("kl", "latent")
KV_STRATEGIES = ("full", "last", "first", "budget:K")

# What the study measures at the smoke preset: each kind of setting once (full depth, the reference; the kl exit under
# the full cache; a speculative draft at depth 1) on four prompts of 8 tokens, 8 new tokens each, timed once beside
# full depth. Enough to run every measurement path and fill every column; the timings of one repeat are noise, which
# a smoke run may carry. `benchctl infer` and the other presets measure the full set above.
SMOKE: dict[str, Any] = {
    "thresholds": (1e-2,),
    "kv": ("full",),
    "drafts": (1,),
    "batch": 4,
    "single": 1,
    "prompt_tokens": 8,
    "new_tokens": 8,
    "windows": 8,
    "repeats": 1,
    "latent_sequences": 1,
}


def _items(text: str | Sequence[object] | None) -> list[str]:
    if text is None:
        return []
    return [p.strip() for p in text.split(",")] if isinstance(text, str) else [str(p).strip() for p in text]


def parse_thresholds(text: str | Sequence[float] | None) -> tuple[float, ...]:
    """ "0,1e-3" -> (0.0, 0.001): numbers >= 0, duplicates dropped, ascending; None: the defaults."""
    if text is None:
        return DEFAULT_THRESHOLDS
    try:
        out = [float(p) for p in _items(text) if p]
    except ValueError:
        raise ConfigError(f"--thresholds: expected a comma list of numbers >= 0, got {text!r}") from None
    if any(not (t >= 0 and math.isfinite(t)) for t in out):
        raise ConfigError(f"--thresholds: expected a comma list of numbers >= 0, got {text!r}")
    return tuple(sorted(set(out)))


def check_kv(name: str) -> str:
    """One KV strategy: full, last, first or budget:K with K >= 1."""
    if name in ("full", "last", "first"):
        return name
    if name.startswith("budget:"):
        k = name.split(":", 1)[1]
        if k.isdigit() and int(k) >= 1:
            return f"budget:{int(k)}"
        raise ConfigError(f"--kv: budget:K needs a whole number K >= 1, got {name!r}")
    raise ConfigError(
        f"--kv: unknown strategy {name!r}{did_you_mean(name, KV_STRATEGIES)} choose from {', '.join(KV_STRATEGIES)}"
    )


def parse_kv(text: str | Sequence[str] | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_KV
    out = [check_kv(p) for p in _items(text) if p]
    return tuple(dict.fromkeys(out))


def parse_drafts(text: str | Sequence[int] | None) -> tuple[int, ...]:
    """Draft depths for speculative decoding: whole numbers >= 1 (an empty list: no speculative settings)."""
    if text is None:
        return DEFAULT_DRAFTS
    try:
        out = [int(p) for p in _items(text) if p]
    except ValueError:
        raise ConfigError(f"--drafts: expected a comma list of whole numbers >= 1, got {text!r}") from None
    if any(d < 1 for d in out):
        raise ConfigError(f"--drafts: expected a comma list of whole numbers >= 1, got {text!r}")
    return tuple(sorted(set(out)))


@dataclass(frozen=True, kw_only=True)
class InferOptions:
    """Everything one `benchctl infer` decides. The lists take the command line's comma text or sequences and hold
    them parsed, as tuples. Prompt and generation lengths are capped per run so that prompt + new tokens fit its
    context (a row stores the lengths it used)."""

    select: RunSelection = field(default_factory=RunSelection)
    thresholds: Sequence[float] | str | None = None  # exit thresholds (None: 0, 1e-3, 1e-2)
    exit_rule: str = "kl"  # the exit criterion of the threshold settings
    kv: Sequence[str] | str | None = (
        None  # KV strategies crossed with the thresholds (None: full, last, budget:2, first)
    )
    drafts: Sequence[int] | str | None = None  # speculative draft depths (None: 1, 2; empty: none)
    spec_k: int = 4  # tokens drafted per verification
    warm_start: bool = False  # also measure every exit setting with the warm start
    batch: int = 16  # prompts, generated as one batch (the batch-16 numbers)
    single: int = 4  # the first N of them, generated one at a time (the batch-1 numbers)
    prompt_tokens: int = 16  # tokens per prompt, from the start of a validation window
    new_tokens: int = 16  # greedy tokens generated per prompt
    windows: int = 16  # validation windows of the teacher-forced loss (the first N of the run's fixed set)
    repeats: int = 3  # timed generations per setting; the speeds stored are their median
    paired: bool = True  # time full depth beside every other setting, repeat by repeat, and store the ratio
    latent_sequences: int = 2  # validation windows traced for the latent view (0: none)
    latent_tokens: int = 4  # positions per traced window whose state trajectories are projected
    device: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", parse_thresholds(self.thresholds))
        object.__setattr__(self, "kv", parse_kv(self.kv))
        object.__setattr__(self, "drafts", parse_drafts(self.drafts))
        if self.exit_rule not in EXIT_RULES:
            raise ConfigError(
                f"--exit: unknown rule {self.exit_rule!r}{did_you_mean(self.exit_rule, EXIT_RULES)} "
                f"choose {' or '.join(EXIT_RULES)}"
            )
        for name, value, least in (
            ("--spec-k", self.spec_k, 1),
            ("--batch", self.batch, 1),
            ("--single", self.single, 1),
            ("--prompt-tokens", self.prompt_tokens, 1),
            ("--new-tokens", self.new_tokens, 1),
            ("--windows", self.windows, 1),
            ("--repeats", self.repeats, 1),
            ("--latent-sequences", self.latent_sequences, 0),
            ("--latent-tokens", self.latent_tokens, 1),
        ):
            if value < least:
                raise ConfigError(f"{name} must be >= {least}, got {value}")
        if self.single > self.batch:
            raise ConfigError(
                f"--single ({self.single}) cannot exceed --batch ({self.batch}): they are its first prompts"
            )


def for_study(preset: str | None, select: RunSelection) -> InferOptions:
    """What the study's infer stage measures for the runs `select` names at `preset`: the short `SMOKE` set at the
    smoke preset, the full declared set otherwise."""
    smoke = SMOKE if is_smoke(preset) else {}
    return InferOptions(select=select, **smoke)
