"""Stage `report`: write report.md and its figures from the database, always last.

Its own sections close the report: comparisons between models (which draw on the train and judge stages),
benchmark rows from `benchctl bench`, and the provenance of every run."""

from __future__ import annotations

from benchctl.stages import Stage, StudyRun
from benchctl.stages.report import engine
from benchctl.stages.report.fair import fair_section, plan_section
from benchctl.stages.report.options import ReportOptions
from benchctl.stages.report.summary import bench_section, comparisons_section, provenance_section


def run(study: StudyRun) -> None:
    study.say(f"{study.opts.out_dir}")
    opts = ReportOptions(
        out_dir=study.opts.out_dir, preset=study.opts.preset, plan=study.plan.name if study.plan is not None else None
    )
    study.report_path = engine.run(study.opts.db_path, opts)[1]


STAGE = Stage(
    name="report",
    order=100,
    run=run,
    sections=(comparisons_section, fair_section, bench_section, provenance_section, plan_section),
)
