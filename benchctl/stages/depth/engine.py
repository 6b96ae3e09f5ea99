"""Test-time recurrence: validation loss of finished runs against inference depth, and with the adaptive exit.

Depth changes after training: a recurrent model can run fewer or more iterations than it was trained with, and with
an adaptive exit each token can stop on its own. For every finished run this measures, per setting:

- a fixed depth d (`--depths`): the loss at d iterations. Past the trained depth FraiLT and relaxed follow their
  extrapolation rule (`--extrapolate`, else the architecture's default: FraiLT `last`, relaxed `cycle`); three-part
  runs any depth as it is. An architecture without the iteration hooks runs the depths its forward accepts, from 1 to
  its `max_n_recur` (ut-act and mor: their trained depth, the most steps their halting or routing can give a token;
  the row's depth is that maximum, its FLOPs the analytic count there, an upper bound); one that accepts one depth
  only (the control) gets one row, which the report draws as a horizontal reference line.
- an exit setting (`--exit kl|latent --thresholds ...`): the loss with the per-token adaptive exit
  (`architectures.base.BaseLM.iterate`) at maximum depth `--max-depth` (default: the run's trained depth), and the
  mean exit depth over tokens. Every iteration is still computed for every token, so the mean depth is what an
  implementation that skips exited tokens would spend; FLOPs/token for these rows are the model's forward FLOPs at
  that mean depth (linear between integer depths; the exit check's extra head/coda passes not counted).

The loss is measured on the first `--windows` N of the run's own fixed validation windows (the set `train` evaluates
on, same seed; all of them by default), in eval mode, under `torch.no_grad()`, with the run's autocast rule, and
with the torch RNG seeded from the run's `eval.val_seed` (three-part draws its random initial state from it), so a
row is reproducible and the trained-depth row equals the run's final validation loss when all windows are used.

Rows go to `depth_results`, one per (run, depth, exit rule, threshold, extrapolation rule, windows), each written as
soon as it is measured: a rerun skips what is stored, and a killed run keeps what it finished.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import architectures
from architectures.base import ExitRule
from benchctl.core import checkpoint, data
from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError, EvalError
from benchctl.core.progress import Progress, as_progress, confirm_long, inference_seconds, silent
from benchctl.core.runtime import autocast_dtype, resolve_device
from benchctl.stages.depth import tables as depth_tables
from benchctl.stages.depth.options import DEFAULT_DEPTHS, DepthOptions
from benchctl.stages.train import tables as train_tables


@dataclass(frozen=True, order=True)
class Setting:
    """One measurement of a run: fixed depth (exit_rule "") or an adaptive exit with n_recur the maximum depth."""

    n_recur: int
    exit_rule: str = ""
    threshold: float = 0.0
    extrapolate: str = ""

    @property
    def label(self) -> str:
        if not self.exit_rule:
            return f"depth {self.n_recur}"
        return f"{self.exit_rule} < {self.threshold:g} (max {self.n_recur})"


@dataclass
class DepthSummary:
    rows: list[dict[str, Any]] = field(default_factory=list)  # measured by this call
    skipped: int = 0  # already stored
    seconds: float = 0.0


def settings_for(
    arch_cls: Any,
    trained: int,
    *,
    depths: Sequence[int],
    exit_rule: str | None,
    thresholds: Sequence[float],
    max_depth: int | None,
    extrapolate: str | None,
    with_trained: bool = False,
    limit: int | None = None,
) -> list[Setting]:
    """The settings to measure for one run of `arch_cls` trained at depth `trained`; `with_trained` adds the trained
    depth and twice it to the depths (the report judges extrapolation from those two). `limit` is the deepest
    recurrence the run's model accepts (its `max_n_recur`; None: unbounded)."""
    if not arch_cls.iterable():
        # no iteration hooks, so no exit; its forward still runs any depth from 1 to its limit (ut-act's and mor's
        # largest number of steps, halting or routing choosing each token's depth below it): those are swept, and
        # a model that runs one depth only (the control) gets one reference row
        if exit_rule is not None:
            return []
        ds = set(depths) | ({trained, 2 * trained} if with_trained else set())
        return [Setting(d) for d in sorted({d for d in ds if limit is None or d <= limit} | {trained})]
    if extrapolate is not None and arch_cls.extrapolate_rules and extrapolate not in arch_cls.extrapolate_rules:
        raise ConfigError(
            f"--extrapolate: {arch_cls.name} accepts {', '.join(arch_cls.extrapolate_rules)}; got {extrapolate!r}"
        )
    rule = arch_cls.resolve_extrapolate(extrapolate) if arch_cls.extrapolate_rules else None
    ext = rule or ""
    if exit_rule is None:
        ds = sorted(set(depths) | ({trained, 2 * trained} if with_trained else set()))
        return [Setting(d, "", 0.0, ext) for d in ds]
    return [Setting(max_depth or trained, exit_rule, float(t), ext) for t in thresholds]


