"""The model zoo: a tiny registry of architectures, each one file over the shared base.

    import architectures
    model = architectures.build("three-part", model_args)
    architectures.names()  # ['control', 'frailt', 'three-part', 'relaxed']

To add an architecture, drop one file in this folder that subclasses `BaseLM` and decorates it with
`@register("my-arch")`; every module here is imported at start-up, and the tests parametrised over `names()`
pick it up. Plain PyTorch, no I/O, no knowledge of benchctl.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Callable, TypeVar

from architectures.base import BaseLM, RecurrenceError

__all__ = ["BaseLM", "RecurrenceError", "UnknownArchitectureError", "register", "build", "get", "names"]

_REGISTRY: dict[str, type[BaseLM]] = {}
# The study's four first, in the order tables and figures use; later registrations follow.
_ORDER = ["control", "frailt", "three-part", "relaxed"]

T = TypeVar("T", bound=type[BaseLM])


class UnknownArchitectureError(KeyError):
    def __init__(self, name: str):
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        self.message = f"unknown architecture '{name}'{hint} available: {', '.join(names())}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make an architecture buildable by name. Registering a name twice is an error."""

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"architecture '{name}' is already registered by {_REGISTRY[name].__module__}")
        if not (isinstance(cls, type) and issubclass(cls, BaseLM)):
            raise TypeError(f"@register('{name}') expects a BaseLM subclass, got {cls!r}")
        cls.name = name
        cls.label = cls.label or name
        _REGISTRY[name] = cls
        return cls

    return deco


def names() -> list[str]:
    return [n for n in _ORDER if n in _REGISTRY] + sorted(n for n in _REGISTRY if n not in _ORDER)


def get(name: str) -> type[BaseLM]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownArchitectureError(name) from None


def build(name: str, args: Any) -> BaseLM:
    return get(name)(args)


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in ("base", "blocks") and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_discover()
