"""Stage `retrofit`: a plan's conversions, after its other variants are trained, and the report's Retrofit section.

A plan variant with `from = "<variant>"` is a conversion (benchctl.plans): at each seed, once that seed's parent is
trained, its weights are converted and the converted model is trained ("healed") through the same code as `benchctl
retrofit`, so the run records its parent, init method and the parent's cost, resumes from its checkpoint after a
kill and is skipped once done. Conversion runs join the study's trained runs, so sampling, judging and evaluation
treat them like the rest. A plan without conversions has nothing to do here; runs made with `benchctl retrofit` show
in the section all the same: loss after conversion per init method, and compute (parent included) against training
the same architecture from scratch.
"""

from __future__ import annotations

from typing import Any

from benchctl import plans
from benchctl.core.config import run_id
from benchctl.core.errors import BenchctlError
from benchctl.stages import Stage, StudyRun, TrainAllResult
from benchctl.stages.retrofit import engine as rf
from benchctl.stages.retrofit.report import FIGURE, retrofit_section
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.sweep import confirm_long_run


def conversions(study: StudyRun) -> list[Any]:
    """The study plan's conversions (none without a plan)."""
    opts = study.opts
    if study.plan is None:
        return []
    return plans.conversions(study.plan, opts.preset, list(opts.seeds or [0]), opts.overrides, opts.archs)


def run(study: StudyRun) -> None:
    convs = conversions(study)
    if not convs:
        study.say("no conversions in this plan")
        return
    if study.trained is None:
        study.trained = TrainAllResult()
    names = list(dict.fromkeys(c.variant for c in convs))
    study.say(
        f"plan {study.plan.name}: {len(convs)} conversion(s) — {', '.join(names)} × seeds "
        f"{sorted({c.cfg.seed for c in convs})}"
    )
    jobs = _jobs(study, convs)
    _confirm(study, [job for _, job in jobs])
    for i, (conv, job) in enumerate(jobs, 1):
        study.log(f"[{i}/{len(jobs)}] {conv.variant} seed {conv.cfg.seed} from {conv.parent} ({job.method})")
        _convert_and_train(study, conv, job)


def _jobs(study: StudyRun, convs: list[Any]) -> list[tuple[Any, Any]]:
    """Each conversion with its parent's finished run attached; one whose parent did not finish training is a
    failure of its own (the study goes on and reports it), since there are no weights to convert."""
    fingerprint = study.prepared.fingerprint
    out = []
    for conv in convs:
        pid = run_id(conv.parent_cfg, fingerprint)
        parent = train_tables.get_run(study.db, pid)
        if parent is None or parent["status"] != "done":
            rid = run_id(rf.with_parent(conv.cfg, pid, conv.init, conv.lora_init), fingerprint)
            status = "not trained" if parent is None else parent["status"]
            study.trained.failed.append(
                (
                    rid,
                    f"{conv.variant} seed {conv.cfg.seed}: its parent {conv.parent} "
                    f"({pid}) is {status}, so there is nothing to convert",
                )
            )
            study.log(f"  {conv.variant} seed {conv.cfg.seed}: parent {pid} is {status}; not converted")
            continue
        out.append((conv, rf.attach(conv.cfg, parent, conv.init, conv.lora_init)))
    return out


def _confirm(study: StudyRun, jobs: list[Any]) -> None:
    """Ask before long healing as the train stage asks before long training (only the runs not done yet count)."""
    fingerprint = study.prepared.fingerprint
    todo = [
        j.cfg
        for j in jobs
        if (train_tables.get_run(study.db, run_id(j.cfg, fingerprint)) or {}).get("status") != "done"
    ]
    confirm_long_run(todo, study.prepared, yes=study.opts.yes, log=study.log, confirm=study.confirm)


def _convert_and_train(study: StudyRun, conv: Any, job: Any) -> None:
    opts, trained = study.opts, study.trained
    rid = run_id(job.cfg, study.prepared.fingerprint)
    try:
        r = rf.run(
            job, study.prepared, study.db, opts.db_path, progress=opts.progress, log=study.log, variant=conv.variant
        )
    except BenchctlError as e:
        trained.failed.append((rid, str(e)))
        study.log(f"  failed: {e}")
    else:
        (trained.skipped if r.skipped else trained.done).append(r.run_id)
        if r.skipped:
            study.log(f"  already done: {r.run_id}")
    if train_tables.get_run(study.db, rid) is not None:  # a run that failed before starting has no row to point at
        plan = study.plan
        train_tables.record_plan_runs(
            study.db,
            [
                {
                    "plan": plan.name,
                    "variant": conv.variant,
                    "preset": job.cfg.preset,
                    "seed": job.cfg.seed,
                    "run_id": rid,
                    "plan_path": str(plan.path),
                    "plan_sha256": plan.sha256,
                }
            ],
        )


STAGE = Stage(
    name="retrofit",
    order=25,
    run=run,
    sections=(retrofit_section,),
    figures=(FIGURE,),
    reads_weights=lambda study: bool(conversions(study)),  # a conversion starts from its parent's weights
)
