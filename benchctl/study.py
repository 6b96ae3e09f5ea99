"""The pipeline: the registered stages (benchctl.stages) in order, by default prepare -> train-all -> sample ->
judge -> eval -> report, each stage resumable.

A sweep is data: a plan (benchctl.plans; `study` by default, the published study's four models) resolved at a preset
and seeds gives the list of (variant name, run config), seed being one axis; `sweep(preset, archs, seeds, overrides)`
is the same without names, one config per architecture. Every run has a stable id from its config and data (the
variant name is only a label), so rerunning any stage skips what is done and resumes what is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import architectures
from benchctl import db as dbm
from benchctl import stages
from benchctl.config import RunConfig, make_config, overrides_for
from benchctl.errors import Aborted, BenchctlError

# Ask before starting work estimated to take longer than this on the current device.
CONFIRM_ABOVE_SECONDS = 3600.0


def sweep(
    preset: str, archs: list[str] | None, seeds: list[int] | None, overrides: dict[str, Any] | None = None
) -> list[RunConfig]:
    """The (architecture x seed) grid, architectures in registry order."""
    names = archs or architectures.names()
    return [make_config(preset, a, s, overrides_for(a, overrides, names)) for s in (seeds or [0]) for a in names]


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def confirm_long_run(
    cfgs: list[RunConfig],
    prepared: Any,
    *,
    yes: bool,
    log: Callable[[str], None],
    is_main: bool = True,
    confirm: Callable[[str], bool] | None = None,
) -> None:
    """Estimate the wall time of `cfgs` on this device; above an hour, ask through `confirm` (a question in, yes
    or no out), or, when there is no one to ask (confirm=None), refuse unless --yes was given."""
    if yes or not cfgs or not is_main:
        return
    from benchctl.train import estimate_seconds, resolve_device

    est = estimate_seconds(cfgs, prepared)
    if est <= CONFIRM_ABOVE_SECONDS:
        return
    device = resolve_device(cfgs[0].train.device)
    what = f"{len(cfgs)} run(s) of preset '{cfgs[0].preset}'"
    hint = " (try --preset small on a CPU)" if device.type == "cpu" and cfgs[0].preset != "small" else ""
    msg = f"{what} would take about {format_duration(est)} on this {device.type.upper()}{hint}"
    if confirm is None:
        raise Aborted(f"{msg}; pass --yes to start anyway")
    if not confirm(f"{msg}. Start?"):
        raise Aborted("not started")


@dataclass
class TrainAllResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def train_all(
    cfgs: list[RunConfig],
    prepared: Any,
    db_path: Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    yes: bool = False,
    confirm: Callable[[str], bool] | None = None,
    variants: list[str] | None = None,
    plan: Any = None,
) -> TrainAllResult:
    """Train every config not yet done (resuming interrupted ones); a failing run is recorded and the rest go on.

    `variants` names each config (a plan's variant names; architecture names when None) and `plan` (a
    benchctl.plans.Plan) is recorded with every run it reaches, trained now or before, so its report finds them under
    its own names. Before starting, work estimated above an hour needs `yes` or a yes from `confirm` (see
    confirm_long_run)."""
    from benchctl.config import run_id
    from benchctl.train import train_run

    from benchctl.runtime import Dist, decide_on_main, init_distributed, resolve_device

    dist_info = Dist.from_env()  # under torchrun: one process group for every run; rank 0 asks and writes
    init_distributed(dist_info, resolve_device(cfgs[0].train.device, dist_info.local_rank))
    db = dbm.connect(db_path) if dist_info.is_main else None

    def confirm_on_main() -> None:
        todo = [c for c in cfgs if (dbm.get_run(db, run_id(c, prepared.fingerprint)) or {}).get("status") != "done"]
        confirm_long_run(todo, prepared, yes=yes, log=log, confirm=confirm)

    decide_on_main(dist_info, confirm_on_main)
    result = TrainAllResult()
    names = variants or [c.arch for c in cfgs]
    for i, (c, name) in enumerate(zip(cfgs, names), 1):
        log(f"[{i}/{len(cfgs)}] {name} seed {c.seed} (preset {c.preset})")
        rid = run_id(c, prepared.fingerprint)
        try:
            r = train_run(c, prepared, db, db_path, progress=progress, log=log, variant=name)
        except BenchctlError as e:
            _record_plan_run(db, plan, name, c, rid)
            result.failed.append((rid, str(e)))
            log(f"  failed: {e}")
            continue
        _record_plan_run(db, plan, name, c, rid)
        (result.skipped if r.skipped else result.done).append(r.run_id)
        if r.skipped:
            log(f"  already done: {r.run_id}")
    return result


def _record_plan_run(db: dbm.Database, plan: Any, variant: str, cfg: RunConfig, rid: str) -> None:
    """The plan reached this run under `variant` (once its row exists: a run that failed before starting has none)."""
    if plan is None or dbm.get_run(db, rid) is None:
        return
    dbm.record_plan_runs(db, [{"plan": plan.name, "variant": variant, "preset": cfg.preset, "seed": cfg.seed,
                               "run_id": rid, "plan_path": str(plan.path), "plan_sha256": plan.sha256}])


def planned_runs(
    plan_name: str, preset: str | None, archs: list[str] | None, seeds: list[int] | None,
    overrides: dict[str, Any] | None = None,
) -> tuple[Any, str, list[Any]]:
    """(plan, preset, runs): the plan by name or path, the preset (given, else the plan's, else paper) and every
    (variant, config) at the seeds (given, else the plan's, else 0, 1, 2), all validated before anything runs."""
    from benchctl import plans

    plan = plans.load(plan_name)
    preset = preset or plan.preset or "paper"
    seeds = seeds or list(plan.seeds or plans.DEFAULT_SEEDS)
    return plan, preset, plans.resolve(plan, preset, seeds, overrides, archs)


@dataclass
class StudyOptions:
    """Everything `benchctl study` decides, in one place (the CLI fills it; tests build it directly)."""

    preset: str | None = None  # None: the plan's preset, else paper
    plan: str = "study"  # a built-in plan's name or a plan file's path
    archs: list[str] | None = None  # keep only the plan's variants of these architectures
    seeds: list[int] | None = None  # None: the plan's seeds, else 0, 1, 2
    overrides: dict[str, Any] = field(default_factory=dict)
    db_path: Path = field(default_factory=dbm.default_path)
    out_dir: Path = Path("reports")
    judge_model: str = "gemini-2.5-flash"
    judge_concurrency: int = 8
    n_prompts: int | None = None  # None: sample.py's default
    eval_tasks: list[str] | None = None  # None: the bundled tasks
    skip: tuple[str, ...] = ()  # names of skippable stages to leave out (sample, judge, eval)
    yes: bool = False
    progress: bool = True
    bench: bool | None = None  # time every model's step (stage bench); None: on for a CPU at tiny/small


def run_study(
    opts: StudyOptions, log: Callable[[str], None] = print, confirm: Callable[[str], bool] | None = None
) -> Path:
    """Run every registered stage in order (prepare -> train -> sample -> judge -> eval -> report by default);
    each stage is resumable, so rerunning the study picks up where it stopped.

    Returns the report path. A failed training run does not stop the study: later stages use the runs that
    finished, the report lists the failure, and the caller is told (BenchctlError at the end). `confirm` asks the
    user before long training (None: long training needs opts.yes).
    """
    plan, preset, runs = planned_runs(opts.plan, opts.preset, opts.archs, opts.seeds, opts.overrides)
    opts = replace(opts, preset=preset, seeds=sorted({r.cfg.seed for r in runs}))
    cfgs = [r.cfg for r in runs]
    archs = sorted({c.arch for c in cfgs}, key=lambda a: architectures.names().index(a))
    study = stages.StudyRun(opts=opts, cfgs=cfgs, archs=archs, variants=[r.variant for r in runs], plan=plan,
                            log=log, confirm=confirm)
    todo = [s for s in stages.registered() if s.run is not None]
    for i, stage in enumerate(todo, 1):
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
