"""What `benchctl eval` (and the study's eval stage) can be asked for: one frozen `EvalOptions`, checked when built,
each error naming its flag, and the names and defaults of the bundled tasks.

Cheap to import: the command line is built from it (`benchctl --help`), and lm-eval takes seconds to load.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchctl.core.config import is_smoke
from benchctl.core.errors import ConfigError, did_you_mean
from benchctl.stages import RunSelection
from benchctl.stages.train.executors import parse_jobs

BUNDLED_TASKS = ("tinystories_ppl", "tinystories_ending", "tinystories_names", "tinystories_order")
DEFAULT_DOCS = 200  # documents per bundled task
# A smoke run (the tiny preset) evaluates the first few documents of each task (lm-eval's limit, stored as limit_n):
# every task, request type and metric runs, on a fraction of the work.
SMOKE_LIMIT = 10
DEFAULT_BATCH_SIZE = 32  # requests per forward pass
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


def check_task_names(standard: Sequence[str]) -> None:
    """A typo of a bundled name is a ConfigError here, before lm-eval's 20-second index is built to look it up."""
    for name in standard:
        if name.startswith("tinystories"):
            hint = did_you_mean(name, BUNDLED_TASKS)
            raise ConfigError(f"unknown task '{name}'{hint} bundled tasks: {', '.join(BUNDLED_TASKS)}")


def study_limit(preset: str | None) -> int | None:
    """The document limit of the study's eval stage at `preset` (None: every document)."""
    return SMOKE_LIMIT if is_smoke(preset) else None


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """Everything one `benchctl eval` decides. `tasks` are bundled names, lm-eval task names or globs, or tasks
    defined by YAMLs under `include_paths` (None: the bundled ones); held as tuples, duplicates dropped."""

    select: RunSelection = field(default_factory=RunSelection)
    tasks: Sequence[str] | None = None
    n_recur: int | None = None  # None: each run's trained recurrence
    limit: int | None = None  # lm-eval's limit: the first N documents of each task (None: all)
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str = "auto"
    force: bool = False  # recompute results already stored
    n_docs: int = DEFAULT_DOCS
    include_paths: Sequence[str | os.PathLike] = ()
    threads: int | None = None  # torch's CPU threads while evaluating (None: torch's choice)
    jobs: int | str = 1  # runs evaluated at once, each share in its own process (a number or "auto")
    precision: str = "auto"  # weights' dtype, cast once; auto: the fastest bench --decode measured here, else fp32

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(dict.fromkeys(self.tasks or BUNDLED_TASKS)))
        for name, value in (("--n-recur", self.n_recur), ("--limit", self.limit)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.n_docs < 1:
            raise ConfigError(f"n_docs must be >= 1, got {self.n_docs}")
        check_task_names(self.standard)
        object.__setattr__(self, "include_paths", tuple(Path(p) for p in self.include_paths))
        for p in self.include_paths:
            if not p.is_dir():
                raise ConfigError(f"--include-path {p} is not a directory of lm-eval task YAMLs")
        parse_jobs(self.jobs)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")

    @property
    def bundled(self) -> list[str]:
        return [t for t in self.tasks if t in BUNDLED_TASKS]

    @property
    def standard(self) -> list[str]:
        """lm-eval or user task names and globs, as given."""
        return [t for t in self.tasks if t not in BUNDLED_TASKS]

    @property
    def limit_n(self) -> int:
        return self.limit or 0  # how eval_results stores "all documents"
