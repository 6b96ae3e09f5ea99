"""What every command line shares: the consoles, the options many commands take (--preset, --set, --db, ...) and
how they are read, and the terminal's yes/no question.

Each command module (a stage's `cli.py`, or a module of `benchctl/commands/`) declares its commands on a Typer of its
own, named `app`; the `benchctl` root (benchctl.cli) gathers them. So a command needs nothing above this module, and
the engines below never see Typer. Everything here is cheap to import: building the command line for `benchctl
--help` loads every command module, so they import their engines (torch, pandas) inside the command functions.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from benchctl.core.config import parse_set
from benchctl.core.datadir import check_source
from benchctl.core.errors import ConfigError, DataError
from benchctl.core.progress import Progress

console = Console()
err_console = Console(stderr=True)

# Options shared by many commands, declared once.
PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Named preset: paper, small or tiny.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable)."),
]
DbOpt = Annotated[
    Path | None,
    typer.Option("--db", help="results database [env BENCHCTL_DB; default results/results.db]."),
]


def _check_data(value: str | None) -> str | None:
    """--data (else $BENCHCTL_DATA) checked as the options are parsed: a wrong path is one line at once, before the
    command loads torch and the data readers, not when it comes to prepare the data."""
    source = data_source(value)
    if source is not None:
        try:
            check_source(source)
        except DataError as e:
            given = "--data" if value else "$BENCHCTL_DATA"
            raise DataError(f"{given}: {e}") from None
    return value


DataOpt = Annotated[
    str | None,
    typer.Option(
        "--data",
        help="Data source: 'hub' (roneneldan/TinyStories) or a path (directory with train.txt/valid.txt, .jsonl, "
        ".parquet) [env BENCHCTL_DATA].",
        callback=_check_data,
    ),
]
TaskOpt = Annotated[
    str | None,
    typer.Option(
        "--task",
        help="What to learn: stories (TinyStories, the default) or a reasoning task ('benchctl tasks' lists them); "
        "the same as --set task.name=NAME.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before a run estimated to take over an hour.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show live progress bars.")]


def data_source(data: str | None) -> str | None:
    """--data, else $BENCHCTL_DATA, else None (the preset's default)."""
    return data or os.environ.get("BENCHCTL_DATA") or None


def db_path_of(db: Path | None) -> Path:
    """--db, else $BENCHCTL_DB, else results/results.db. The data cache is the `cache` folder beside it (unless
    $BENCHCTL_CACHE names one), as the runs directory is: a command given --db elsewhere uses and fills that
    database's cache, not a new one in the working directory."""
    from benchctl.core.files import use_cache_beside

    if db is not None:
        path = Path(db)
    else:
        # sqlite_utils loads pandas: kept out of 'benchctl --help'
        from benchctl.core import db as dbm

        path = dbm.default_path()
    use_cache_beside(path)
    return path


def overrides_with_data(set_: list[str] | None, data: str | None, task: str | None = None) -> dict[str, Any]:
    """The --set overrides, with --data (or $BENCHCTL_DATA) as `data.source` and --task as `task.name` when given."""
    overrides: dict[str, Any] = parse_set(set_)
    if task is not None:
        if overrides.get("task.name", task) != task:
            raise ConfigError(f"--task {task} and --set task.name={overrides['task.name']} disagree; give one")
        overrides["task.name"] = task
    src = data_source(data)
    if src is not None:
        overrides["data.source"] = src
    return overrides


def make_progress(enabled: bool, *, stderr: bool = False) -> Progress:
    """The progress reporter a command hands to the engine, drawing on the command line's console."""
    return Progress(enabled=enabled, console=err_console if stderr else console)


def split_list(value: str | None) -> list[str] | None:
    """'a,b, c' -> ['a', 'b', 'c']; None stays None."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


# The most seeds one command takes, and the largest seed (what `train --seed` takes): a bound on a typo such as
# 0-100000, which would otherwise build that many configurations before the estimate could ask. Below it, work
# estimated at over an hour asks first (--yes answers).
MAX_SEEDS = 1000
MAX_SEED = 2**32 - 1


def parse_seeds(value: str | None) -> list[int] | None:
    items = split_list(value)
    if items is None:
        return None
    seeds: list[int] = []
    for item in items:
        if "-" in item and not item.startswith("-"):  # a range like 0-4
            lo, hi = item.split("-", 1)
            if lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
                _check_seeds(len(seeds) + int(hi) - int(lo) + 1, int(hi))
                seeds += list(range(int(lo), int(hi) + 1))
                continue
        if not item.isdigit():
            raise ConfigError(f"--seeds expects non-negative integers like 0,1,2 or 0-4, got {item!r}")
        _check_seeds(len(seeds) + 1, int(item))
        seeds.append(int(item))
    return seeds


def _check_seeds(count: int, largest: int) -> None:
    if largest > MAX_SEED:
        raise ConfigError(f"--seeds: a seed must be in [0, {MAX_SEED}], got {largest}")
    if count > MAX_SEEDS:
        raise ConfigError(f"--seeds: at most {MAX_SEEDS} seeds in one command, got {count}")


def terminal_confirm() -> Callable[[str], bool] | None:
    """How a command lets the engine ask the user a yes/no question (e.g. before hours of training): on the
    terminal (default no) when stdin is one; None when it is not, so the engine asks for --yes. The engine takes
    this callback and never touches the terminal itself."""
    if not sys.stdin.isatty():
        return None
    return lambda question: typer.confirm(question, default=False)


def fitted_table(
    heads: Sequence[str],
    rows: Sequence[dict[str, str]],
    optional: Sequence[str],
    *,
    right: Sequence[str] = (),
    wide: bool = False,
    **table_args: Any,
) -> tuple[Table, list[str]]:
    """A table of `rows` (head -> cell) with every column of `heads` that fits the console's width, and the columns
    left out. No cell is ever cut: rich shortens every column of a table wider than the terminal, numbers and
    headers included ("loa" for "load"), so a column that does not fit is dropped whole instead, and the caller says
    which. `optional` are the columns that may go, least needed first; the others always stay. `wide` keeps every
    column (print the table with `print_wide`). `right` are the right-aligned columns; `table_args` go to `Table`."""
    # a cell's own width: rich measures a cell's minimum as its longest word ("final" of "final loss"), so without
    # it a table would seem to fit that does not
    widths = {h: max(cell_len(text) for text in (h, *(r[h] for r in rows))) for h in heads}

    def build(shown: Sequence[str], body: Sequence[dict[str, str]]) -> Table:
        table = Table(**table_args)
        for h in shown:
            table.add_column(h, no_wrap=True, min_width=widths[h], justify="right" if h in right else "left")
        for r in body:
            table.add_row(*(r[h] for h in shown))
        return table

    shown, dropped = list(heads), []
    for head in () if wide else [h for h in optional if h in heads]:
        # measured without its rows (the widths above stand for them): measuring every cell again is what costs
        if Measurement.get(console, console.options.update_width(10_000), build(shown, ())).minimum <= console.width:
            break
        shown.remove(head)
        dropped.append(head)
    return build(shown, rows), dropped


def print_wide(table: Table) -> None:
    """Print a table at its natural width, however wide the terminal: nothing is cut or folded (the terminal wraps
    long lines itself), so a pipe or a file gets every cell whole."""
    width = Measurement.get(console, console.options.update_width(10_000), table).maximum
    narrow = console.width
    console.width = max(width, narrow)  # the console's own width: print(width=...) never goes beyond it
    try:
        console.print(table, crop=False)
    finally:
        console.width = narrow
