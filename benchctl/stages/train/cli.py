"""`benchctl train`, `benchctl train-all` and `benchctl runs`."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from benchctl import plans
from benchctl.core.config import make_config, run_id
from benchctl.core.errors import BenchctlError, ConfigError
from benchctl.stages.cli import (
    DataOpt,
    DbOpt,
    PresetOpt,
    ProgressOpt,
    SetOpt,
    TaskOpt,
    YesOpt,
    console,
    db_path_of,
    make_progress,
    overrides_with_data,
    parse_seeds,
    split_list,
    terminal_confirm,
)
from benchctl.stages.train.options import TrainOptions

app = typer.Typer()


JobsOpt = Annotated[
    str,
    typer.Option(
        "--jobs",
        "-j",
        help="Runs trained at once, each in its own process with its share of the cores: a number, or "
        "auto (one per core on a CPU, one per GPU on a GPU machine).",
    ),
]
ExecutorOpt = Annotated[
    str,
    typer.Option(
        "--executor", help="local (this machine) or ray (every run a task on a Ray cluster; pip install benchctl[ray])."
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        help="The Ray cluster to join, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a new local one).",
    ),
]
RunsDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--runs-dir",
        help="Where run directories (checkpoints) live; with Ray, a directory every machine sees at this "
        "path (default: runs/ beside results.db).",
    ),
]


def prepare_for(cfg, progress: bool):
    """Run `prepare` on demand (instant when cached). Under torchrun, rank 0 prepares first, then the others read.
    Preparation messages go to stderr, as they always have, so stdout carries only the command's results."""
    # torch: kept out of 'benchctl --help'
    from benchctl.core import data
    from benchctl.core.runtime import Dist, init_distributed, main_first, resolve_device

    dist_info = Dist.from_env()
    if dist_info.enabled:
        init_distributed(dist_info, resolve_device(cfg.train.device, dist_info.local_rank))
    return main_first(
        dist_info,
        lambda: data.prepare_run_data(cfg, progress=make_progress(progress and dist_info.is_main, stderr=True)),
    )


def _retrofit_to_resume(path: Path, cfg: Any) -> bool:
    """Whether `path` holds an unfinished run of this architecture and seed that `retrofit` started from converted
    weights (what `train` may resume; the engine checks the exact run)."""
    import sqlite3

    if not path.is_file():
        return False
    try:
        with contextlib.closing(sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)) as conn:
            row = conn.execute(
                "select 1 from runs where parent_run_id is not null and status != 'done' and arch = ? and seed = ?",
                (cfg.arch, cfg.seed),
            ).fetchone()
    except sqlite3.Error:
        return True  # an old or odd database: the engine's exact check decides
    return row is not None


