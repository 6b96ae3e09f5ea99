"""Preparing the data a run trains on: `benchctl.core.data.prepare` for what `PrepareOptions` names (see that module
for the source, the tokenizer, the pretokenized splits and the cache)."""

from __future__ import annotations

from benchctl.core import data
from benchctl.core.progress import Progress
from benchctl.stages.prepare.options import PrepareOptions


def prepare(opts: PrepareOptions, *, progress: bool | Progress = True) -> data.Prepared:
    """The prepared data (instant when the cache already holds it)."""
    return data.prepare(opts.data, opts.vocab_size, progress=progress)
