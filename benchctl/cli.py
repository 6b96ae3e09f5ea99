"""The `benchctl` command line (Typer): the root command, every command module gathered under it, and `main`.

Each command is one small function in a command module, a stage's `benchctl/stages/<name>/cli.py` or one of
`benchctl/commands/`: parse options, build a config, call one engine function, print. A command module declares its
commands on its own Typer (`app`) and takes the options it shares with others from benchctl.stages.cli; this module
gathers them. Expected failures (`BenchctlError`) are caught once, in `main()`, and printed as one line with a
non-zero exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import copy
import errno
import importlib
import inspect
import pkgutil
import re
import signal
import sqlite3
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer
import typer.main
from rich.text import Text
from typer import _click as click
from typer.core import TyperGroup

import benchctl.commands as commands
import benchctl.stages as stages
from benchctl import __version__
from benchctl.core.errors import (
    BenchctlError,
    ConfigError,
    OutputError,
    Terminated,
    output_error,
    raise_terminated,
)
from benchctl.stages.cli import console, err_console

INTRO = (
    "Compare language-model architectures fairly. New here? Start with 'benchctl study' (a whole comparison), "
    "then 'benchctl runs' and 'benchctl report'."
)
# The commands the intro names, listed first; then the stages' commands in study order, then the rest (TOOLS).
START = ("study", "runs", "report")
TOOLS = ("plans", "tasks", "params", "browse", "share", "export", "lm-eval")


def first_sentence(text: str) -> str:
    """A command's help up to the end of its first sentence: what the command list shows of a command without a
    short help of its own, whole (click's default cuts it at a width, with '...')."""
    paragraph = " ".join(inspect.cleandoc(text).split("\n\n", 1)[0].split())
    for i, ch in enumerate(paragraph):
        if ch == "." and (i + 1 == len(paragraph) or paragraph[i + 1] == " "):
            return paragraph[: i + 1]
    return paragraph


class RootGroup(TyperGroup):
    """The root's help: the intro, then the commands in three sections (where to start, the study's stages in study
    order, the other tools), each with its short help whole."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        for command in self.commands.values():
            if not command.short_help and command.help:
                command.short_help = first_sentence(command.help)

    def sections(self) -> list[tuple[str, list[str]]]:
        """(title, command names) of the help's command list."""
        names = [n for n, c in self.commands.items() if not c.hidden]
        order = {d.folder: d.order for d in stages.declared()}

        def stage_of(name: str) -> int | None:
            parts = _MODULE_OF.get(name, "").split(".")
            folder = parts[2] if parts[:2] == ["benchctl", "stages"] and len(parts) > 2 else None
            return order.get(folder) if folder else None

        start = [n for n in START if n in names]
        staged = sorted((n for n in names if n not in start and stage_of(n) is not None), key=lambda n: stage_of(n))
        rest = [n for n in names if n not in start and n not in staged]
        rest.sort(key=lambda n: (TOOLS.index(n) if n in TOOLS else len(TOOLS), n))
        return [
            ("Start here", start),
            ("The study's stages, each a command of its own", staged),
            ("More", rest),
        ]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [n for _, names in self.sections() for n in names]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = [(title, names) for title, names in self.sections() if names]
        width = max(len(n) for _, names in sections for n in names)
        for title, names in sections:
            with formatter.section(title):
                # the names padded alike, so that the three lists share one column
                formatter.write_dl([(n.ljust(width), self.commands[n].get_short_help_str(limit=10**6)) for n in names])


app = typer.Typer(
    name="benchctl",
    cls=RootGroup,
    help=INTRO,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        console.print(f"benchctl {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    # eager, handled while the options are parsed: the group's own body runs only before a command, and
    # `benchctl --version` has none
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the benchctl version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """Compare language-model architectures fairly."""  # the root's help is INTRO, given to the Typer above


def command_modules() -> list[ModuleType]:
    """Every command module: the stages' own (`benchctl/stages/<name>/cli.py`) and those that are not a stage
    (`benchctl/commands/`)."""
    found = [
        importlib.import_module(f"benchctl.stages.{mod.name}.cli")
        for mod in pkgutil.iter_modules(stages.__path__)
        if mod.ispkg and (Path(stages.__path__[0]) / mod.name / "cli.py").exists()
    ]
    return found + [
        importlib.import_module(f"benchctl.commands.{mod.name}") for mod in pkgutil.iter_modules(commands.__path__)
    ]


# command (or group) name -> the module that declares it: how the help tells a stage's commands from the others
_MODULE_OF: dict[str, str] = {}


def _name_of(command: Any) -> str:
    """The name a Typer command is called by (its function's name, dashed, unless it was given one)."""
    return command.name or typer.main.get_command_name(getattr(command.callback, "__name__", ""))


def _gather() -> None:
    """Put every command module's commands (and command groups, e.g. `plans`) under the root."""
    for module in command_modules():
        app.registered_commands += module.app.registered_commands
        app.registered_groups += module.app.registered_groups
        for command in module.app.registered_commands:
            _MODULE_OF[_name_of(command)] = module.__name__
        for group in module.app.registered_groups:
            _MODULE_OF[group.name] = module.__name__


_gather()


def _app_for(argv: list[str]) -> typer.Typer:
    """The root with only the command `argv` starts with, when it names one (else the root itself): Typer turns every
    command it holds into a click command, options and all, on each call, and a command needs only its own. Help, a
    typo and the root's own options still go to the whole root."""
    name = argv[0] if argv else ""
    commands = [c for c in app.registered_commands if _name_of(c) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    one = copy.copy(app)
    one.registered_commands, one.registered_groups = commands, groups
    return one


_NO_MEMORY = ("can't allocate memory", "out of memory", "Storage size calculation overflowed")


def _out_of_memory(e: BaseException) -> str | None:
    """One line for an allocation this machine cannot make (a batch or a model far too large for it), or None for
    any other error. Torch reports it as a RuntimeError (CUDA's OutOfMemoryError is one) with C++ context around it."""
    text = str(e)
    if not isinstance(e, MemoryError) and not any(s in text for s in _NO_MEMORY):
        return None
    asked = re.search(r"allocate (\d+) bytes", text)
    size = f" ({int(asked.group(1)) / 2**30:,.1f} GiB at once)" if asked else ""
    return (
        f"not enough memory for this configuration{size}; lower train.batch_size or the model's size "
        "(model.dim, model.n_layers, ...), or run fewer --jobs at once"
    )


def _cannot_write(e: BaseException) -> OutputError | None:
    """A full disk or a read-only destination met by a command that has no narrower handling for it (SQLite writing
    results.db, a report's file) as one line, or None for any other error. SQLite rolls a failed transaction back,
    so the database keeps its last committed state: rerunning resumes."""
    if isinstance(e, sqlite3.OperationalError):
        text = str(e)
        if "disk is full" in text:
            return OutputError(
                "cannot write the results database: the disk is full; it keeps everything stored "
                "before this; free some space and rerun the command to resume"
            )
        if "readonly database" in text:
            return OutputError("cannot write the results database: it (or its directory) is read-only")
        return None
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return output_error(e.filename or "a file", e, staged=False)
    return None


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_of(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception was raised while handling (itself included), if any."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _print_error(message: str) -> None:
    """`error: MESSAGE` on stderr, the message as plain text: square brackets in it (a plan's `[[variant]]`, a
    list) are shown as written, never read as console markup."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    # SIGTERM unwinds like Ctrl-C, so whatever is running records how it stopped (a run: interrupted)
    previous = (
        signal.signal(signal.SIGTERM, raise_terminated)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        _app_for(sys.argv[1:] if argv is None else argv)(args=argv, prog_name="benchctl", standalone_mode=True)
    except BenchctlError as e:
        _print_error(str(e))
        sys.exit(e.exit_code)
    except (OSError, sqlite3.OperationalError) as e:
        short = _cannot_write(e)
        if short is None:
            raise
        _print_error(str(short))
        sys.exit(short.exit_code)
    except (MemoryError, RuntimeError) as e:
        short = _out_of_memory(e)
        if short is None:
            raise
        _print_error(short)
        sys.exit(ConfigError.exit_code)
    except (KeyboardInterrupt, SystemExit) as e:
        # Typer turns an interrupt inside a command into a silent exit 130: the interrupt is found in its context
        interrupt = _interrupt_of(e)
        if interrupt is None:
            raise
        _ignore_signals()  # a second Ctrl-C or SIGTERM while this is printed would end in a traceback
        what = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
        err_console.print(f"{what}; rerun the same command to resume", highlight=False)
        sys.exit(128 + signal.SIGTERM if isinstance(interrupt, Terminated) else 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
