"""The pipeline: the registered stages (benchctl.stages) in order, by default prepare -> train-all -> sample ->
judge -> eval -> report, each stage resumable.

A sweep is data: a plan (benchctl.plans; `study` by default, the published study's four models) resolved at a preset
and seeds gives the list of (variant name, run config), seed being one axis. Every run has a stable id from its config
and data (the variant name is only a label), so rerunning any stage skips what is done and resumes what is not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import architectures
from benchctl import plans, stages
from benchctl.core.config import RunConfig
from benchctl.core.errors import BenchctlError
from benchctl.core.progress import format_duration
from benchctl.core.runtime import Dist, init_distributed, resolve_device
from benchctl.stages import StudyOptions, StudyRun


def _join_group(cfgs: list[RunConfig]) -> Any:
    """Under torchrun, join the one process group every run of the study trains in (before the data is prepared,
    which waits on it); returns the process's Dist."""
    dist_info = Dist.from_env()
    if dist_info.enabled and cfgs:
        init_distributed(dist_info, resolve_device(cfgs[0].train.device, dist_info.local_rank))
    return dist_info


def run_study(
    opts: StudyOptions, log: Callable[[str], None] = print, confirm: Callable[[str], bool] | None = None
) -> Path | None:
    """Run every registered stage in order (prepare -> train -> sample -> judge -> eval -> report by default);
    each stage is resumable, so rerunning the study picks up where it stopped.

    Returns the report path (None on the ranks other than 0 under torchrun: they train, then stop). A failed
    training run does not stop the study: later stages use the runs that finished, the report lists the failure,
    and the caller is told (BenchctlError at the end). `confirm` asks the user before long training (None: long
    training needs opts.yes).
    """
    start = _clock()
    opts.execution()  # a bad --jobs or --executor fails before any stage runs
    plan, preset, runs = plans.planned_runs(opts.plan, opts.preset, opts.archs, opts.seeds, opts.overrides)
    opts = replace(opts, preset=preset, seeds=sorted({r.cfg.seed for r in runs}))
    cfgs = [r.cfg for r in runs]
    archs = sorted({c.arch for c in cfgs}, key=lambda a: architectures.names().index(a))
    study = stages.StudyRun(
        opts=opts, cfgs=cfgs, archs=archs, variants=[r.variant for r in runs], plan=plan, log=log, confirm=confirm
    )
    todo = [s for s in stages.registered() if s.run is not None]
    dist_info = _join_group(cfgs)
    etas = _estimates(study, todo) if dist_info.is_main else {}
    for i, stage in enumerate(todo, 1):
        if not dist_info.is_main and not stage.every_rank:
            return None  # rank 0 alone samples, evaluates and reports; this rank's part (training) is done
        study.heading = f"{i}/{len(todo)} {stage.name}"
        study.eta = etas.get(stage.name)
        before = _clock()
        assert stage.run is not None
        stage.run(study)
        after = _clock()
        study.times.append((stage.name, after[0] - before[0], after[1] - before[1]))
    study.eta = None
    end = _clock()
    for line in summary(study, todo, end[0] - start[0], end[1] - start[1]):
        log(line)
    failed = study.trained.failed if study.trained is not None else []
    if failed:
        raise BenchctlError(
            f"report written to {study.report_path}, but {len(failed)} training run(s) failed: "
            + "; ".join(f"{rid}: {err}" for rid, err in failed)
            + " — rerun 'benchctl study' with the same options to retry them"
        )
    if study.report_path is None:
        raise BenchctlError("the study ran no report stage, so there is no report to show")
    return study.report_path


def _clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds): the CPU time of this process and of the child processes it has waited for (the
    runs and shares that --jobs trains and evaluates elsewhere), user and system."""
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system


def _estimates(study: StudyRun, todo: list[stages.Stage]) -> dict[str, float]:
    """Ask every stage that can tell for the time its work will take, print what they said, and return it (stage ->
    seconds): the study's estimate before its first stage runs. The stages that work on trained runs cannot tell
    before the runs exist; their progress shows how far they are as they go."""
    said = {s.name: s.estimate(study) for s in todo if s.estimate is not None}
    found = {name: e for name, e in said.items() if e is not None}
    if found:
        total = sum(secs for secs, _ in found.values())
        parts = "; ".join(f"{name} about {format_duration(secs)} ({how})" for name, (secs, how) in found.items())
        study.log(f"estimate: {parts}; the later stages show their progress as they go")
        if len(found) > 1:
            study.log(f"   about {format_duration(total)} in all for these stages")
    return {name: secs for name, (secs, _) in found.items()}


def summary(study: StudyRun, todo: list[stages.Stage], wall: float, cpu: float) -> list[str]:
    """The study's closing lines: what its stages say of their results (training: each model's final validation loss
    and training time), the time taken (in all and per stage), where the report and results.db are, and the commands
    that go on from here."""
    from benchctl.core import db as dbm

    opts = study.opts
    out = ["== summary"]
    for stage in todo:
        out += [f"   {line}" for line in (stage.summary(study) if stage.summary is not None else [])]
    out.append(f"   time: {format_duration(wall)} wall, {format_duration(cpu)} CPU")
    # the stages that did something; CPU time is what a shared machine's load does not change
    stage_times = "; ".join(f"{n} {format_duration(w)}, {format_duration(c)}" for n, w, c in study.times if w >= 0.5)
    out.append(f"   stages (wall, CPU): {stage_times}")
    out.append(f"   report: {study.report_path}" if study.report_path is not None else "   report: none written")
    out.append(f"   database: {opts.db_path}")
    db = "" if Path(opts.db_path) == dbm.default_path() else f" --db {opts.db_path}"
    report = f" --out {opts.out_dir}" if Path(opts.out_dir) != Path("reports") else ""
    plan = f" --plan {study.plan.name}" if study.plan is not None else ""
    out += [
        "   next:",
        f"     benchctl runs{db}    (the runs, their timings and status)",
        f"     benchctl report{db}{report} --preset {opts.preset}{plan}"
        "    (the report again, e.g. after 'benchctl judge')",
        f"     benchctl browse{db}    (results.db in Datasette, every table and query)",
    ]
    return out