@app.command()
def train(
    arch: Annotated[
        str,
        typer.Option(
            "--arch", "-a", help="Architecture: a registered one, e.g. control ('benchctl params' lists them all)."
        ),
    ],
    preset: PresetOpt = "paper",
    seed: Annotated[int, typer.Option("--seed", help="Training seed (weights, batches).")] = 0,
    set_: SetOpt = None,
    data: DataOpt = None,
    task: TaskOpt = None,
    db: DbOpt = None,
    yes: YesOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Train one architecture (resumes an interrupted run; skips a finished one). Works under torchrun for DDP."""
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.core import db as dbm
    from benchctl.core.runtime import Dist, decide_on_main
    from benchctl.stages.train import tables as train_tables
    from benchctl.stages.train.engine import train_run
    from benchctl.stages.train.sweep import confirm_long_run

    cfg = make_config(preset, arch, seed, overrides_with_data(set_, data, task))
    dist_info = Dist.from_env()
    path = db_path_of(db)
    dbm.check_target(path)  # a file that is not benchctl's is refused before the data is prepared
    if cfg.train.init_from and not _retrofit_to_resume(path, cfg):
        # `train` only resumes a run started from converted weights; refused before a database or cache is made
        raise ConfigError(
            f"train.init_from={cfg.train.init_from!r}: this run starts from converted weights; start it with "
            "'benchctl retrofit'"
        )
    prepared = prepare_for(cfg, progress)
    handle = stages.connect(path) if dist_info.is_main else None
    log = console.print if dist_info.is_main else (lambda *_: None)

    def confirm_on_main() -> None:
        """Rank 0 asks; under torchrun its answer (go on, or the abort) is every rank's."""
        row = train_tables.get_run(handle, run_id(cfg, prepared.fingerprint))
        if row is None or row["status"] != "done":
            confirm_long_run([cfg], prepared, yes=yes, log=log, confirm=terminal_confirm())

    decide_on_main(dist_info, confirm_on_main)
    result = train_run(cfg, prepared, handle, path, progress=make_progress(progress and dist_info.is_main), log=log)
    if not dist_info.is_main:
        return
    if result.skipped:
        console.print(f"{result.run_id} is already done (rerun skipped); see 'benchctl runs'")
    summarize([train_tables.get_run(handle, result.run_id)])


@app.command("train-all")
def train_all(
    preset: Annotated[
        str | None,
        typer.Option("--preset", "-p", help="Named preset: paper, small or tiny (default: the plan's, else paper)."),
    ] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Comma list (default: all registered).")] = None,
    seeds: Annotated[
        str | None,
        typer.Option(
            "--seeds",
            help="Comma list or range, e.g. 0,1,2 or 0-4 (default: 0; with --plan the plan's, else 0,1,2); at "
            "most 1000 seeds.",
        ),
    ] = None,
    plan: Annotated[
        str | None,
        typer.Option("--plan", help="Train a plan's variants (a built-in plan's name or a plan file's path)."),
    ] = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    task: TaskOpt = None,
    db: DbOpt = None,
    yes: YesOpt = False,
    progress: ProgressOpt = True,
    jobs: JobsOpt = "1",
    executor: ExecutorOpt = "local",
    ray_address: RayAddressOpt = None,
    runs_dir: RunsDirOpt = None,
) -> None:
    """Train every (architecture, seed) pair, or every (variant, seed) of a --plan, skipping finished runs and
    resuming interrupted ones."""
    opts = TrainOptions(yes=yes, jobs=jobs, executor=executor, ray_address=ray_address, runs_dir=runs_dir)
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.core import db as dbm
    from benchctl.core.runtime import Dist
    from benchctl.stages.train import sweep
    from benchctl.stages.train import tables as train_tables

    overrides = overrides_with_data(set_, data, task)
    plan_, variants = None, None
    if plan is None:
        cfgs = sweep.sweep(preset or "paper", split_list(archs), parse_seeds(seeds), overrides)
    else:
        plan_, _, planned = plans.planned_runs(plan, preset, split_list(archs), parse_seeds(seeds), overrides)
        cfgs, variants = [r.cfg for r in planned], [r.variant for r in planned]
        if converted := [v.name for v in plan_.variants if v.parent is not None]:  # they need their parents trained
            console.print(f"plan {plan_.name}: conversions {', '.join(converted)} are made by 'benchctl study'")
    path = db_path_of(db)
    dbm.check_target(path)  # a file that is not benchctl's is refused before the data is prepared
    prepared = prepare_for(cfgs[0], progress)
    is_main = Dist.from_env().is_main  # under torchrun every rank trains each run; rank 0 alone reports
    res = sweep.train_all(
        cfgs,
        prepared,
        path,
        opts,
        progress=progress,
        log=console.print if is_main else _quiet,
        confirm=terminal_confirm(),
        variants=variants,
        plan=plan_,
    )
    if not is_main:
        return
    handle = stages.connect(path)
    summarize([train_tables.get_run(handle, rid) for rid in res.done + res.skipped])
    if res.failed:
        raise BenchctlError(
            f"{len(res.failed)} run(s) failed: " + "; ".join(f"{rid}: {err}" for rid, err in res.failed)
        )


def _quiet(*_: Any) -> None:
    """The log of ranks other than 0: only rank 0 speaks."""


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}M"


