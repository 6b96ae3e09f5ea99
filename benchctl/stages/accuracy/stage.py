"""Stage `accuracy`: exact-match accuracy of every finished reasoning-task run, per difficulty level and test-time
depth (see `benchctl.stages.accuracy.engine`). A TinyStories study has nothing to score here and says so in one line;
its measures are the eval, depth and judge stages."""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun
from benchctl.stages.accuracy import engine
from benchctl.stages.accuracy.options import AccuracyOptions
from benchctl.stages.accuracy.report import FIGURES, accuracy_section
from benchctl.stages.accuracy.tables import TABLES, browse_queries


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("accuracy") or not ids:
        study.say("skipped" + ("" if ids else " (no finished runs)"))
        return
    if study.cfgs[0].task.is_stories:
        study.say("skipped: scores reasoning-task runs, and this study trains on TinyStories")
        return
    study.say("exact match on held-out problems per difficulty level and test-time depth")
    opts = AccuracyOptions(select=RunSelection(run_ids=ids))
    s = engine.accuracy_all(study.db, study.opts.db_path, opts, progress=study.opts.progress)
    study.log(f"   {len(s.rows)} row(s) measured, {s.skipped} already stored")


STAGE = Stage(
    name="accuracy",
    order=52,
    run=run,
    tables=TABLES,
    queries=browse_queries,
    sections=(accuracy_section,),
    figures=FIGURES,
    skippable=True,
    # it loads the trained runs' weights only in a study on a reasoning task (a TinyStories study has none to score)
    reads_weights=lambda study: not study.skips("accuracy") and bool(study.cfgs) and not study.cfgs[0].task.is_stories,
)
