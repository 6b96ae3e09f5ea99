"""`benchctl accuracy`: exact match of finished reasoning-task runs per difficulty level and test-time depth.

Thin: parse the options, call `benchctl.stages.accuracy.engine.accuracy_all`, print the rows measured.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.accuracy.options import AccuracyOptions
from benchctl.stages.cli import DbOpt, YesOpt, console, db_path_of, split_list

app = typer.Typer()


@app.command(short_help="Exact-match accuracy of reasoning-task runs.")
def accuracy(
    runs: Annotated[str | None, typer.Option("--runs", help="Only these run ids (comma list).")] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Only these architectures (comma list).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only runs of this preset.")] = None,
    depths: Annotated[
        str | None,
        typer.Option(
            "--depths",
            help="Test-time depths (comma list; default 1, powers of two and 1-4x each run's trained depth); at most "
            "1024.",
        ),
    ] = None,
    levels: Annotated[
        str | None, typer.Option("--levels", help="Only these difficulty levels (comma list; default all).")
    ] = None,
    problems: Annotated[
        int | None,
        typer.Option("--problems", help="Held-out problems per level (default 500; 50 at the tiny preset)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the test split's problems.")] = 0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    db: DbOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress.")] = True,
    yes: YesOpt = False,
) -> None:
    """Exact-match accuracy of reasoning-task runs per level and test-time depth; reruns skip stored rows."""
    opts = AccuracyOptions(
        select=RunSelection(run_ids=split_list(runs), archs=split_list(archs), preset=preset),
        depths=depths,
        levels=split_list(levels),
        problems=problems,
        seed=seed,
        device=device,
        yes=yes,
    )
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.accuracy import engine

    path = db_path_of(db)
    handle = stages.connect(path, create=False)
    s = engine.accuracy_all(handle, path, opts, progress=Progress(enabled=progress, console=console))
    t = Table(title="task accuracy (rows measured by this call)", title_justify="left", box=box.SIMPLE_HEAD)
    for head in ("arch", "seed", "task", "level", "depth", "trained", "accuracy", "positions", "answer loss"):
        t.add_column(head, justify="left" if head in ("arch", "task", "level") else "right", no_wrap=True)
    for r in s.rows:
        t.add_row(
            r["arch"],
            str(r["run_seed"]),
            r["task"],
            r["level"],
            str(r["n_recur"]),
            str(r["trained_n_recur"]),
            f"{r['accuracy']:.3f}",
            f"{r['position_accuracy']:.3f}",
            f"{r['answer_loss']:.4f}",
        )
    console.print(t)
    console.print(
        f"{len(s.rows)} measured, {s.skipped} already stored, {s.seconds:.1f} s. All rows: sqlite-utils {path} "
        "'select * from accuracy_results' --table",
        highlight=False,
        soft_wrap=True,
    )
