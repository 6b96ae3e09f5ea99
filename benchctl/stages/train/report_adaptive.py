"""Report section for architectures that report what their forwards did (`BaseLM.add_aux_loss`, `add_metric`,
`add_compute`): their auxiliary losses and metrics at the end of training and on validation data, the per-token depth
distribution where they report one (`depth_frac_<k>`), and each metric's course over training.

Names follow the metrics table: `aux/<name>` (an auxiliary loss term, unweighted, per logged training step),
`arch/<name>` (an architecture metric, per logged step), `val_aux/<name>` and `val_arch/<name>` (the same measured on
the validation windows at each evaluation). The section appears only when a done run of the preset recorded any.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from benchctl.report.figures import MAX_LEGEND, _figure, _style, legend_groups
from benchctl.report.fmt import fnum, md_table
from benchctl.report.frames import Frames

PREFIXES = ("aux/", "arch/")
_DEPTH = re.compile(r"^depth_frac_(\d+)$")


def adaptive_metrics(frames: Frames) -> pd.DataFrame:
    """The done runs' auxiliary-loss and architecture-metric rows (training and validation), with their model."""
    cols = ["run_id", "model", "step", "name", "value"]
    m, done = frames.data.metrics, frames.ctx.done
    if m.empty or done.empty:
        return pd.DataFrame(columns=cols)
    names = m["name"].astype(str)
    keep = names.str.startswith(PREFIXES + tuple("val_" + p for p in PREFIXES))
    df = m[keep & m["run_id"].isin(set(done["id"]))][["run_id", "step", "name", "value"]]
    if df.empty:
        return pd.DataFrame(columns=cols)
    df = df.merge(done[["id", "model"]].rename(columns={"id": "run_id"}), on="run_id")
    df = df.assign(step=pd.to_numeric(df["step"], errors="coerce"), value=pd.to_numeric(df["value"], errors="coerce"))
    return df.dropna(subset=["step", "value"])[cols]


def _final(df: pd.DataFrame) -> dict[tuple[str, str], float]:
    """(model, name) -> the mean over the model's runs of each run's value at its last recorded step."""
    last = df.sort_values("step").groupby(["run_id", "name"]).tail(1)
    return {(str(k[0]), str(k[1])): float(v) for k, v in last.groupby(["model", "name"])["value"].mean().items()}


def adaptive_section(frames: Frames) -> list[str]:
    df = adaptive_metrics(frames)
    if df.empty:
        return []
    ctx = frames.ctx
    models = [m for m in ctx.done_models if m in set(df["model"])]
    final = _final(df)
    train_names = sorted({n for n in df["name"] if not n.startswith("val_")}, key=_order)
    depth = _depth_table(final, models)
    if depth:  # the depth fractions have a table of their own
        train_names = [n for n in train_names if not _DEPTH.match(n.split("/", 1)[-1])]
    out = ["## Adaptive computation", ""]
    out.append(
        "What the architectures that decide their own compute reported: auxiliary losses (`aux/`, the unweighted "
        "terms added to the training loss with their weights; the validation loss everywhere else is the plain "
        "next-token cross-entropy) and their own metrics (`arch/`), at the last logged training step and, in "
        "brackets, on the validation windows at the last evaluation; mean over seeds."
    )
    out.append("")
    headers = ["model", *train_names]
    rows = []
    for m in models:
        row = [m]
        for n in train_names:
            t, v = final.get((m, n)), final.get((m, "val_" + n))
            row.append("-" if t is None else fnum(t) + ("" if v is None else f" ({fnum(v)})"))
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    if depth:
        out += depth + [""]
    fig = fig_adaptive(ctx, df, models, train_names)
    if fig is not None:
        frames.figures["adaptive_metrics.png"] = fig
        out += ["![Auxiliary losses and architecture metrics during training](figures/adaptive_metrics.png)", ""]
    return out


def _order(name: str) -> tuple[int, int, str]:
    """aux terms first, then metrics; depth fractions in depth order."""
    kind = 0 if name.startswith("aux/") else 1
    d = _DEPTH.match(name.split("/", 1)[-1])
    return (kind, int(d.group(1)) if d else -1, name)


def _depth_table(final: dict[tuple[str, str], float], models: list[str]) -> list[str]:
    """The per-token depth distribution on validation data (`val_arch/depth_frac_<k>`), one row per model."""
    depths = sorted({int(d.group(1)) for (_, n) in final if n.startswith("val_arch/") and (d := _DEPTH.match(n[9:]))})
    have = [m for m in models if any((m, f"val_arch/depth_frac_{k}") in final for k in depths)]
    if not depths or not have:
        return []
    out = [
        "Per-token depth on the validation windows at the last evaluation: the fraction of tokens that took each "
        "number of steps (mean over seeds).",
        "",
    ]
    headers = ["model", *[f"depth {k}" for k in depths], "mean depth"]
    rows = []
    for m in have:
        fr = [final.get((m, f"val_arch/depth_frac_{k}")) for k in depths]
        known = [(k, f) for k, f in zip(depths, fr) if f is not None]
        mean = sum(k * f for k, f in known) / sum(f for _, f in known) if known and sum(f for _, f in known) else None
        rows.append([m, *[fnum(f) if f is not None else "-" for f in fr], fnum(mean)])
    return out + md_table(headers, rows, right=range(1, len(headers)))


def fig_adaptive(ctx: Any, df: pd.DataFrame, models: list[str], names: list[str]) -> Any:
    """One panel per term or metric: its value per logged training step, mean over each model's seeds."""
    shown = [n for n in names if not _DEPTH.match(n.split("/", 1)[-1])][:8] or names[:8]
    if not shown:
        return None
    cols = min(len(shown), 3)
    rows = math.ceil(len(shown) / cols)
    colour, entry = legend_groups(ctx, models)
    with _style():
        fig = _figure(4.2 * cols + 0.6, 3.3 * rows + 1.2)
        axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
        for ax, name in zip(axes, shown):
            for m in models:
                g = df[(df["model"] == m) & (df["name"] == name)].groupby("step")["value"].mean()
                if not g.empty:
                    ax.plot(g.index.to_numpy(float), g.to_numpy(float), color=colour[m], linewidth=1.5, label=entry[m])
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("step")
        for ax in axes[len(shown) :]:
            ax.set_visible(False)
        seen: dict[str, Any] = {}  # every entry drawn in any panel, once, in model order
        for ax in axes[: len(shown)]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                seen.setdefault(label, handle)
        labels = list(dict.fromkeys(entry[m] for m in models if entry[m] in seen))
        if labels:
            fig.legend(
                [seen[lab] for lab in labels],
                labels,
                loc="outside lower center",
                ncols=min(len(labels), 4),
                title=None if len(models) <= MAX_LEGEND else f"architecture ({len(models)} models)",
            )
        fig.suptitle(
            f"Auxiliary losses and architecture metrics during training · preset {ctx.preset}",
            fontsize=12,
            fontweight="bold",
        )
    return fig
