"""Stage `prepare`: fetch and tokenize the data every run of the study trains on (cached after the first time)."""

from __future__ import annotations

from benchctl.core.errors import ConfigError
from benchctl.core.runtime import Dist, main_first
from benchctl.stages import Stage, StudyRun
from benchctl.stages.prepare import engine
from benchctl.stages.prepare.options import PrepareOptions


def run(study: StudyRun) -> None:
    first = study.cfgs[0]
    names = sorted({c.task.name for c in study.cfgs})
    if len(names) > 1:  # every run of a study reads one prepared data set, as they read one corpus
        raise ConfigError(f"a study trains one task at a time; this one mixes {', '.join(names)}")
    if first.task.is_stories:
        study.say(f"data source {first.data.source!r}, vocab {first.model.vocab_size}")
    else:
        study.say(f"task {first.task.name}: problems generated as training goes, vocab {first.model.vocab_size}")
    dist_info = Dist.from_env()  # under torchrun rank 0 fills the cache, then the other ranks read it
    opts = PrepareOptions(data=first.data, vocab_size=first.model.vocab_size, task=first.task)
    study.prepared = main_first(
        dist_info, lambda: engine.prepare(opts, progress=study.opts.progress and dist_info.is_main)
    )


STAGE = Stage(name="prepare", order=10, run=run, every_rank=True)
