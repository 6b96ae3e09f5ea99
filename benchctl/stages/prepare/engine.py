"""Preparing the data a run trains on: `benchctl.core.data.prepare` for what `PrepareOptions` names (see that module
for the source, the tokenizer, the pretokenized splits and the cache)."""

from __future__ import annotations

from typing import Any

from benchctl.core import data
from benchctl.core.progress import Progress
from benchctl.stages.prepare.options import PrepareOptions


def prepare(opts: PrepareOptions, *, progress: bool | Progress = True) -> Any:
    """The prepared data (instant when the cache already holds it): `data.Prepared` for stories, a procedural task's
    `TaskData` otherwise."""
    if not opts.task.is_stories:
        from benchctl.core import taskdata

        return taskdata.prepare_task(opts.task)
    return data.prepare(opts.data, opts.vocab_size, progress=progress)
