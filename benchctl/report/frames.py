"""Pure computations from the loaded tables to one DataFrame per report table or figure (no I/O, no formatting).

Only runs with status `done` enter the statistics. Means carry 95% t-intervals over seeds (benchctl.core.stats).
What is computed here reads the runs and metrics tables every report has; a stage's own frames (the judge's groups,
the lm-eval means, the benchmarks) live in the stage, and `Frames.once` keeps one that several sections share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

import architectures
from benchctl.core import accounting, paper, stats
from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError
from benchctl.report.context import Context, model_keys
from benchctl.report.load import Data


def vals(df: pd.DataFrame, col: str) -> list[float]:
    return [float(v) for v in pd.to_numeric(df[col], errors="coerce") if pd.notna(v)]


def ci_cols(prefix: str, ci: stats.MeanCI) -> dict[str, Any]:
    return {f"{prefix}_n": ci.n, f"{prefix}_mean": ci.mean, f"{prefix}_lo": ci.lo, f"{prefix}_hi": ci.hi}


# every status a run can show: the stored ones and `interrupted` (a running run whose process is gone)
STATUSES = ("done", "running", "interrupted", "pending", "failed")


def status_frame(ctx: Context) -> pd.DataFrame:
    """Runs per model and status, with the seeds that are done."""
    rows = []
    for m in ctx.models:
        g = ctx.runs[ctx.runs["model"] == m]
        row: dict[str, Any] = {"model": m}
        for s in STATUSES:
            row[s] = int((g["status"] == s).sum())
        row["other"] = int((~g["status"].isin(STATUSES)).sum())
        row["seeds_done"] = sorted(int(x) for x in g.loc[g["status"] == "done", "seed"])
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", *STATUSES, "other", "seeds_done"])


def accounting_frame(ctx: Context) -> pd.DataFrame:
    """Parameters by component, totals, effective parameters and FLOPs/token per model, from the runs' configs
    (benchctl.core.accounting); falls back to the numbers recorded in the runs table when a config cannot be rebuilt.

    Components are whatever the models report, not a fixed list, so a new architecture's own parts get columns:
    the `components` column holds each row's component names in model order, `component_order` merges them, and
    every row has a column per component (0 where a rebuilt model has no such part, None for runs-table rows)."""
    rows = []
    for m in ctx.models:
        g = ctx.runs[ctx.runs["model"] == m]
        first = g.sort_values(["seed", "id"]).iloc[0]
        recorded = sorted({int(v) for v in pd.to_numeric(g["n_params"], errors="coerce").dropna()})
        row: dict[str, Any] = {"model": m, "arch": ctx.arch_of[m], "recorded_n_params": recorded}
        try:
            described = _describe(first["config_json"])
        except (ConfigError, TypeError):  # config from another benchctl version: use what training recorded
            row.update(
                {
                    "components": [],
                    "total_params": _first_num(g["n_params"]),
                    "effective_params": _first_num(g["effective_params"]),
                    "flops_per_token": _first_num(g["flops_per_token"]),
                    "effective_depth": None,
                    "paper_total_params": None,
                    "matches_paper": None,
                    "source": "runs table",
                }
            )
        else:
            row.update(described)
            row.update({"model": m, "components": _components_of(described), "source": "config"})
        rows.append(row)
    order = component_order(r["components"] for r in rows)
    for r in rows:
        for c in order:
            r.setdefault(c, 0 if r["source"] == "config" else None)
    return pd.DataFrame(rows)


def _components_of(described: dict[str, Any]) -> list[str]:
    """The component names of one accounting row, in the model's order. Rows that do not list them carry the
    accounting module's fixed set of components instead."""
    if described.get("components") is not None:
        return [str(c) for c in described["components"]]
    return [c for c in getattr(accounting, "COMPONENTS", ()) if c in described]


