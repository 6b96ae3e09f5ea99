"""The model zoo: a tiny registry of architectures, each one file over the shared base.

    import architectures
    model = architectures.build("three-part", model_args)
    architectures.names()  # ['control', 'frailt', 'three-part', 'relaxed']

To add an architecture, drop one file in this folder that subclasses `BaseLM` and decorates it with
`@register("my-arch", args=MyArgs)`, where `MyArgs` is the architecture's own frozen dataclass of arguments
(a subclass of `ArchArgs`; leave `args` out when there are none). The class and its arguments travel together, so
the config layer learns the architecture's keys from the registry and never lists them itself. Every module here is
imported at start-up, and the tests parametrised over `names()` pick the new file up. Plain PyTorch, no I/O, no
knowledge of benchctl.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from architectures.base import ArchArgs, BaseLM, RecurrenceError

__all__ = [
    "ArchArgs",
    "BaseLM",
    "RecurrenceError",
    "UnknownArchitectureError",
    "register",
    "build",
    "build_shapes",
    "get",
    "names",
    "did_you_mean",
]

_REGISTRY: dict[str, type[BaseLM]] = {}
# The study's four first, in the order tables and figures use; later registrations follow.
_ORDER = ["control", "frailt", "three-part", "relaxed"]

T = TypeVar("T", bound=type[BaseLM])


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest option to a mistyped word, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


class UnknownArchitectureError(KeyError):
    def __init__(self, name: str):
        self.message = f"unknown architecture '{name}'{did_you_mean(name, names())} available: {', '.join(names())}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def register(name: str, args: type[ArchArgs] | None = None) -> Callable[[T], T]:
    """Class decorator: make an architecture buildable by name, with `args` its own frozen arguments dataclass.

    Registering a name twice is an error, and so is an `args` that is not a frozen `ArchArgs` dataclass (the
    config must stay immutable and hashable once resolved).
    """
    args_cls = ArchArgs if args is None else args
    if not (
        isinstance(args_cls, type)
        and issubclass(args_cls, ArchArgs)
        and dataclasses.is_dataclass(args_cls)
        and getattr(args_cls, "__dataclass_params__").frozen  # noqa: B009 (not in the dataclass type's stubs)
    ):
        raise TypeError(f"@register('{name}', args=...) expects a frozen ArchArgs dataclass, got {args!r}")

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"architecture '{name}' is already registered by {_REGISTRY[name].__module__}")
        if not (isinstance(cls, type) and issubclass(cls, BaseLM)):
            raise TypeError(f"@register('{name}') expects a BaseLM subclass, got {cls!r}")
        cls.name = name
        cls.label = cls.label or name
        cls.args_cls = args_cls
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


def build_shapes(name: str, args: Any) -> BaseLM:
    """The model with its parameters allocated but never initialised: for its shapes, parameter counts, FLOPs and
    resolved arguments. Reports and estimates count every model of a grid this way. Not on the meta device: there
    every op of a constructor (torch's layers initialise themselves, the rotary tables are computed) runs as a Python
    decomposition that first imports the compiler, about 0.1 s per model and seconds per process; on the CPU the
    allocations are a few milliseconds, and pages that are never written take no memory."""
    with torch.device("cpu"), _SkipInit():
        return build(name, args)


class _SkipInit(TorchFunctionMode):
    """Returns the tensor untouched from `torch.nn.init`'s functions, and zeros it for the random fills that code
    below that API draws (`trunc_normal_` reaches `normal_` directly, then redraws until every value is in bounds:
    on never-written memory that loop need not end). A mode, not a patch of `torch.nn.init`: it is active in this
    thread only, inside `build_shapes`."""

    _FILLS = frozenset(
        getattr(torch.Tensor, f)
        for f in ("normal_", "uniform_", "exponential_", "bernoulli_", "random_", "log_normal_", "cauchy_")
    )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        if func in self._FILLS:
            return args[0].zero_()
        return func(*args, **kwargs)


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in ("base", "blocks", "kernels", "generate", "inference") and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_discover()
