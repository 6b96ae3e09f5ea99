"""Report section of the accuracy stage, "Reasoning tasks": exact match per model and difficulty level at the trained
depth, with 95% t-intervals over seeds, and accuracy against test-time depth per level for the recurrent models
(the logical-extrapolation curve: does running deeper solve harder problems?).

Rows come from `accuracy_results` (`benchctl accuracy`), only for runs that are done in the report's preset. A study
on TinyStories has no rows, and the section is left out of its report.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.ticker import ScalarFormatter

from benchctl.core import stats
from benchctl.report.figures import _figure, _style
from benchctl.report.fmt import fnum, md_table
from benchctl.report.frames import Frames

FIGURES = ("task_accuracy_depth.png",)


def accuracy_frame(frames: Frames) -> pd.DataFrame:
    """accuracy_results rows of the preset's done runs, with the run's model and seed; the largest problem count
    measured per (run, level, depth) only (most problems = least noise)."""
    ctx, a = frames.ctx, frames.data.accuracy_results
    if a is None or a.empty or ctx.done.empty:
        return pd.DataFrame()
    runs = ctx.done[["id", "model", "seed"]].rename(columns={"id": "run_id", "seed": "run_seed"})
    df = a.merge(runs, on="run_id", how="inner")
    if df.empty:
        return df
    top = df.groupby(["run_id", "level", "n_recur"])["problems"].transform("max")
    return df[df["problems"] == top].reset_index(drop=True)


def _cell(values: pd.Series) -> str:
    """Mean accuracy in percent with its 95% t-interval over seeds (just the mean for one seed)."""
    ci = stats.mean_ci(100 * values.astype(float))
    if ci.lo is None or ci.hi is None:
        return f"{fnum(ci.mean, 1)} (1 seed)"
    return f"{fnum(ci.mean, 1)} ({fnum(max(ci.lo, 0.0), 1)}–{fnum(min(ci.hi, 100.0), 1)})"


def _level_order(df: pd.DataFrame) -> list[str]:
    """In-distribution first, then the harder levels in the order they were measured (the task's order)."""
    first = df.drop_duplicates("level")[["level", "in_distribution"]]
    ids = [lv for lv, i in zip(first["level"], first["in_distribution"]) if i]
    return ids + [lv for lv in first["level"] if lv not in ids]


def _trained_table(df: pd.DataFrame) -> list[str]:
    at = df[df["n_recur"] == df["trained_n_recur"]]
    levels = _level_order(df)
    rows = []
    for model, g in at.groupby("model", sort=False):
        cells = [_cell(g[g["level"] == lv]["accuracy"]) if (g["level"] == lv).any() else "-" for lv in levels]
        seeds = g["run_seed"].nunique()
        loss = g[g["in_distribution"] == 1]["answer_loss"].astype(float).mean()
        rows.append([model, seeds, *cells, fnum(loss, 4)])
    heads = ["model", "seeds", *[f"{lv}{' (in-dist.)' if i == 0 else ''} %" for i, lv in enumerate(levels)]]
    return md_table([*heads, "answer loss, in-dist."], rows, right=range(1, len(heads) + 1))


def _depth_table(df: pd.DataFrame) -> list[str]:
    """Accuracy (mean over seeds) per depth and level for every model measured at more than one depth."""
    swept = df.groupby("model")["n_recur"].nunique()
    models = [m for m in df["model"].drop_duplicates() if swept.get(m, 0) > 1]
    if not models:
        return []
    levels = _level_order(df)
    rows = []
    for m in models:
        g = df[df["model"] == m]
        trained = int(g["trained_n_recur"].iloc[0])
        for d, h in g.groupby("n_recur", sort=True):
            cells = [fnum(100 * h[h["level"] == lv]["accuracy"].astype(float).mean(), 1) for lv in levels]
            rows.append([m, f"{d}{' (trained)' if d == trained else ''}", *cells])
    return md_table(["model", "depth", *[f"{lv} %" for lv in levels]], rows, right=range(2, 2 + len(levels)))


def fig_depth(df: pd.DataFrame) -> Any:
    """Accuracy against test-time depth, one panel per level, one line per recurrent model (trained depth marked)."""
    swept = df.groupby("model")["n_recur"].nunique()
    models = [m for m in df["model"].drop_duplicates() if swept.get(m, 0) > 1]
    if not models:
        return None
    _style()
    levels = _level_order(df)
    fig = _figure(3.2 * len(levels) + 1.0, 3.4)
    axes = fig.subplots(1, len(levels), sharey=True, squeeze=False)[0]
    for ax, lv in zip(axes, levels):
        for m in models:
            g = df[(df["model"] == m) & (df["level"] == lv)]
            curve = g.groupby("n_recur")["accuracy"].mean() * 100
            (line,) = ax.plot(curve.index, curve.values, marker="o", ms=3, label=m)
            trained = int(g["trained_n_recur"].iloc[0]) if not g.empty else None
            if trained in curve.index:
                ax.plot([trained], [curve[trained]], marker="*", ms=11, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 1, 2, 4, ... rather than 2^0, 2^1, 2^2
        ax.set_title(lv, fontsize=10)
        ax.set_xlabel("test-time depth (iterations)")
        ax.set_ylim(-2, 102)
    axes[0].set_ylabel("exact match (%)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=min(4, len(models)), fontsize=8)
    fig.suptitle("Accuracy against test-time depth (★ trained depth)", fontsize=11)
    return fig


def accuracy_section(frames: Frames) -> list[str]:
    df = accuracy_frame(frames)
    if df.empty:
        return []
    out = ["## Reasoning tasks", ""]
    for task, t in df.groupby("task", sort=True):
        n = int(t["problems"].max())
        out += [
            f"### {task}",
            "",
            f"Exact match (%) of greedy answers on the first {n} held-out problems of each level (never in any "
            "training stream), at each model's trained depth; mean over seeds with its 95% t-interval. The "
            "in-distribution level is the one the runs trained on; the others are harder (extrapolation).",
            "",
        ]
        out += _trained_table(t) + [""]
        depth = _depth_table(t)
        if depth:
            out += [
                "Accuracy (%, mean over seeds) against test-time depth for the models that iterate: does running "
                "deeper than trained solve the harder levels?",
                "",
                *depth,
                "",
            ]
    f = fig_depth(df) if df["task"].nunique() == 1 else None
    if f is not None:
        frames.figures["task_accuracy_depth.png"] = f
        out += ["![Accuracy against test-time depth](figures/task_accuracy_depth.png)", ""]
    return out
