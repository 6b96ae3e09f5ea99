"""Stage `prepare`: fetch and tokenize the data every run of the study trains on (cached after the first time)."""

from __future__ import annotations

from benchctl.stages import Stage, StudyRun


def run(study: StudyRun) -> None:
    from benchctl import data

    first = study.cfgs[0]
    study.say(f"data source {first.data.source!r}, vocab {first.model.vocab_size}")
    study.prepared = data.prepare(first.data, first.model.vocab_size, progress=study.opts.progress)


STAGE = Stage(name="prepare", order=10, run=run)
