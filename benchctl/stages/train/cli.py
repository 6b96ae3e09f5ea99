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
from benchctl.core.config import make_config, run_id, short_run_ids
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
    fitted_table,
    make_progress,
    overrides_with_data,
    parse_seeds,
    print_wide,
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


@app.command(short_help="Train one architecture (resumes; skips a finished run).")
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


@app.command("train-all", short_help="Train every architecture, or plan variant, × seed.")
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


SUMMARY_HEADS = ("variant", "seed", "params", "initial", "final", "time", "tok/s", "step mem", "peak mem")
SUMMARY_OPTIONAL = ("step mem", "tok/s", "peak mem", "initial", "params")  # left out first on a narrow terminal


def summarize(rows: list[dict[str, Any] | None]) -> None:
    """The comparison table: params, initial and final validation loss, train time, tokens/s, peak memory."""
    rows = [r for r in rows if r]
    if not rows:
        return
    kinds = set()
    cells = []
    for r in rows:
        if r.get("peak_gpu_mem_bytes"):
            mem, kinds = _fmt_bytes(r["peak_gpu_mem_bytes"]), kinds | {"GPU: torch peak allocated"}
        elif r.get("peak_rss_bytes"):
            mem, kinds = _fmt_bytes(r["peak_rss_bytes"]), kinds | {"CPU: the process's peak RSS, not the model's"}
        else:
            mem = "-"
        values = (
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
        cells.append(dict(zip(SUMMARY_HEADS, values)))

    table, dropped = fitted_table(
        SUMMARY_HEADS,
        cells,
        SUMMARY_OPTIONAL,
        right=SUMMARY_HEADS[1:],
        title="runs",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    console.print(table)
    devs = sorted({r.get("device_name") or "?" for r in rows})
    console.print(
        f"initial/final: validation loss (nats/token); time: training only (no warm-up, evaluation or checkpoints); "
        "step mem: parameters + optimizer state + the peak of torch's allocations in one optimizer step (as "
        f"'benchctl bench' measures it); peak mem: {'; '.join(sorted(kinds)) or '-'}. device: {', '.join(devs)}. "
        f"precision: {', '.join(sorted({_dtype(r) for r in rows}))}.{_compiled(rows)}"
        + (f" Left out at this width: {', '.join(dropped)}." if dropped else "")
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


RUN_STATUSES = ("pending", "running", "interrupted", "done", "failed")
RUN_KEYS = (
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
# The columns `runs` may leave out on a narrow terminal, the first to go first: what explains a timing (the jobs run
# beside it, the threads, the machine's load) goes before the timings, and the id, status, step and loss always stay.
RUNS_OPTIONAL = ("jobs", "thr", "variant", "dtype", "load", "CPU", "wall")
TIMING_HEADS = ("wall", "CPU", "thr", "jobs", "load")


@app.command(short_help="What was trained: each run's status, loss and timings.")
def runs(
    db: DbOpt = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only this preset.")] = None,
    status: Annotated[
        str | None,
        typer.Option(
            "--status",
            help="pending, running, interrupted (recorded as running, but its process is gone), done or failed.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (whole run ids, every column).")] = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            help="Whole run ids and every column, however wide the terminal (the table shortens ids to what tells "
            "them apart, and leaves out what does not fit).",
        ),
    ] = False,
) -> None:
    """List the runs in results.db."""
    # a plain read-only connection: a listing migrates and creates nothing, and so needs neither the stages' tables
    # (importing every stage imports torch) nor sqlite_utils (which imports pandas)
    from benchctl.core import db as dbm
    from benchctl.core import liveness
    from benchctl.stages.train import tables as train_tables

    if status is not None and status not in RUN_STATUSES:
        raise ConfigError(f"--status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    conn = dbm.read_only(db_path_of(db))
    try:
        # an interrupted run is stored as running: which running rows are is decided below, row by row
        stored = "running" if status == liveness.INTERRUPTED else status
        rows = [{**r, "status": liveness.run_state(r)} for r in train_tables.runs(conn, status=stored, preset=preset)]
        rows = [r for r in rows if status is None or r["status"] == status]
        # short ids tell a run apart from every run in the file, not only from those listed: the same run keeps the
        # same short id whatever the filter
        every_id = [r["id"] for r in rows] if status is None and preset is None else train_tables.run_ids(conn)
    finally:
        conn.close()
    if as_json:
        print(json.dumps([{k: r.get(k) for k in RUN_KEYS} for r in rows], indent=2))
        return
    if not rows:
        console.print("no runs yet; start with 'benchctl train-all --preset small'")
        return
    _print_runs(rows, every_id, wide=wide)


def _print_runs(rows: list[dict[str, Any]], every_id: list[str], *, wide: bool) -> None:
    """The runs table, every number whole: at the terminal's width, with short ids and the least needed columns
    left out where they do not fit (said below the table); with `wide`, whole ids and every column."""
    ids = {i: i for i in every_id} if wide else short_run_ids(every_id)
    precisions = sorted({_dtype(r) for r in rows})  # one precision for all: said once below the table
    # the variant is the name a plan gave the run; without a plan it is the architecture, which the id starts with
    named = any((r.get("variant") or r["arch"]) != r["arch"] for r in rows)
    heads = (
        ("id",)
        + (("variant",) if named or wide else ())
        + ("status", "step", "final loss", *TIMING_HEADS)
        + (("dtype",) if len(precisions) > 1 else ())
    )
    cells = [_run_cells(r, ids.get(r["id"], r["id"])) for r in rows]

    table, dropped = fitted_table(
        heads,
        cells,
        RUNS_OPTIONAL,
        right=("step", "final loss", *TIMING_HEADS),
        wide=wide,
        box=box.SIMPLE_HEAD,
        # one space between columns and none at the edges: the room goes to the numbers
        padding=(0, 0),
        show_edge=False,
    )
    if wide:
        print_wide(table)
    else:
        console.print(table)
    console.print()  # the table has no bottom edge: a blank line parts it from the notes
    explained = {
        "wall": "wall: seconds of the timed training steps",
        "CPU": "CPU: their process CPU time in seconds (all threads)",
        "thr": "thr: threads",
        "jobs": "jobs: benchctl jobs run side by side",
        "load": "load: the machine's mean 1-minute load average during training",
    }
    notes = [text for head, text in explained.items() if _shown(table, head)]
    if _shown(table, "wall"):
        notes.append("above the core count, wall time is no cost measure: see the report")
    if any(r["status"] == "interrupted" for r in rows):
        notes.append(
            "interrupted: recorded as running, but the process that trained it is gone (killed, or its machine "
            "lost); the command that trained it resumes it"
        )
    shortened = not wide and any(ids[i] != i for i in every_id)
    console.print(
        "; ".join(notes)
        + "."
        + (f" precision: {precisions[0]}." if len(precisions) == 1 else "")
        + (" id: the run id shortened to what tells it apart." if shortened else "")
        + (f" Left out at this width: {', '.join(dropped)}." if dropped else "")
        + (" --wide shows whole ids and every column; --json every field." if shortened or dropped else ""),
        highlight=False,
    )
    # errors under the table, whole: a column would take the room of the numbers, and cut the errors short
    for r in rows:
        if r.get("error"):
            console.print(f"{ids.get(r['id'], r['id'])} ({r['status']}): {r['error']}", highlight=False, markup=False)


def _shown(table: Table, head: str) -> bool:
    return any(c.header == head for c in table.columns)


def _run_cells(r: dict[str, Any], short_id: str) -> dict[str, str]:
    """One run's cells, by column head."""
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(r.get("dtype") or "", r.get("dtype") or "-")
    return {
        "id": short_id,
        "variant": r.get("variant") or r["arch"],
        "status": r["status"],
        "step": f"{r.get('step') or 0}/{r.get('max_steps') or '?'}",
        "final loss": _f(r.get("final_val_loss")),
        **dict(zip(TIMING_HEADS, _timing(r))),
        "dtype": dtype,
    }


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
