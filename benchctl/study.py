"""The pipeline: the registered stages (benchctl.stages) in order, by default prepare -> train-all -> sample ->
judge -> eval -> report, each stage resumable.

A sweep is data: a plan (benchctl.plans; `study` by default, the published study's four models) resolved at a preset
and seeds gives the list of (variant name, run config), seed being one axis. Every run has a stable id from its config
and data (the variant name is only a label), so rerunning any stage skips what is done and resumes what is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import architectures
from benchctl import plans, stages
from benchctl.core.config import RunConfig
from benchctl.core.errors import BenchctlError
from benchctl.core.runtime import Dist, init_distributed, resolve_device
from benchctl.stages import StudyOptions


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
    for i, stage in enumerate(todo, 1):
        if not dist_info.is_main and not stage.every_rank:
            return None  # rank 0 alone samples, evaluates and reports; this rank's part (training) is done
        study.heading = f"{i}/{len(todo)} {stage.name}"
        stage.run(study)
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
