"""`benchctl depth`: validation loss of finished runs against inference depth, or with the adaptive exit.

Thin: parse the options, call `benchctl.stages.depth.engine.depth_all`, print the rows measured. What is measured and
stored is described in `benchctl.stages.depth.engine`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.cli import DbOpt, YesOpt, console, db_path_of, split_list, terminal_confirm
from benchctl.stages.depth.options import DepthOptions

app = typer.Typer()


@app.command(short_help="Loss against test-time depth, and the adaptive exit.")
def depth(
    runs: Annotated[str | None, typer.Option("--runs", help="Only these run ids (comma list).")] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Only these architectures (comma list).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only runs of this preset.")] = None,
    depths: Annotated[
        str | None,
        typer.Option(
            "--depths",
            help="Inference depths (comma list; default 1,2,4,8,16,32); at most 1024. Work estimated at over an "
            "hour asks first.",
        ),
    ] = None,
    exit_rule: Annotated[
        str | None,
        typer.Option(
            "--exit", help="Adaptive exit instead of fixed depths: kl (next-token distributions) or latent (state)."
        ),
    ] = None,
    thresholds: Annotated[
        str | None, typer.Option("--thresholds", help="Exit thresholds (comma list; default 1e-2,1e-3,1e-4).")
    ] = None,
    max_depth: Annotated[
        int | None,
        typer.Option(
            "--max-depth", help="Maximum depth with --exit (default: each run's trained depth); at most 1024."
        ),
    ] = None,
    windows: Annotated[
        int | None,
        typer.Option("--windows", help="Only the first N of the run's fixed validation windows (default: all)."),
    ] = None,
    extrapolate: Annotated[
        str | None,
        typer.Option(
            "--extrapolate",
            help="Iterations past the trained depth: frailt last|cycle|none (default last), "
            "relaxed cycle|last|none (default cycle).",
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    db: DbOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress.")] = True,
    yes: YesOpt = False,
) -> None:
    """Loss against inference depth (or per adaptive-exit threshold) for every finished run; reruns skip stored rows."""
    # option errors first, before the database is opened
    opts = DepthOptions(
        select=RunSelection(run_ids=split_list(runs), archs=split_list(archs), preset=preset),
        depths=depths,
        exit_rule=exit_rule,
        thresholds=thresholds,
        max_depth=max_depth,
        windows=windows,
        extrapolate=extrapolate,
        device=device,
        yes=yes,
    )
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.depth import engine as dp

    path = db_path_of(db)
    handle = stages.connect(path, create=False)
    s = dp.depth_all(
        handle, path, opts, progress=Progress(enabled=progress, console=console), confirm=terminal_confirm()
    )
    t = Table(title="test-time depth (rows measured by this call)", title_justify="left", box=box.SIMPLE_HEAD)
    for head in ("arch", "seed", "trained", "setting", "extrapolate", "val loss", "mean depth", "tok/s", "GFLOP/tok"):
        t.add_column(head, justify="left" if head in ("arch", "setting", "extrapolate") else "right", no_wrap=True)
    for r in s.rows:
        setting = dp.Setting(r["n_recur"], r["exit_rule"], r["threshold"], r["extrapolate"]).label
        t.add_row(
            r["arch"],
            str(r["seed"]),
            str(r["trained_n_recur"]),
            setting,
            r["extrapolate"] or "-",
            f"{r['val_loss']:.4f}",
            f"{r['mean_depth']:.2f}",
            f"{r['tokens'] / r['seconds']:,.0f}",
            f"{r['flops_per_token'] / 1e9:.4f}",
        )
    console.print(t)
    console.print(
        f"{len(s.rows)} measured, {s.skipped} already stored, {s.seconds:.1f} s. Mean depth = average exit iteration "
        "over tokens; every iteration is still computed, so it is the compute an implementation skipping exited "
        "tokens would spend (FLOPs/token of exit rows: at that mean depth). All rows: sqlite-utils "
        f"{path} 'select * from depth_results' --table",
        highlight=False,
        soft_wrap=True,
    )
