"""Shared pytest fixtures for the benchctl suite.

- one torch thread per test process (the CI box has 2 cores shared by several jobs; tiny models gain nothing from
  intra-op threads and lose a lot to contention);
- `tiny_args(arch, **overrides)`: the resolved `ModelArgs` of the `tiny` preset for an architecture, with dotted-free
  model overrides (`tiny_args("three-part", state_init_std=0.0)`), validated by the real config layer;
- `tiny_model(arch, seed=0, **overrides)`: that model built under a fixed seed, in eval mode, float32, CPU;
- tests marked `cuda` are skipped on a machine without a CUDA GPU; every other test runs with CUDA hidden
  (`torch.cuda.is_available()` False, no devices, `CUDA_VISIBLE_DEVICES=""` for its subprocesses), so on a GPU
  machine unmarked tests still compute on the CPU they assert facts about.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import architectures
from benchctl.core.config import ModelArgs, make_config

# The stages benchctl ships, in study order. Tests that pin a list of stages (or their tables and figures) pin these:
# CI runs the suite a second time with the extension guide's example stage added, which must change nothing else.
BUILTIN_STAGES = (
    "prepare",
    "train",
    "bench",
    "retrofit",
    "sample",
    "judge",
    "eval",
    "accuracy",
    "depth",
    "infer",
    "report",
    "export",
)


def pytest_collection_modifyitems(config, items):
    # The `registry` mark: tests that list a registry, found in their syntax tree (tests/registry_marks.py says how);
    # CI's second pass, with the extension examples in the tree, runs these.
    from registry_marks import reads_registry

    for item in items:
        name = getattr(item, "originalname", None)
        if name is not None and reads_registry(item.path, name, list(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.registry)
    _leave_out_the_cases_that_already_ran(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _hide_cuda(request, monkeypatch):
    """Unmarked tests see no GPU: `train.device=auto` resolves to the CPU in this process and in the subprocesses it
    starts (the empty CUDA_VISIBLE_DEVICES is inherited), so a GPU machine runs the same suite as a CPU one."""
    if "cuda" in request.keywords:
        yield
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_tiny_args(arch: str, **overrides: Any) -> ModelArgs:
    """Resolved tiny-preset model args for `arch`; keyword overrides go through `--set model.<key>=<value>`."""
    cfg = make_config("tiny", arch, overrides={f"model.{k}": v for k, v in overrides.items()})
    return cfg.model


def make_tiny_model(arch: str, seed: int = 0, **overrides: Any) -> architectures.BaseLM:
    torch.manual_seed(seed)
    return architectures.build(arch, make_tiny_args(arch, **overrides)).eval()


@pytest.fixture
def tiny_args() -> Callable[..., ModelArgs]:
    return make_tiny_args


@pytest.fixture
def tiny_model() -> Callable[..., architectures.BaseLM]:
    return make_tiny_model


# ---- data ----------------------------------------------------------------------------------------------------------


_NAMES = ["Lily", "Tom", "Ben", "Mia", "Sam", "Anna", "Max", "Lucy", "Tim", "Sue", "Jack", "Zoe"]
_THINGS = ["ball", "kite", "cake", "dog", "cat", "tree", "box", "car", "hat", "boat", "flower", "bird", "toy", "book"]
_PLACES = ["park", "garden", "house", "forest", "beach", "school", "river", "hill", "shop", "farm"]
_FEEL = ["happy", "sad", "scared", "excited", "tired", "angry", "proud", "curious"]
_VERBS = ["found", "lost", "shared", "painted", "hugged", "chased", "fixed", "opened", "carried", "hid"]


def synthetic_stories(n: int, seed: int) -> list[str]:
    """Simple TinyStories-like text for machines without the real sample (varied enough for a 512-piece BPE)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, friend = rng.sample(_NAMES, 2)
        thing, place, feel, verb = rng.choice(_THINGS), rng.choice(_PLACES), rng.choice(_FEEL), rng.choice(_VERBS)
        n_sent = rng.randint(3, 7)
        sents = [f"Once upon a time, there was a little {rng.choice(['girl', 'boy'])} named {name}."]
        for _ in range(n_sent):
            sents.append(
                rng.choice(
                    [
                        f"{name} went to the {place} with {friend}.",
                        f"One day, {name} {verb} a {rng.choice(_FEEL)} {thing} near the {rng.choice(_PLACES)}.",
                        f'{friend} said, "Can we play with the {thing}?"',
                        f"{name} felt {feel} and smiled at {friend}.",
                        f"They {rng.choice(_VERBS)} the {rng.choice(_THINGS)} together {rng.randint(2, 9)} times.",
                    ]
                )
            )
        sents.append(f"In the end, {name} and {friend} were {rng.choice(_FEEL)}.")
        out.append(" ".join(sents))
    return out


# Resolved once, where pytest starts: tests change directory, and a relative path would then name another place.
_TEST_DATA = os.environ.get("BENCHCTL_TEST_DATA")
TEST_DATA = Path(_TEST_DATA).resolve() if _TEST_DATA else None


def real_tinystories() -> Path | None:
    """The directory $BENCHCTL_TEST_DATA names, when it holds both splits."""
    if TEST_DATA is not None and (TEST_DATA / "train.txt").is_file() and (TEST_DATA / "valid.txt").is_file():
        return TEST_DATA
    return None


@pytest.fixture(scope="session")
def tinystories_dir(tmp_path_factory) -> Path:
    """Real TinyStories text from $BENCHCTL_TEST_DATA (a directory with train.txt/valid.txt), else a synthetic
    sample."""
    real = real_tinystories()
    if real is not None:
        return real
    d = tmp_path_factory.mktemp("synthetic_tinystories")
    for split, n, seed in (("train", 2500, 0), ("valid", 500, 1)):
        (d / f"{split}.txt").write_text("".join(f"{s}\n<|endoftext|>\n" for s in synthetic_stories(n, seed)))
    return d


def _leave_out_the_cases_that_already_ran(config, items) -> None:
    """CI's pass with the extension examples in the tree (`.ci/run`) sets $BENCHCTL_TESTS_NAMES_BEFORE to the
    registries' names before the examples were added: a test that lists a registry only in its parametrize
    arguments ran each of those names' cases in the first pass, on the same code, so this pass runs only the cases
    of the names the examples added (and every test that lists a registry in its own code or fixtures)."""
    before = os.environ.get("BENCHCTL_TESTS_NAMES_BEFORE")
    if not before:
        return
    from registry_marks import reads_registry_beyond_parameters

    names = set(json.loads(before))
    keep, ran = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        name = getattr(item, "originalname", None)
        old = spec is not None and any(isinstance(v, str) and v in names for v in spec.params.values())
        argnames = [] if spec is None else [a for m in item.iter_markers("parametrize") for a in _argnames(m)]
        if (
            old
            and name is not None
            and item.get_closest_marker("registry") is not None
            and not reads_registry_beyond_parameters(item.path, name, list(item.fixturenames), argnames)
        ):
            ran.append(item)
        else:
            keep.append(item)
    if ran:
        config.hook.pytest_deselected(items=ran)
        items[:] = keep


def _argnames(mark) -> list[str]:
    names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
    if isinstance(names, str):
        return [n.strip() for n in names.split(",") if n.strip()]
    return list(names)
