"""The `benchctl` command line (Typer). Nothing below this module knows about Typer.

Each command is one small function in `benchctl/commands/<name>.py`: parse options, build a config, call one
engine function, print. Expected failures (`BenchctlError`) are caught once, in `main()`, and printed as one
line with a non-zero exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console

from benchctl.core.errors import BenchctlError

if TYPE_CHECKING:
    from benchctl.core.progress import Progress

app = typer.Typer(
    name="benchctl",
    help="Benchmark and compare language-model architectures fairly: train, sample, judge, evaluate, report.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)

console = Console()
err_console = Console(stderr=True)

# Options shared by many commands, declared once.
PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Named preset: paper, small or tiny.")]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config key, e.g. --set train.lr=3e-4 (repeatable)."),
]
DbOpt = Annotated[
    Optional[Path],
    typer.Option("--db", help="results database [env BENCHCTL_DB; default results/results.db]."),
]
DataOpt = Annotated[
    Optional[str],
    typer.Option(
        "--data",
        help="Data source: 'hub' (roneneldan/TinyStories) or a path (directory with train.txt/valid.txt, .jsonl, "
        ".parquet) [env BENCHCTL_DATA].",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before a run estimated to take over an hour.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show live progress bars.")]


def data_source(data: str | None) -> str | None:
    """--data, else $BENCHCTL_DATA, else None (the preset's default)."""
    return data or os.environ.get("BENCHCTL_DATA") or None


def db_path_of(db: Path | None) -> Path:
    """--db, else $BENCHCTL_DB, else results/results.db."""
    from benchctl.core import db as dbm

    return Path(db) if db is not None else dbm.default_path()


def overrides_with_data(set_: list[str] | None, data: str | None) -> dict[str, Any]:
    """The --set overrides, with --data (or $BENCHCTL_DATA) as `data.source` when given."""
    from benchctl.core.config import parse_set

    overrides: dict[str, Any] = parse_set(set_)
    src = data_source(data)
    if src is not None:
        overrides["data.source"] = src
    return overrides


def make_progress(enabled: bool, *, stderr: bool = False) -> Progress:
    """The progress reporter a command hands to the engine, drawing on the command line's console."""
    from benchctl.core.progress import Progress

    return Progress(enabled=enabled, console=err_console if stderr else console)


def split_list(value: str | None) -> list[str] | None:
    """'a,b, c' -> ['a', 'b', 'c']; None stays None."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_seeds(value: str | None) -> list[int] | None:
    items = split_list(value)
    if items is None:
        return None
    from benchctl.core.errors import ConfigError

    seeds: list[int] = []
    for item in items:
        if "-" in item and not item.startswith("-"):  # a range like 0-4
            lo, hi = item.split("-", 1)
            if lo.isdigit() and hi.isdigit() and int(lo) <= int(hi):
                seeds += list(range(int(lo), int(hi) + 1))
                continue
        if not item.isdigit():
            raise ConfigError(f"--seeds expects non-negative integers like 0,1,2 or 0-4, got {item!r}")
        seeds.append(int(item))
    return seeds


def _print_version(value: bool) -> None:
    if value:
        from benchctl import __version__

        console.print(f"benchctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    # eager, handled while the options are parsed: the group's own body runs only before a command, and
    # `benchctl --version` has none
    version: Annotated[bool, typer.Option("--version", help="Print the benchctl version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
) -> None:
    """Benchmark and compare language-model architectures fairly: train, sample, judge, evaluate, report."""


def _load_commands() -> None:
    """Every command: the stages' own (`benchctl/stages/<name>/cli.py`) and those that are not a stage
    (`benchctl/commands/`)."""
    import benchctl.commands as commands
    import benchctl.stages as stages

    for mod in pkgutil.iter_modules(stages.__path__):
        if mod.ispkg and (Path(stages.__path__[0]) / mod.name / "cli.py").exists():
            importlib.import_module(f"benchctl.stages.{mod.name}.cli")
    for mod in pkgutil.iter_modules(commands.__path__):
        importlib.import_module(f"benchctl.commands.{mod.name}")


_load_commands()


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="benchctl", standalone_mode=True)
    except BenchctlError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted; rerun the same command to resume", highlight=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
