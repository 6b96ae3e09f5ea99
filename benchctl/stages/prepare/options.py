"""What `benchctl prepare` (and the study's prepare stage) prepares: one frozen `PrepareOptions`.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchctl.core.config import DataConfig, TaskConfig


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """A data source and its settings (a resolved config's `data`, so already checked), tokenized at `vocab_size`;
    or, for a procedural `task`, that task's tokenizer (there is no corpus to prepare)."""

    data: DataConfig
    vocab_size: int
    task: TaskConfig = field(default_factory=TaskConfig)
