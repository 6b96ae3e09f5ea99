"""Procedural reasoning tasks: a tiny registry of problem generators, each one file over the shared base.

    import tasks
    task = tasks.build("addition")            # the task's default knobs
    task.problem("train", "id", seed=0, index=0)
    # Problem(prompt='9259300000+9416170000=', answer='87655700000', difficulty={'digits': 6})
    tasks.names()  # ['phop', 'addition', 'sum', 'parity', 'maze']

Each task trains a small character-level transformer on its in-distribution level and measures it on harder ones
(more digits, hops, operands, bits, a bigger maze), so accuracy against difficulty shows which architectures learned
an algorithm that extends with depth. Problems are a pure function of (task, args, split, level, seed, index), and
a prompt's split is a function of its text, so held-out problems never reach training (see `tasks.base`).

To add a task, drop one file in this folder that subclasses `Task` and decorates it with
`@register("my-task", args=MyArgs)`, where `MyArgs` is the task's own frozen dataclass of knobs (a subclass of
`TaskArgs`; leave `args` out when there are none). Every module here except `base` and those starting with "_" is
imported at start-up, and the tests parametrised over `names()` pick the new file up. Plain Python (the standard
library only), no I/O, no knowledge of benchctl.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import TypeVar

from tasks.base import (
    IGNORE_INDEX,
    SPLITS,
    CharTokenizer,
    Level,
    Problem,
    Task,
    TaskArgs,
    TaskError,
    masked_targets,
)

__all__ = [
    "IGNORE_INDEX",
    "SPLITS",
    "CharTokenizer",
    "Level",
    "Problem",
    "Task",
    "TaskArgs",
    "TaskError",
    "UnknownTaskError",
    "masked_targets",
    "register",
    "build",
    "get",
    "names",
    "did_you_mean",
]

_REGISTRY: dict[str, type[Task]] = {}
# The study's five first, in the order tables and figures use; later registrations follow, sorted.
_ORDER = ["phop", "addition", "sum", "parity", "maze"]

T = TypeVar("T", bound=type[Task])


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest option to a mistyped word, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


class UnknownTaskError(TaskError, KeyError):
    """A task name that is not registered (a TaskError, and a KeyError like a missing registry entry)."""

    def __init__(self, name: str):
        self.message = f"unknown task '{name}'{did_you_mean(name, names())} available: {', '.join(names())}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def register(name: str, args: type[TaskArgs] | None = None) -> Callable[[T], T]:
    """Class decorator: make a task buildable by name, with `args` its own frozen knobs dataclass.

    Registering a name twice is an error, and so is an `args` that is not a frozen `TaskArgs` dataclass (the knobs
    are hashed into every problem's seed and must not change under it).
    """
    args_cls = TaskArgs if args is None else args
    if not (
        isinstance(args_cls, type)
        and issubclass(args_cls, TaskArgs)
        and dataclasses.is_dataclass(args_cls)
        and getattr(args_cls, "__dataclass_params__").frozen  # noqa: B009 (not in the dataclass type's stubs)
    ):
        raise TypeError(f"@register('{name}', args=...) expects a frozen TaskArgs dataclass, got {args!r}")

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task '{name}' is already registered by {_REGISTRY[name].__module__}")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"@register('{name}') expects a Task subclass, got {cls!r}")
        if not cls.symbols or len(set(cls.symbols)) != len(cls.symbols):
            raise TypeError(f"task '{name}': symbols must be a non-empty string of distinct characters")
        if not cls.description or not cls.source:
            raise TypeError(f"task '{name}': set its one-line description and the source paper(s)")
        cls.name = name
        cls.label = cls.label or name
        cls.args_cls = args_cls
        _REGISTRY[name] = cls
        return cls

    return deco


def _unregister(name: str) -> None:
    """Remove a task registered at run time (tests only)."""
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return [n for n in _ORDER if n in _REGISTRY] + sorted(n for n in _REGISTRY if n not in _ORDER)


def get(name: str) -> type[Task]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTaskError(name) from None


def build(name: str, args: TaskArgs | None = None) -> Task:
    """The task `name` with knobs `args` (its args dataclass's defaults when None)."""
    cls = get(name)
    return cls(cls.args_cls() if args is None else args)


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "base" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_discover()