def component_order(per_model: Iterable[list[str]]) -> list[str]:
    """Every component any model has, in first-seen order: a component new to the table goes right before the
    next component of its own model that already has a column (at the end when there is none), so every model's
    own order holds, the embedding stays first and the final norm last."""
    out: list[str] = []
    for names in per_model:
        for i, name in enumerate(names):
            if name in out:
                continue
            after = [n for n in names[i + 1 :] if n in out]
            out.insert(out.index(after[0]) if after else len(out), name)
    return out


@functools.lru_cache(maxsize=256)
def _describe(config_json: str) -> dict[str, Any]:
    """accounting.describe of a stored config; cached because building even a meta-device model is slow, and a
    report describes the same config once per run."""
    return dict(accounting.describe(RunConfig.from_json(config_json)))


def _first_num(s: pd.Series) -> float | None:
    v = pd.to_numeric(s, errors="coerce").dropna()
    return None if v.empty else float(v.iloc[0])


def paper_accounting_frame() -> pd.DataFrame:
    """The study's four models at the paper preset: our accounting beside the published totals."""
    return pd.DataFrame(list(_paper_accounting()))


@functools.lru_cache(maxsize=1)
def _paper_accounting() -> tuple[dict[str, Any], ...]:
    names = [a for a in architectures.names() if a in paper.TOTAL_PARAMS]
    return tuple(accounting.table("paper", names))


def loss_frame(ctx: Context) -> pd.DataFrame:
    """Initial and final validation loss per model: mean and 95% t-CI over seeds (done runs)."""
    rows = []
    for m in ctx.done_models:
        g = ctx.done_of(m)
        row: dict[str, Any] = {"model": m, "arch": ctx.arch_of[m], "seeds": len(g)}
        row.update(ci_cols("initial", stats.mean_ci(vals(g, "initial_val_loss"))))
        row.update(ci_cols("final", stats.mean_ci(vals(g, "final_val_loss"))))
        tok = vals(g, "tokens_seen")
        row["tokens"] = float(np.mean(tok)) if tok else None
        row["study_initial"] = paper.INITIAL_LOSS.get(m) if ctx.is_paper else None
        row["study_final"] = paper.FINAL_LOSS.get(m) if ctx.is_paper else None
        rows.append(row)
    return pd.DataFrame(rows)


def _tokens_per_step(config_json: Any) -> float | None:
    keys = model_keys(config_json)
    try:
        return float(keys["train.batch_size"] * keys["train.grad_accum"] * keys["model.max_seq_len"])
    except (KeyError, TypeError):
        return None


def curve_frame(ctx: Context, metrics: pd.DataFrame) -> pd.DataFrame:
    """Validation loss against tokens per (model, step): mean, min and max over the done seeds."""
    cols = ["model", "step", "tokens", "mean", "min", "max", "n"]
    if ctx.done.empty or metrics.empty:
        return pd.DataFrame(columns=cols)
    runs = ctx.done[["id", "model", "config_json"]].rename(columns={"id": "run_id"})
    df = metrics[metrics["name"] == "val_loss"].merge(runs, on="run_id", how="inner")
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    df["step"] = pd.to_numeric(df["step"], errors="coerce")
    tps = df["config_json"].map(_tokens_per_step)
    df["tokens"] = pd.to_numeric(df["tokens"], errors="coerce").fillna(df["step"] * pd.to_numeric(tps))
    out = (
        df.groupby(["model", "step"], sort=True)
        .agg(
            tokens=("tokens", "mean"),
            mean=("value", "mean"),
            min=("value", "min"),
            max=("value", "max"),
            n=("value", "count"),
        )
        .reset_index()
    )
    order = {m: i for i, m in enumerate(ctx.models)}
    out["_o"] = out["model"].map(order)
    return out.sort_values(["_o", "step"]).drop(columns="_o").reset_index(drop=True)[cols]


@dataclass
class Frames:
    """What every report section reads: the preset's models, the loaded tables, and frames that several sections
    share (computed once, on first use: `once`). Sections add the figures they draw to `figures` (file name ->
    Figure)."""

    ctx: Context
    data: Data
    figures: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)  # `once`'s results, by key

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()` the first time `key` is asked for, the same value after: a stage's frame that several
        sections read (the judge's groups) is computed once per report."""
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]
