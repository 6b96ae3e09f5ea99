"""What `benchctl prepare` (and the study's prepare stage) prepares: one frozen `PrepareOptions`.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchctl.core.config import DataConfig


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """A data source and its settings (a resolved config's `data`, so already checked), tokenized at `vocab_size`."""

    data: DataConfig
    vocab_size: int
