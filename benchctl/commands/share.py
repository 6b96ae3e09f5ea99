"""`benchctl share OUT.db`: a copy of results.db to commit or send (finished runs, thinned curves, no local paths);
see benchctl.share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from benchctl.stages.cli import DbOpt, JsonOpt, console, db_path_of

app = typer.Typer()


@app.command(short_help="Copy results.db for sharing, local paths removed.")
def share(
    out: Annotated[Path, typer.Argument(help="The copy to write (a new file; --force replaces a benchctl database).")],
    db: DbOpt = None,
    redact: Annotated[
        list[str] | None,
        typer.Option(
            "--redact",
            metavar="OLD[=NEW]",
            help="Replace this text in every value (repeatable), e.g. --redact /srv/data/tinystories=DATA_DIR. "
            "Always done: the database's directory, benchctl's install directory, the home directory (as ~).",
        ),
    ] = None,
    all_metrics: Annotated[
        bool,
        typer.Option("--all-metrics", help="Keep every per-step metrics row (default: evaluation steps and last)."),
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT when it is a benchctl database.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Copy results.db for sharing: finished runs only, training curves at evaluation steps, local paths removed."""
    from benchctl import share as engine  # sqlite only, but kept beside the other engines

    rules = [engine.parse_redaction(r) for r in redact or []]
    result = engine.share(db_path_of(db), out, redactions=rules, all_metrics=all_metrics, force=force)
    if as_json:
        print(
            json.dumps(
                {
                    "path": str(result.path),
                    "runs_kept": result.runs_kept,
                    "runs_dropped": result.runs_dropped,
                    "rows_dropped": result.rows_dropped,
                    "redacted": [{"old": r.old, "new": r.new, "values": n} for r, n in result.redacted],
                    "local_paths_left": result.leftover,
                    "bytes_before": result.bytes_before,
                    "bytes_after": result.bytes_after,
                },
                indent=2,
            )
        )
        return
    dropped = ", ".join(f"{n} {s}" for s, n in sorted(result.runs_dropped.items())) or "none"
    rows = ", ".join(f"{n:,} from {t}" for t, n in sorted(result.rows_dropped.items())) or "none"
    changed = "; ".join(f"{r.old!r} -> {r.new!r}: {n}" for r, n in result.redacted if n) or "none"
    console.print(
        f"{result.path}: {result.runs_kept} finished run(s) kept; runs dropped: {dropped}; rows dropped: {rows}; "
        f"values redacted: {changed}; {result.bytes_before / 1e6:.2f} MB -> {result.bytes_after / 1e6:.2f} MB",
        highlight=False,
        soft_wrap=True,
    )
    if result.leftover:
        listed = ", ".join(f"{p} ({n} value{'s' if n != 1 else ''})" for p, n in list(result.leftover.items())[:5])
        console.print(
            f"warning: the copy still names local paths: {listed}; pass --redact PATH=NAME to replace them",
            highlight=False,
            soft_wrap=True,
        )
