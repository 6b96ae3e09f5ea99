"""Stage `sample`: story completions from the fixed prompt set for every finished run (the judge grades them)."""

from __future__ import annotations

from benchctl.stages import Stage, StudyRun
from benchctl.stages.sample import engine as sample


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("sample") or not ids:
        study.say("skipped" + ("" if ids else " (no finished runs)"))
        return
    study.say("story completions from the fixed prompt set")
    kw = {"n_prompts": study.opts.n_prompts} if study.opts.n_prompts else {}
    s = sample.sample_all(study.db, study.opts.db_path, run_ids=ids, progress=study.opts.progress,
                          jobs=study.opts.jobs, **kw)
    study.log(f"   {s.generated} new sample(s), {s.skipped} already stored")


STAGE = Stage(name="sample", order=30, run=run, skippable=True)
