"""Not a command: how commands let the engine ask the user a yes/no question (e.g. before hours of training).

The engine takes a `confirm(question) -> bool` callback and never touches the terminal; this builds it.
"""

from __future__ import annotations

import sys
from typing import Callable

import typer


def terminal_confirm() -> Callable[[str], bool] | None:
    """Ask on the terminal (default no) when stdin is one; None when it is not, so the engine asks for --yes."""
    if not sys.stdin.isatty():
        return None
    return lambda question: typer.confirm(question, default=False)