def flops_at(model: Any, depth: float) -> float:
    """Forward FLOPs/token at a (possibly fractional) mean depth, linear between the neighbouring integer depths."""
    lo = max(1, math.floor(depth))
    f_lo = model.flops_per_token(training=False, n_recur=lo)
    if depth == lo:
        return f_lo
    return f_lo + (depth - lo) * (model.flops_per_token(training=False, n_recur=lo + 1) - f_lo)


def measure(model: Any, windows: Any, batch_size: int, device: Any, amp: Any, seed: int, s: Setting) -> dict[str, Any]:
    """Loss, exit-depth histogram and timing of one setting over the windows (N, T+1)."""
    model.eval()
    rule = ExitRule(s.exit_rule, s.threshold) if s.exit_rule else None
    total, count = 0.0, 0
    hist: dict[int, int] = {}
    devices = [device] if device.type == "cuda" else []
    t0 = time.perf_counter()
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for i in range(0, len(windows), batch_size):
            w = windows[i : i + batch_size].to(device)
            x, y = w[:, :-1], w[:, 1:]
            with torch.autocast(device.type, dtype=amp) if amp else nullcontext():
                if rule is None:
                    kw = {"extrapolate": s.extrapolate} if s.extrapolate else {}
                    _, loss = model(x, y, n_recur=s.n_recur, return_logits=False, **kw)
                    depths = {s.n_recur: y.numel()}
                else:
                    out = model.iterate(
                        x, y, n_recur=s.n_recur, return_logits=False, extrapolate=s.extrapolate or None, exit=rule
                    )
                    loss = out.loss
                    vals, counts = torch.unique(out.depths, return_counts=True)
                    depths = dict(zip(vals.tolist(), counts.tolist()))
            total += float(loss.double()) * y.numel()
            count += y.numel()
            for d, c in depths.items():
                hist[int(d)] = hist.get(int(d), 0) + int(c)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    mean_depth = sum(d * c for d, c in hist.items()) / count
    return {
        "val_loss": total / count,
        "mean_depth": mean_depth,
        "tokens": count,
        "seconds": seconds,
        "depth_hist": json.dumps({str(d): hist[d] for d in sorted(hist)}),
    }


@dataclass
class _RunPlan:
    row: dict[str, Any]
    cfg: Any
    settings: list[Setting]  # still to measure
    windows: Any
    n_windows: int


def plan(
    db,
    rows: list[dict[str, Any]],
    *,
    depths: Sequence[int],
    exit_rule: str | None,
    thresholds: Sequence[float],
    max_depth: int | None,
    extrapolate: str | None,
    windows: int | None,
    progress: bool = False,
    with_trained: bool = False,
) -> tuple[list[_RunPlan], int]:
    """Settings still to measure per run (every check done before any work), and how many are already stored."""
    plans, skipped, prepared_by_key = [], 0, {}
    for row in rows:
        cfg = RunConfig.from_json(row["config_json"])
        cls = architectures.get(cfg.arch)
        settings = settings_for(
            cls,
            int(cfg.model.n_recur),
            depths=depths,
            exit_rule=exit_rule,
            thresholds=thresholds,
            max_depth=max_depth,
            extrapolate=extrapolate,
            with_trained=with_trained,
            limit=cls.max_n_recur(cfg.model),
        )
        n = min(windows or cfg.eval.val_windows, cfg.eval.val_windows)
        have = depth_tables.depth_keys(db, row["id"])
        todo = [s for s in settings if (s.n_recur, s.exit_rule, s.threshold, s.extrapolate, n) not in have]
        skipped += len(settings) - len(todo)
        if not todo:
            continue
        prepared = data.prepared_for_run(
            prepared_by_key, row["id"], row.get("data_fingerprint"), cfg.data, cfg.model.vocab_size, progress=progress
        )
        win = data.val_windows(prepared.valid_tokens(), cfg.model.max_seq_len, cfg.eval.val_windows, cfg.eval.val_seed)[
            :n
        ]
        plans.append(_RunPlan(row, cfg, todo, win, n))
    return plans, skipped


