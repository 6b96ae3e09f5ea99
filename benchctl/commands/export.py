"""`benchctl export RUN --format hf|llama2c --out DIR`: a finished run's model for other tools (see benchctl.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from benchctl.core.errors import ConfigError
from benchctl.export import FORMATS, check_installed
from benchctl.stages.cli import DbOpt, JsonOpt, console, db_path_of
from benchctl.stages.depth.options import check_test_depth

app = typer.Typer()


@app.command(short_help="A finished run as a Hugging Face folder or llama2.c files.")
def export(
    run: Annotated[str, typer.Argument(help="The finished run's id ('benchctl runs --wide' lists them whole).")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="hf (a Hugging Face LlamaForCausalLM folder) or llama2c (model.bin and tokenizer.bin for run.c).",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write (created; must be new or empty).")],
    n_recur: Annotated[
        int | None,
        typer.Option("--n-recur", help="Passes to unroll (relaxed; default: as trained); at most 1024."),
    ] = None,
    extrapolate: Annotated[
        str | None,
        typer.Option("--extrapolate", help="Passes past the trained depth (relaxed): cycle|last|none (default cycle)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into a directory that is not empty.")] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a finished run as a Hugging Face folder or llama2.c files, with a model card (README.md)."""
    if n_recur is not None:  # the bound every depth option shares, before anything is loaded or written
        if n_recur < 1:
            raise ConfigError(f"--n-recur must be >= 1, got {n_recur}")
        check_test_depth(n_recur, "--n-recur")
    if fmt in FORMATS:
        check_installed(fmt)  # the extra a format needs, before the database is opened
    # torch, transformers: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.export import as_json as result_json
    from benchctl.export import check_format, export_run
    from benchctl.stages.train import tables as train_tables

    path = db_path_of(db)
    handle = stages.connect(path, create=False)
    row = train_tables.get_run(handle, run)
    if row is not None:
        check_format(row["arch"], fmt)  # the refusal before loading anything
    result = export_run(handle, path, run, fmt, out, n_recur=n_recur, extrapolate=extrapolate, force=force)
    if as_json:
        print(result_json(result))
        return
    console.print(
        f"{result.run_id} -> {result.out} ({result.fmt}): {', '.join(result.files)}; {result.n_layers} layers, "
        f"{result.exported_params:,} parameters exported ({result.unique_params:,} trained)",
        highlight=False,
        soft_wrap=True,
    )
