"""The depth curriculum (`train.recur_curriculum`): the recurrence grows from 1 to the trained depth early in training.

Retrofitted-recurrence training heals a converted model by raising its recurrence over the first part of training
(by default the first quarter of the steps) instead of running it at full depth from the first step, which saves
compute while the model is still far from its final loss. Progress x = step / (frac * max_steps), capped at 1, sets
the depth 1 + (R - 1) * ramp(x), with ramp(x) = x (`linear`) or 1 - sqrt(1 - x) (`1-sqrt`, which stays shallow
longer and rises fastest at the end).

- Looped models (FraiLT, relaxed) and three-part at a fixed depth run an integer number of passes: the depth rounded
  to the nearest integer (1, 2, ..., R).
- Three-part with Huginn's sampled depth keeps sampling, with the scheduled depth as the mean r_bar of its
  Poisson-lognormal (it samples r = Poisson(tau) + 1 with E[tau] = r_bar, where r_bar is its `args.n_recur`); during
  the step the model's args carry the scheduled r_bar, restored afterwards so evaluation runs at the trained depth.

FLOPs spent in a step are the tokens of the step times the model's training FLOPs per token at that step's depth (for
sampled depth, the expectation over the depth distribution at that step's r_bar), so a run's compute is the sum over
its steps, not max_steps times the full-depth cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn


def enabled(cfg: Any) -> bool:
    return cfg.train.recur_curriculum != "none"


def depth_at(step: int, cfg: Any) -> float:
    """The scheduled (mean) recurrence at optimizer step `step` (0-based): 1 at the start, R from the ramp's end."""
    t, R = cfg.train, cfg.model.n_recur
    if t.recur_curriculum == "none" or R <= 1:
        return float(R)
    ramp_steps = t.recur_curriculum_frac * t.max_steps
    x = min(1.0, step / ramp_steps) if ramp_steps > 0 else 1.0
    frac = x if t.recur_curriculum == "linear" else 1.0 - math.sqrt(1.0 - x)
    return 1.0 + (R - 1) * frac


def passes_at(step: int, cfg: Any) -> int:
    """The integer passes at `step`: the scheduled depth rounded half up, between 1 and R."""
    return max(1, min(cfg.model.n_recur, math.floor(depth_at(step, cfg) + 0.5)))


def samples_depth(model: nn.Module) -> bool:
    """True for a model that draws its own training depth around a mean (three-part's Poisson-lognormal)."""
    own = getattr(model, "arch_args", None)
    return getattr(own, "recur_sampling", "fixed") == "poisson-lognormal" and hasattr(model, "sample_n_recur")


@contextmanager
def at_step(model: nn.Module, step: int, cfg: Any) -> Iterator[int | None]:
    """Run one training step at the curriculum's depth: yields the `n_recur` to pass to the forward (None = the
    model's own), and for a depth-sampling model sets its mean depth for the duration of the step."""
    if not enabled(cfg):
        yield None
        return
    if not samples_depth(model):
        yield passes_at(step, cfg)
        return
    args = model.args
    model.args = dataclasses.replace(args, n_recur=depth_at(step, cfg))
    try:
        yield None
    finally:
        model.args = args


def step_flops(model: nn.Module, step: int, cfg: Any) -> float:
    """Training FLOPs of optimizer step `step` at its scheduled depth (all micro-batches, all ranks)."""
    seq = cfg.train_seq_len
    with at_step(model, step, cfg) as n:
        per_token = model.flops_per_token(seq, n_recur=n)
    return float(per_token) * cfg.tokens_per_step


class FlopCounter:
    """Cumulative training FLOPs up to a step, kept incrementally (a resumed run recomputes its past once: the
    schedule depends on the step alone). Without a curriculum every step costs the same: the count is a product."""

    def __init__(self, model: nn.Module, cfg: Any, start_step: int = 0):
        self.model, self.cfg = model, cfg
        self.step = 0
        self.total = 0.0
        self.per_step = None if enabled(cfg) else step_flops(model, 0, cfg)
        self.advance_to(start_step)

    def advance_to(self, step: int) -> float:
        """The FLOPs of steps 0..step-1 (what has been spent once `step` optimizer steps are done)."""
        if self.per_step is not None:
            self.step = max(self.step, step)
            self.total = self.per_step * self.step
            return self.total
        while self.step < step:
            self.total += step_flops(self.model, self.step, self.cfg)
            self.step += 1
        return self.total