def measure_run(db, db_path: Path, p: _RunPlan, device: Any, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Load one run's model and measure (and store) each of its missing settings."""
    model, cfg, _ = checkpoint.load_model(
        checkpoint.run_dir(db_path, p.row["id"]) / checkpoint.CKPT_NAME, device, p.row
    )
    amp = autocast_dtype(cfg, device)
    for s in p.settings:
        m = measure(model, p.windows, cfg.eval.val_batch_size, device, amp, cfg.eval.val_seed, s)
        flops = (
            flops_at(model, m["mean_depth"])
            if s.exit_rule
            else model.flops_per_token(training=False, n_recur=s.n_recur)
        )
        row = {
            "run_id": p.row["id"],
            "n_recur": s.n_recur,
            "exit_rule": s.exit_rule,
            "threshold": s.threshold,
            "extrapolate": s.extrapolate,
            "windows": p.n_windows,
            **m,
            "flops_per_token": flops,
        }
        depth_tables.record_depth_result(db, row)
        on_row({**row, "arch": p.row["arch"], "seed": p.row["seed"], "trained_n_recur": int(cfg.model.n_recur)})


def depth_all(
    db,
    db_path: str | Path,
    opts: DepthOptions,
    *,
    progress: bool | Progress = True,
    confirm: Callable[[str], bool] | None = None,
) -> DepthSummary:
    """Measure every finished run `opts` selects at every requested setting; stored rows are skipped (see the
    docstring). Without `opts.depths` the default sweep also takes each run's trained depth and twice it."""
    reporter = as_progress(progress)
    dev = resolve_device(opts.device, option="--device")
    sel = opts.select
    rows = train_tables.finished_runs(
        db,
        run_ids=sel.run_ids,
        archs=sel.archs,
        preset=sel.preset,
        none_left=EvalError,
        purpose="to measure",
        kind="stories",
    )
    plans, skipped = plan(
        db,
        rows,
        depths=opts.depths or opts.sweep,
        exit_rule=opts.exit_rule,
        thresholds=opts.thresholds,
        max_depth=opts.max_depth,
        extrapolate=opts.extrapolate,
        windows=opts.windows,
        progress=reporter.enabled,
        with_trained=opts.depths is None,
    )
    total = sum(len(p.settings) for p in plans)
    if total and (opts.depths is not None or opts.max_depth is not None):  # depths of the user's choosing: ask
        confirm_long(
            planned_seconds(plans),
            f"measuring {total} setting(s) up to depth {max(s.n_recur for p in plans for s in p.settings)}",
            yes=opts.yes,
            confirm=confirm,
        )
    summary = DepthSummary(skipped=skipped)
    bar = reporter.task("depth", total=total) if total else silent().task("depth")
    t0 = time.perf_counter()
    with bar:
        for p in plans:
            label = f"{p.row['arch']} s{p.row['seed']}"
            measure_run(
                db,
                Path(db_path),
                p,
                dev,
                on_row=lambda r, label=label: (summary.rows.append(r), bar.update(advance=1, description=label)),
            )
    summary.seconds = time.perf_counter() - t0
    return summary


def planned_seconds(plans: list[_RunPlan]) -> float:
    """About how long measuring `plans` takes, from the FLOPs of each setting's forwards over the run's windows at
    the rate its training reached (`benchctl.core.progress.inference_seconds`); no model is loaded. A rough figure,
    for the confirmation before long work (`estimate_seconds` times a real batch instead)."""
    total = 0.0
    for p in plans:
        model = architectures.build_shapes(p.cfg.arch, p.cfg.model)
        T = p.cfg.model.max_seq_len
        for s in p.settings:
            n = s.n_recur if model.iterable() else None
            total += inference_seconds(p.row, p.n_windows * T, model.flops_per_token(T, n, training=False))
    return total


def estimate_seconds(
    db, db_path: str | Path, run_ids: Sequence[str], *, depths: Sequence[int] = DEFAULT_DEPTHS, device: str = "auto"
) -> float:
    """Time one batch of one run at depth 1 and scale it to every run, depth and window batch of a default sweep.

    Cost grows linearly with depth for the recurrent part, so depth d is estimated as d times the depth-1 batch."""
    rows = train_tables.finished_runs(db, run_ids=run_ids, none_left=EvalError, purpose="to measure", kind="stories")
    dev = resolve_device(device, option="--device")
    plans, _ = plan(
        db,
        rows[:1],
        depths=[1],
        exit_rule=None,
        thresholds=[],
        max_depth=None,
        extrapolate=None,
        windows=None,
        progress=False,
    )
    if not plans:
        return 0.0
    p = plans[0]
    model, cfg, _ = checkpoint.load_model(
        checkpoint.run_dir(Path(db_path), p.row["id"]) / checkpoint.CKPT_NAME, dev, p.row
    )
    one = measure(
        model,
        p.windows[: cfg.eval.val_batch_size],
        cfg.eval.val_batch_size,
        dev,
        None,
        cfg.eval.val_seed,
        Setting(1, "", 0.0, p.settings[0].extrapolate),
    )["seconds"]
    batches = math.ceil(p.n_windows / cfg.eval.val_batch_size)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return one * batches * sum(depths) * len(rows)
