"""Stage `eval`: lm-eval tasks (the bundled ones unless the study names others) on every finished run; at the tiny
preset, a smoke run, on the first few documents of each task (`study_limit`)."""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only, unless_skipped
from benchctl.stages.eval.options import EvalOptions, study_limit
from benchctl.stages.eval.report import eval_section
from benchctl.stages.eval.tables import TABLES, browse_queries


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("eval") or not ids:
        study.say("skipped")
        return
    if story_only(study):
        return
    # lm_eval: kept out of 'benchctl report', which loads every stage for its report sections
    from benchctl.stages.eval import api as evaluate

    study.say("lm-eval tasks on every finished run")
    opts = EvalOptions(
        select=RunSelection(run_ids=ids),
        tasks=study.opts.eval_tasks,
        jobs=study.opts.jobs,
        limit=study_limit(study.opts.preset),
    )
    evaluate.evaluate_runs(study.db, study.opts.db_path, opts, progress=study.opts.progress, log=study.log)


STAGE = Stage(
    name="eval",
    order=50,
    run=run,
    tables=TABLES,
    queries=browse_queries,
    sections=(eval_section,),
    skippable=True,
    reads_weights=unless_skipped("eval"),
)
