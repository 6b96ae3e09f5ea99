"""`benchctl eval`: lm-eval tasks (bundled offline TinyStories tasks, or any lm-eval task) on finished runs.

Thin: parse the options, call `benchctl.stages.eval.api.evaluate_runs`, print the closing tables. The adapter, the
bundled tasks and the runner are described in the `benchctl.stages.eval.api` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.cli import DbOpt, console, db_path_of, split_list
from benchctl.stages.eval.options import EvalOptions

app = typer.Typer()


@app.command("eval", short_help="lm-eval tasks on every finished run.")
def eval_(
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            "-t",
            help="Comma list: tinystories_ppl, tinystories_ending, tinystories_names, "
            "tinystories_order (default: all four), or lm-eval task names / globs (hellaswag, lambada_openai, "
            "blimp_*).",
        ),
    ] = None,
    runs: Annotated[str | None, typer.Option("--runs", help="Comma list of run ids (default: every done run).")] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Only these architectures (comma list).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only runs of this preset.")] = None,
    n_recur: Annotated[
        int | None,
        typer.Option(
            "--n-recur",
            help="Test-time recurrence (default: each run's trained one); each run's architecture "
            "says which depths it accepts, and a depth it cannot run is an error naming the limit.",
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N documents of each task.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Requests per forward pass.")] = 32,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            help="CPU threads for torch (default: torch's choice; 1 is fastest for tiny models on a shared machine).",
        ),
    ] = None,
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            help="Weights' dtype, cast once: auto (the fastest bench --decode measured on this hardware; float32 "
            "without a measurement), float32, bfloat16 or float16.",
        ),
    ] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Recompute results already in the database.")] = False,
    include_path: Annotated[
        list[Path] | None,
        typer.Option("--include-path", help="A directory of your own lm-eval task YAMLs (repeatable)."),
    ] = None,
    jobs: Annotated[
        str,
        typer.Option(
            "--jobs",
            "-j",
            help="Runs evaluated at once, each share in its own process with its share of the cores: a "
            "number, or auto (one per core on a CPU, one per GPU on a GPU machine).",
        ),
    ] = "1",
    db: DbOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress.")] = True,
) -> None:
    """Evaluate finished runs with lm-eval and store every metric in results.db (table eval_results)."""
    opts = EvalOptions(
        select=RunSelection(run_ids=split_list(runs), archs=split_list(archs), preset=preset),
        tasks=split_list(tasks),
        n_recur=n_recur,
        limit=limit,
        batch_size=batch_size,
        device=device,
        force=force,
        include_paths=include_path or (),
        threads=threads,
        jobs=jobs,
        precision=precision,
    )
    # lm_eval and torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.eval import api as evaluate

    path = db_path_of(db)
    handle = stages.connect(path, create=False)
    summary = evaluate.evaluate_runs(handle, path, opts, progress=Progress(enabled=progress, console=console))
    what = f"n_recur {n_recur}" if n_recur is not None else "trained n_recur"
    what += f", first {limit} documents" if limit else ""
    for task, headers, rows in evaluate.summary_tables(summary):
        table = Table(title=f"{task} ({what})", title_justify="left", box=box.SIMPLE_HEAD)
        for i, head in enumerate(headers):
            table.add_column(head, justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    notes = [
        f"{len(summary.evaluated)} evaluated, {len(summary.skipped)} already in the database"
        + (" (--force recomputes)" if summary.skipped else "")
        + f", {summary.seconds:.1f} s."
    ]
    if summary.unavailable:
        notes.append(f"not run (dataset not available; see above): {', '.join(summary.unavailable)}.")
    notes.append(
        "bits/byte and word ppl: lower is better; acc (chance: 1/4 on tinystories_ending and _names, 1/2 "
        "on tinystories_order), acc_norm (length-normalised): higher is better; ± = standard error. "
        "Every metric: sqlite-utils "
        f"{path} 'select * from eval_results' --table"
    )
    console.print("\n".join(notes), highlight=False, soft_wrap=True)
