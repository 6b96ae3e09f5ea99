"""Stage `sample`: story completions from the fixed prompt set for every finished run (the judge grades them)."""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only, unless_skipped
from benchctl.stages.sample import engine as sample
from benchctl.stages.sample.options import SampleOptions, study_n_prompts
from benchctl.stages.sample.tables import TABLES


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("sample") or not ids:
        study.say("skipped" + ("" if ids else " (no finished runs)"))
        return
    if story_only(study):
        return
    study.say("story completions from the fixed prompt set")
    opts = SampleOptions(
        select=RunSelection(run_ids=ids),
        n_prompts=study_n_prompts(study.opts.preset, study.opts.n_prompts),
        jobs=study.opts.jobs,
    )
    s = sample.sample_all(study.db, study.opts.db_path, opts, progress=study.opts.progress)
    study.log(f"   {s.generated} new sample(s), {s.skipped} already stored")


STAGE = Stage(name="sample", order=30, run=run, tables=TABLES, skippable=True, reads_weights=unless_skipped("sample"))