def summarize(rows: list[dict[str, Any] | None]) -> None:
    """The comparison table: params, initial and final validation loss, train time, tokens/s, peak memory."""
    rows = [r for r in rows if r]
    if not rows:
        return
    t = Table(title="runs", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("variant", "seed", "params", "initial", "final", "time", "tok/s", "step mem", "peak mem"):
        t.add_column(head, justify="left" if head == "variant" else "right", no_wrap=True)
    kinds = set()
    for r in rows:
        if r.get("peak_gpu_mem_bytes"):
            mem, kinds = _fmt_bytes(r["peak_gpu_mem_bytes"]), kinds | {"GPU: torch peak allocated"}
        elif r.get("peak_rss_bytes"):
            mem, kinds = _fmt_bytes(r["peak_rss_bytes"]), kinds | {"CPU: the process's peak RSS, not the model's"}
        else:
            mem = "-"
        t.add_row(
            r.get("variant") or r["arch"],
            str(r["seed"]),
            f"{r['n_params']:,}" if r.get("n_params") else "-",
            _f(r.get("initial_val_loss")),
            _f(r.get("final_val_loss")),
            f"{r['train_seconds']:.1f}s" if r.get("train_seconds") is not None else "-",
            f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
            _fmt_bytes(r["step_mem_bytes"]) if r.get("step_mem_bytes") else "-",
            mem,
        )
    console.print(t)
    devs = sorted({r.get("device_name") or "?" for r in rows})
    console.print(
        f"initial/final: validation loss (nats/token); time: training only (no warm-up, evaluation or checkpoints); "
        "step mem: parameters + optimizer state + the peak of torch's allocations in one optimizer step (as "
        f"'benchctl bench' measures it); peak mem: {'; '.join(sorted(kinds)) or '-'}. device: {', '.join(devs)}. "
        f"precision: {', '.join(sorted({_dtype(r) for r in rows}))}.{_compiled(rows)}"
    )


def _compiled(rows: list[dict[str, Any]]) -> str:
    """' compiled: 2 of 4 runs (torch.compile).' when any run was compiled (warm-up then includes compilation)."""
    n = sum(1 for r in rows if r.get("compiled"))
    return f" compiled: {n} of {len(rows)} run{'s' if len(rows) != 1 else ''} (torch.compile)." if n else ""


def _dtype(r: dict[str, Any]) -> str:
    """'bf16 (cpu:avx512_bf16)': the precision a run trained in and what it was chosen from ('-' before it was
    recorded)."""
    if not r.get("dtype"):
        return "-"
    short = {"bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
    reason = r.get("precision_reason") or ""
    cap = reason[reason.rfind("(") + 1 : -1] if reason.endswith(")") else ""
    return f"{short} ({cap})" if cap else short


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


RUN_STATUSES = ("pending", "running", "done", "failed")


@app.command()
def runs(
    db: DbOpt = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only this preset.")] = None,
    status: Annotated[str | None, typer.Option("--status", help="pending, running, done or failed.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the runs in results.db."""
    # sqlite_utils loads pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.train import tables as train_tables

    if status is not None and status not in RUN_STATUSES:
        raise ConfigError(f"--status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    handle = stages.connect(db_path_of(db), readonly=True)  # a listing never migrates or creates anything
    rows = train_tables.runs(handle, status=status, preset=preset)
    if as_json:
        keep = (
            "id",
            "arch",
            "variant",
            "preset",
            "seed",
            "status",
            "step",
            "max_steps",
            "initial_val_loss",
            "final_val_loss",
            "train_seconds",
            "cpu_seconds",
            "cuda_seconds",
            "threads",
            "concurrent_jobs",
            "load_avg",
            "gpu_util",
            "tokens_per_s",
            "peak_rss_bytes",
            "baseline_rss_bytes",
            "step_mem_bytes",
            "device",
            "dtype",
            "precision_reason",
            "compiled",
            "compile_reason",
            "error",
        )
        print(json.dumps([{k: r.get(k) for k in keep} for r in rows], indent=2))
        return
    if not rows:
        console.print("no runs yet; start with 'benchctl train-all --preset small'")
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    timing = ("wall", "CPU", "thr", "jobs", "load")
    errors = any(r.get("error") for r in rows)
    precisions = sorted({_dtype(r) for r in rows})  # one precision for all: said once below the table
    extra = (("dtype",) if len(precisions) > 1 else ()) + (("error",) if errors else ())
    for head in ("id", "variant", "status", "step", "final loss", *timing, *extra):
        # the id (and an error) fold onto more lines before any number is cut short on a narrow terminal
        t.add_column(
            head,
            no_wrap=head not in ("id", "error"),
            overflow="fold",
            min_width=12 if head == "id" else None,
            justify="right" if head in ("step", "final loss", *timing) else "left",
        )
    for r in rows:
        dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(r.get("dtype") or "", r.get("dtype") or "-")
        t.add_row(
            r["id"],
            r.get("variant") or r["arch"],
            r["status"],
            f"{r.get('step') or 0}/{r.get('max_steps') or '?'}",
            _f(r.get("final_val_loss")),
            *_timing(r),
            *([dtype] if len(precisions) > 1 else []),
            *([(r.get("error") or "")[:60]] if errors else []),
        )
    console.print(t)
    console.print(
        "wall, CPU: seconds of the timed training steps in wall time and in process CPU time (all threads); "
        "thr: threads; jobs: benchctl jobs run side by side; load: the machine's mean 1-minute load "
        "average during training. Above the core count, wall time is no cost measure: see the report."
        + (f" precision: {precisions[0]}." if len(precisions) == 1 else ""),
        highlight=False,
    )


def _timing(r: dict[str, Any]) -> tuple[str, ...]:
    """What a run's timing needs to be read: wall and CPU seconds, threads, concurrent jobs, load ('-' when not
    recorded, as in runs trained before these were)."""

    def num(key: str, fmt: str) -> str:
        return "-" if r.get(key) is None else format(r[key], fmt)

    return (
        num("train_seconds", ".1f"),
        num("cpu_seconds", ".1f"),
        num("threads", "d"),
        num("concurrent_jobs", "d"),
        num("load_avg", ".2f"),
    )
