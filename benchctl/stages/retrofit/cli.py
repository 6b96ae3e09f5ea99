"""`benchctl retrofit`: convert a finished control's weights into a recurrent model and train it as a new run."""

from __future__ import annotations

from typing import Annotated

import typer

from benchctl.core.config import run_id
from benchctl.stages.cli import (
    DataOpt,
    DbOpt,
    ProgressOpt,
    SetOpt,
    YesOpt,
    console,
    db_path_of,
    make_progress,
    overrides_with_data,
    terminal_confirm,
)
from benchctl.stages.retrofit.options import RetrofitOptions
from benchctl.stages.train.cli import prepare_for, summarize

app = typer.Typer()


@app.command(short_help="A recurrent model from a trained control's weights.")
def retrofit(
    from_: Annotated[str, typer.Option("--from", help="The finished parent run: its id, or its name when unique.")],
    to: Annotated[
        str,
        typer.Option(
            "--to", help="Target architecture: a registered one, e.g. relaxed ('benchctl params' lists them all)."
        ),
    ],
    init: Annotated[str, typer.Option("--init", help="stepwise | average (looped models) | select (three-part).")],
    lora_init: Annotated[
        str, typer.Option("--lora-init", help="Relaxed LoRA init: svd (of the residuals) | zero.")
    ] = "svd",
    steps: Annotated[int | None, typer.Option("--steps", help="Healing steps (default: the preset's).")] = None,
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Look --from up among this preset's runs.")
    ] = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    db: DbOpt = None,
    yes: YesOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Start a recurrent model from a trained control's weights and heal it by training (resumable like train)."""
    opts = RetrofitOptions(
        parent=from_,
        to=to,
        init=init,
        lora_init=lora_init,
        steps=steps,
        preset=preset,
        overrides=overrides_with_data(set_, data),
    )
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.retrofit import engine as rf
    from benchctl.stages.train import tables as train_tables
    from benchctl.stages.train.sweep import confirm_long_run

    path = db_path_of(db)
    handle = stages.connect(path)
    job = rf.plan(handle, opts)
    prepared = prepare_for(job.cfg, progress)
    row = train_tables.get_run(handle, run_id(job.cfg, prepared.fingerprint))
    if row is None or row["status"] != "done":
        confirm_long_run([job.cfg], prepared, yes=yes, log=console.print, confirm=terminal_confirm())
    console.print(f"retrofit {job.parent['id']} -> {job.cfg.arch} ({job.method})")
    result = rf.run(job, prepared, handle, path, progress=make_progress(progress), log=console.print)
    if result.skipped:
        console.print(f"{result.run_id} is already done (rerun skipped); see 'benchctl runs'")
    summarize([train_tables.get_run(handle, result.run_id)])
