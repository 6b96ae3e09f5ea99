"""Training a sweep: every run of a list of configs not yet done, through an executor, asking first when it is long.

`sweep` is the (architecture x seed) grid of `benchctl train-all`; a plan's runs come from `benchctl.plans`. Every run
has a stable id from its config and data, so `train_all` skips finished runs and resumes interrupted ones; a failing
run is recorded and the others go on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import architectures
from benchctl import plans, stages
from benchctl.core import db as dbm
from benchctl.core.config import RunConfig, make_config, overrides_for, run_id
from benchctl.core.errors import ConfigError
from benchctl.core.progress import CONFIRM_ABOVE_SECONDS, confirm_long
from benchctl.core.runtime import Dist, decide_on_main, init_distributed, resolve_device
from benchctl.stages import TrainAllResult
from benchctl.stages.train import engine, executors
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.executors.local import InProcess, ProcessPool
from benchctl.stages.train.executors.ray import RayExecutor
from benchctl.stages.train.options import TrainOptions


def sweep(
    preset: str, archs: list[str] | None, seeds: list[int] | None, overrides: dict[str, Any] | None = None
) -> list[RunConfig]:
    """The (architecture x seed) grid, architectures in registry order."""
    names = archs or architectures.names()
    return [make_config(preset, a, s, overrides_for(a, overrides, names)) for s in (seeds or [0]) for a in names]


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
    est = engine.estimate_seconds(cfgs, prepared)
    if est <= CONFIRM_ABOVE_SECONDS:
        return
    device = engine.resolve_device(cfgs[0].train.device)
    what = f"{len(cfgs)} run(s) of preset '{cfgs[0].preset}'"
    hint = " (try --preset small on a CPU)" if device.type == "cpu" and cfgs[0].preset != "small" else ""
    confirm_long(est, what, yes=False, confirm=confirm, hint=f" on this {device.type.upper()}{hint}")


def train_all(
    cfgs: list[RunConfig],
    prepared: Any,
    db_path: Path,
    opts: TrainOptions | None = None,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    confirm: Callable[[str], bool] | None = None,
    variants: list[str] | None = None,
    plan: Any = None,
) -> TrainAllResult:
    """Train every config not yet done (resuming interrupted ones); a failing run is recorded and the rest go on.

    `variants` names each config (a plan's variant names; architecture names when None) and `plan` (a
    benchctl.plans.Plan) is recorded with every run it reaches, trained now or before, so its report finds them under
    its own names. Before starting, work estimated above an hour needs `opts.yes` or a yes from `confirm` (see
    confirm_long_run). `opts` (None: the defaults, in this process, one run after another) also says where the runs
    train: N local processes at once, or tasks on a Ray cluster."""
    opts = opts or TrainOptions()
    if getattr(plan, "isoflop", None) is not None:  # an IsoFLOP plan refuses runs beyond its max_epochs
        named = variants or [c.arch for c in cfgs]
        plans.check_epochs(plan, [plans.PlannedRun(v, c) for v, c in zip(named, cfgs)], prepared.n_train_tokens)
    execution = opts.execution
    dist_info = Dist.from_env()  # under torchrun: one process group for every run; rank 0 asks and writes
    if dist_info.enabled and not execution.in_process:
        raise ConfigError(
            "under torchrun every process trains each run together; --jobs and --executor ray "
            "cannot be combined with it (run without torchrun, or with --jobs 1)"
        )
    init_distributed(dist_info, resolve_device(cfgs[0].train.device, dist_info.local_rank))
    db = stages.connect(db_path) if dist_info.is_main else None

    def confirm_on_main() -> None:
        todo = [
            c for c in cfgs if (train_tables.get_run(db, run_id(c, prepared.fingerprint)) or {}).get("status") != "done"
        ]
        if not execution.in_process:  # they run side by side: the wall time is that of the longest share
            todo = todo[: max(1, -(-len(todo) // _parallel_jobs(execution, len(todo), cfgs[0])))]
        confirm_long_run(todo, prepared, yes=opts.yes, log=log, confirm=confirm)

    decide_on_main(dist_info, confirm_on_main)
    result = TrainAllResult()
    names = variants or [c.arch for c in cfgs]
    specs = [
        executors.RunSpec(i, c, name, run_id(c, prepared.fingerprint), of=len(cfgs))
        for i, (c, name) in enumerate(zip(cfgs, names), 1)
    ]

    def on_outcome(spec: executors.RunSpec, out: executors.Outcome) -> None:
        _record_plan_run(db, plan, spec.variant, spec.cfg, spec.run_id)
        if out.status == "failed":
            result.failed.append((spec.run_id, out.error or "failed"))
            log(
                f"  failed: {out.error}"
                if execution.in_process
                else f"  failed: {spec.variant} seed {spec.cfg.seed}: {out.error}"
            )
            return
        (result.skipped if out.status == "skipped" else result.done).append(spec.run_id)
        if out.resumed_from is not None:
            result.resumed[spec.run_id] = out.resumed_from
        if out.status == "skipped":
            log(f"  already done: {spec.run_id}")
        elif not execution.in_process:
            log(f"  done: {spec.variant} seed {spec.cfg.seed} ({spec.run_id})")

    ex = make_executor(execution, prepared=prepared, db_path=db_path, db=db, progress=progress, log=log)
    ex.run(specs, on_outcome)
    return result


def make_executor(
    execution: executors.Execution, *, prepared: Any, db_path: Path, db: Any, progress: Any, log: Callable[[str], None]
) -> executors.Executor:
    """The executor `execution` names, ready to run specs (`db` is the driver's results.db handle; None on the
    non-main ranks of torchrun)."""
    if execution.executor == "ray":
        return RayExecutor(execution, prepared=prepared, db_path=db_path, db=db, log=log)
    if execution.in_process:
        return InProcess(
            prepared=prepared,
            db_path=db_path,
            db=db,
            progress=progress,
            log=log,
            runs_dir=execution.runs_dir,
            weights_needed=execution.weights_needed,
        )
    return ProcessPool(execution, prepared=prepared, db_path=db_path, db=db, progress=progress, log=log)


def _parallel_jobs(execution: executors.Execution, n_runs: int, cfg: RunConfig) -> int:
    """How many runs train at once locally (Ray's count depends on the cluster: estimated as one at a time)."""
    return executors.plan_slots(execution.jobs, n_runs, cfg.train.device).jobs if execution.executor == "local" else 1


def _record_plan_run(db: dbm.Database | None, plan: Any, variant: str, cfg: RunConfig, rid: str) -> None:
    """The plan reached this run under `variant` (once its row exists: a run that failed before starting has none).
    Under torchrun only rank 0 has the database (`db` is None elsewhere)."""
    if plan is None or db is None or train_tables.get_run(db, rid) is None:
        return
    point = next((v.point for v in plan.variants if v.name == variant), None)
    train_tables.record_plan_runs(
        db,
        [
            {
                "plan": plan.name,
                "variant": variant,
                "preset": cfg.preset,
                "seed": cfg.seed,
                "run_id": rid,
                "plan_path": str(plan.path),
                "plan_sha256": plan.sha256,
                "isoflop_arch": None if point is None else point.arch_name,
                "isoflop_width": None if point is None else point.width,
                "isoflop_budget": None if point is None else point.budget,
            }
        ],
    )
