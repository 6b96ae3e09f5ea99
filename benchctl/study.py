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
from benchctl.core import db as dbm
from benchctl.stages.train import tables as train_tables
from benchctl import stages
from benchctl.core.config import RunConfig, make_config, overrides_for
from benchctl.core.errors import Aborted, BenchctlError, ConfigError

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
    from benchctl.stages.train.engine import estimate_seconds, resolve_device

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
    resumed: dict[str, int] = field(default_factory=dict)  # run id -> the checkpoint step it resumed from


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
    execution: Any = None,
) -> TrainAllResult:
    """Train every config not yet done (resuming interrupted ones); a failing run is recorded and the rest go on.

    `variants` names each config (a plan's variant names; architecture names when None) and `plan` (a
    benchctl.plans.Plan) is recorded with every run it reaches, trained now or before, so its report finds them under
    its own names. Before starting, work estimated above an hour needs `yes` or a yes from `confirm` (see
    confirm_long_run). `execution` (a benchctl.stages.train.executors.Execution; None: in this process, one run after another)
    says where the runs train: N local processes at once, or tasks on a Ray cluster."""
    from benchctl.stages.train import executors
    from benchctl.core.config import run_id
    from benchctl.core.runtime import Dist, decide_on_main, init_distributed, resolve_device

    execution = execution or executors.Execution()
    dist_info = Dist.from_env()  # under torchrun: one process group for every run; rank 0 asks and writes
    if dist_info.enabled and not execution.in_process:
        raise ConfigError("under torchrun every process trains each run together; --jobs and --executor ray "
                          "cannot be combined with it (run without torchrun, or with --jobs 1)")
    init_distributed(dist_info, resolve_device(cfgs[0].train.device, dist_info.local_rank))
    db = stages.connect(db_path) if dist_info.is_main else None

    def confirm_on_main() -> None:
        todo = [c for c in cfgs
                if (train_tables.get_run(db, run_id(c, prepared.fingerprint)) or {}).get("status") != "done"]
        if not execution.in_process:  # they run side by side: the wall time is that of the longest share
            todo = todo[: max(1, -(-len(todo) // _parallel_jobs(execution, len(todo), cfgs[0])))]
        confirm_long_run(todo, prepared, yes=yes, log=log, confirm=confirm)

    decide_on_main(dist_info, confirm_on_main)
    result = TrainAllResult()
    names = variants or [c.arch for c in cfgs]
    specs = [executors.RunSpec(i, c, name, run_id(c, prepared.fingerprint))
             for i, (c, name) in enumerate(zip(cfgs, names), 1)]

    def on_outcome(spec: executors.RunSpec, out: executors.Outcome) -> None:
        _record_plan_run(db, plan, spec.variant, spec.cfg, spec.run_id)
        if out.status == "failed":
            result.failed.append((spec.run_id, out.error or "failed"))
            log(f"  failed: {out.error}" if execution.in_process
                else f"  failed: {spec.variant} seed {spec.cfg.seed}: {out.error}")
            return
        (result.skipped if out.status == "skipped" else result.done).append(spec.run_id)
        if out.resumed_from is not None:
            result.resumed[spec.run_id] = out.resumed_from
        if out.status == "skipped":
            log(f"  already done: {spec.run_id}")
        elif not execution.in_process:
            log(f"  done: {spec.variant} seed {spec.cfg.seed} ({spec.run_id})")

    ex = executors.make(execution, prepared=prepared, db_path=db_path, db=db, progress=progress, log=log)
    ex.run(specs, on_outcome)
    return result


def _parallel_jobs(execution: Any, n_runs: int, cfg: RunConfig) -> int:
    """How many runs train at once locally (Ray's count depends on the cluster: estimated as one at a time)."""
    from benchctl.stages.train.executors import plan_slots

    return plan_slots(execution.jobs, n_runs, cfg.train.device).jobs if execution.executor == "local" else 1


def _record_plan_run(db: dbm.Database | None, plan: Any, variant: str, cfg: RunConfig, rid: str) -> None:
    """The plan reached this run under `variant` (once its row exists: a run that failed before starting has none).
    Under torchrun only rank 0 has the database (`db` is None elsewhere)."""
    if plan is None or db is None or train_tables.get_run(db, rid) is None:
        return
    train_tables.record_plan_runs(db, [{"plan": plan.name, "variant": variant, "preset": cfg.preset, "seed": cfg.seed,
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
    jobs: int | str = 1  # runs trained, sampled and evaluated at once on this machine (a number or "auto")
    executor: str = "local"  # local, or ray: every run a task on a Ray cluster
    ray_address: str | None = None  # the cluster to join (None: $RAY_ADDRESS, else a new local instance)
    runs_dir: Path | None = None  # where run directories live (None: beside results.db); shared by every machine
    bench: bool | None = None  # time every model's step (stage bench); None: on for a CPU at tiny/small

    def execution(self) -> Any:
        """The executors.Execution these options describe (validated: a bad --jobs is one clear error)."""
        from benchctl.stages.train.executors import Execution

        return Execution(executor=self.executor, jobs=self.jobs, ray_address=self.ray_address,
                         runs_dir=self.runs_dir)


def _join_group(cfgs: list[RunConfig]) -> Any:
    """Under torchrun, join the one process group every run of the study trains in (before the data is prepared,
    which waits on it); returns the process's Dist."""
    from benchctl.core.runtime import Dist, init_distributed, resolve_device

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
    plan, preset, runs = planned_runs(opts.plan, opts.preset, opts.archs, opts.seeds, opts.overrides)
    opts = replace(opts, preset=preset, seeds=sorted({r.cfg.seed for r in runs}))
    cfgs = [r.cfg for r in runs]
    archs = sorted({c.arch for c in cfgs}, key=lambda a: architectures.names().index(a))
    study = stages.StudyRun(opts=opts, cfgs=cfgs, archs=archs, variants=[r.variant for r in runs], plan=plan,
                            log=log, confirm=confirm)
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
