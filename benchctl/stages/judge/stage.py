"""Stage `judge`: a judge model (Gemini, or any OpenAI-compatible server) grades the stored samples; skipped, with a
note on how to run it later, when the judge needs an API key and none is set. Its report sections show the grades
per criterion beside the study's, and how far the judge can be trusted (agreement between repeats and judges, length
bias, failure rates)."""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only
from benchctl.stages.judge import judges
from benchctl.stages.judge.options import JudgeOptions
from benchctl.stages.judge.reliability import reliability_section
from benchctl.stages.judge.report import judge_section
from benchctl.stages.judge.tables import TABLES, browse_queries


def run(study: StudyRun) -> None:
    opts, ids = study.opts, study.run_ids
    if study.skips("judge") or not ids:
        study.say("skipped")
        return
    if story_only(study):
        return
    spec = judges.resolve(opts.judge_model)
    if not judges.has_key(spec):
        keys = "GEMINI_API_KEY (or GOOGLE_API_KEY)" if spec.backend == "gemini" else "OPENAI_API_KEY"
        study.say(
            f"skipped — no {keys} set; set one and rerun "
            f"'benchctl study' (or 'benchctl judge --model {opts.judge_model}') to grade the stories"
        )
    else:
        # the SDKs, seconds to load: kept out of 'benchctl report' (which loads every stage for its report sections)
        # and out of a study without a key
        from benchctl.stages.judge import api as judge

        study.say(f"grading with {opts.judge_model}")
        js = judge.judge_all(
            study.db,
            JudgeOptions(
                select=RunSelection(run_ids=ids), judge_model=opts.judge_model, concurrency=opts.judge_concurrency
            ),
            progress=opts.progress,
        )
        study.log(f"   {js.n_ok} graded, {js.n_failed} failed, {js.n_cached} already graded")


STAGE = Stage(
    name="judge",
    order=40,
    run=run,
    tables=TABLES,
    queries=browse_queries,
    sections=(judge_section, reliability_section),
    figures=("judge_grades.png",),
    skippable=True,
)
