"""Stage `train`: train every run of the sweep not yet done, resuming interrupted ones.

A failing run is recorded and the others go on; later stages work on the runs that finished. Its report sections
show the runs and their status, the parameter accounting, training cost and validation loss, and, when the models
differ in size or compute, loss against training compute, parameters and training depth, for architectures that
decide their own compute, their auxiliary losses and metrics, and for an IsoFLOP plan's runs the scaling curves."""

from __future__ import annotations

from typing import Any

from benchctl.stages import Stage, StudyRun, weights_read_after
from benchctl.stages.train.options import TrainOptions
from benchctl.stages.train.report import cost_section, loss_section, models_section, runs_section
from benchctl.stages.train.report_adaptive import adaptive_section
from benchctl.stages.train.report_compute import compute_section, depth_section, params_section
from benchctl.stages.train.report_scaling import scaling_section
from benchctl.stages.train.sweep import train_all
from benchctl.stages.train.tables import TABLES, browse_queries

ORDER = 20


def run(study: StudyRun) -> None:
    opts, cfgs = study.opts, study.cfgs
    names = list(dict.fromkeys(study.variants or study.archs))
    plan = f"plan {study.plan.name}: " if study.plan is not None else ""
    study.say(f"{plan}{len(cfgs)} run(s) — {', '.join(names)} × seeds {sorted({c.seed for c in cfgs})}")
    train_opts = TrainOptions(
        yes=opts.yes,
        jobs=opts.jobs,
        executor=opts.executor,
        ray_address=opts.ray_address,
        runs_dir=opts.runs_dir,
        # a study that only trains and reports (e.g. --skip sample,judge,eval,depth,infer) goes on from the runs its
        # results.db has as done even where their checkpoints are not (a database carried to another machine)
        weights_needed=weights_read_after(study, ORDER),
    )
    study.trained = train_all(
        cfgs,
        study.prepared,
        opts.db_path,
        train_opts,
        progress=opts.progress,
        log=study.log,
        confirm=study.confirm,
        variants=study.variants,
        plan=study.plan,
    )


def estimate(study: StudyRun) -> tuple[float, str] | None:
    """The runs not yet done (by their stored configuration), at their shapes' speed here (the estimate `benchctl
    plans show` makes), side by side in the study's local jobs; None when every run is done."""
    from benchctl.stages.train import estimate as est
    from benchctl.stages.train.executors import plan_slots

    opts = study.opts
    preset = str(opts.preset)
    done = est.done_configs(opts.db_path, preset)
    todo = [c for c in study.cfgs if c.to_json() not in done]
    if not todo:
        return None
    jobs, threads = 1, None  # one at a time, in this process: with the threads torch has here
    if opts.executor == "local":
        slots = plan_slots(opts.jobs, len(todo), todo[0].train.device)
        if slots.jobs > 1:  # side by side, each process with its share of the cores
            jobs, threads = slots.jobs, slots.threads
    e = est.estimate(todo, opts.db_path, preset, threads)
    side = f", {jobs} at a time" if jobs > 1 else ""
    return e.total(todo) / jobs, f"{len(todo)} run(s){side}; {e.brief()}"


def summary(study: StudyRun) -> list[str]:
    """Each model's final validation loss, the mean over its seeds with a 95% t-interval from two seeds on, and its
    training time per run (steps, warm-up and evaluations), one line per variant of the study."""
    from benchctl.core.config import run_id
    from benchctl.core.progress import format_duration
    from benchctl.core.stats import mean_ci
    from benchctl.stages.train import tables as train_tables

    names = study.variants or [c.arch for c in study.cfgs]
    fingerprint = getattr(study.prepared, "fingerprint", None)
    done = set(study.run_ids)
    per: dict[str, list[dict[str, Any]]] = {}
    for name, cfg in zip(names, study.cfgs):
        rid = run_id(cfg, fingerprint) if fingerprint is not None else None
        row = train_tables.get_run(study.db, rid) if rid in done else None
        per.setdefault(name, []).append(row or {})
    if not per:
        return []
    width = max(5, *(len(n) for n in per))
    out = [f"{'model':<{width}}  seeds  final val loss (95% CI)     training time (per run)"]
    for name, rows in per.items():
        ok = [r for r in rows if r.get("final_val_loss") is not None]
        ci = mean_ci(r["final_val_loss"] for r in ok)
        if ci.mean is None:
            loss = "not trained"
        elif ci.lo is None or ci.hi is None:
            loss = f"{ci.mean:.3f}"
        else:
            loss = f"{ci.mean:.3f} ({ci.lo:.3f} to {ci.hi:.3f})"
        secs = [sum(float(r.get(k) or 0.0) for k in ("train_seconds", "warmup_seconds", "eval_seconds")) for r in ok]
        train = format_duration(sum(secs) / len(secs)) if secs else "-"
        out.append(f"{name:<{width}}  {f'{len(ok)}/{len(rows)}':>5}  {loss:<26}  {train}")
    return out


STAGE = Stage(
    name="train",
    order=ORDER,
    run=run,
    estimate=estimate,
    summary=summary,
    tables=TABLES,
    queries=browse_queries,
    sections=(
        runs_section,
        models_section,
        cost_section,
        loss_section,
        compute_section,
        params_section,
        depth_section,
        adaptive_section,
        scaling_section,
    ),
    every_rank=True,
    figures=(
        "training_time.png",
        "peak_memory.png",
        "final_val_loss.png",
        "val_loss_curves.png",
        "loss_vs_compute.png",
        "loss_vs_params.png",
        "loss_vs_depth.png",
        "adaptive_metrics.png",
        "isoflop.png",
    ),
)
