"""`benchctl report`: write reports/report.md and its figures from results.db (read only)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from benchctl.core.files import check_writable_dir
from benchctl.stages.cli import DbOpt, console, db_path_of
from benchctl.stages.report.options import ReportOptions

app = typer.Typer()


@app.command(short_help="reports/report.md and its figures, from results.db alone.")
def report(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for report.md and figures/.")] = Path(
        "reports"
    ),
    preset: Annotated[
        str | None,
        typer.Option("--preset", "-p", help="Preset to report [default: the one with most finished runs]."),
    ] = None,
    plan: Annotated[
        str | None,
        typer.Option(
            "--plan", help="Report only the runs this plan trained, named by its variants (see 'benchctl plans')."
        ),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="Output format (md: markdown with PNG figures).")] = "md",
    db: DbOpt = None,
) -> None:
    """The study's tables and figures, with seeds and statistics, beside the published numbers."""
    opts = ReportOptions(out_dir=out, preset=preset, plan=plan, only_plan=True, format=fmt)
    check_writable_dir(out)
    from benchctl.stages.report import engine as reporting  # pandas, matplotlib: kept out of 'benchctl --help'

    rendered, path = reporting.run(db_path_of(db), opts)
    n = len(rendered.figures)
    console.print(
        f"wrote {path} and {n} figure{'s' if n != 1 else ''} in {path.parent / 'figures'}",
        highlight=False,
        soft_wrap=True,
    )
    if rendered.preset is None:
        console.print(
            "the database has no runs yet; the report says which commands produce each section", highlight=False
        )
    else:
        console.print(f"preset: {rendered.preset}", highlight=False)
    if rendered.other_presets:
        others = ", ".join(f"{p} ({d} done)" for p, d, _ in rendered.other_presets)
        console.print(f"other presets in the database: {others}; choose one with --preset", highlight=False)
