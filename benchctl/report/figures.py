"""The report's PNG figures: matplotlib Figure objects built without pyplot state, seaborn styles applied per
figure, one fixed colour per model, titles that say what a bar, dot or band means.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Annotation, Text

from benchctl.report.context import Context, colours_for
from benchctl.report.fmt import ftokens, missing
from benchctl.report.frames import vals

FIG_DPI = 150
MAX_FIG_WIDTH = 2000 / FIG_DPI  # inches: no figure is wider than 2000 px, about what a report page shows unscaled
MAX_LEGEND = 12  # past this many models a legend names architectures (a longer one covers its panels)


def _style():
    stack = ExitStack()
    stack.enter_context(sns.axes_style("whitegrid"))
    stack.enter_context(sns.plotting_context("paper", font_scale=1.35))
    stack.enter_context(
        matplotlib.rc_context({"font.family": "DejaVu Sans", "svg.hashsalt": "benchctl", "axes.titleweight": "bold"})
    )
    return stack


def _figure(width: float, height: float):
    return Figure(figsize=(width, height), dpi=FIG_DPI, layout="constrained")


# Gaps (pixels) between a point and its label's box tried first, nearest first; past them the whole axes is searched.
_LABEL_GAPS = (3, 8, 14, 22, 32, 46, 64, 88)
_LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
_LABEL_PAD = 2.0  # pixels kept free around every box


def renderer_of(fig: Figure) -> Any:
    """The figure's renderer after a draw without output, so every artist sits where the saved PNG will have it (a
    Figure built without pyplot has a canvas that cannot render: it gets Agg's, which `save_figure` writes with)."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    return fig.canvas.get_renderer()


def text_boxes(fig: Figure, renderer: Any) -> list[tuple[Text, Any]]:
    """Every visible, non-empty Text of the figure with its box in pixels (an annotation's text only: its leader
    line may cross another label, its words may not)."""
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_figure(root=True) is fig:
            if isinstance(t, Annotation):
                t.update_positions(renderer)
            out.append((t, Text.get_window_extent(t, renderer)))
    return out


def _freeze_legend(ax: Any, renderer: Any) -> None:
    """Pin the axes' legend where it was drawn: `loc="best"` would move it when the labels appear."""
    leg = ax.get_legend()
    if leg is None:
        return
    box = leg.get_window_extent(renderer)
    x0, y0 = ax.transAxes.inverted().transform((box.x0, box.y0))
    leg.set_loc((float(x0), float(y0)))


def _free(cand: np.ndarray, w: float, h: float, bounds: Any, blocked: np.ndarray) -> int | None:
    """Index of the first candidate centre whose w x h box lies inside `bounds` and overlaps no blocked box."""
    x0, y0 = cand[:, 0] - w / 2, cand[:, 1] - h / 2
    x1, y1 = x0 + w, y0 + h
    inside = np.flatnonzero((x0 >= bounds.x0) & (x1 <= bounds.x1) & (y0 >= bounds.y0) & (y1 <= bounds.y1))
    for chunk in np.array_split(inside, max(1, len(inside) // 4096)):  # bounded memory on a large figure
        if not len(chunk):
            continue
        hit = (
            (x0[chunk, None] < blocked[None, :, 2])
            & (x1[chunk, None] > blocked[None, :, 0])
            & (y0[chunk, None] < blocked[None, :, 3])
            & (y1[chunk, None] > blocked[None, :, 1])
        ).any(axis=1)
        free = np.flatnonzero(~hit)
        if len(free):
            return int(chunk[free[0]])
    return None


def label_points(
    fig: Figure, panels: list[tuple[Any, list[tuple[float, float, str]]]], *, fontsize: float = 7.0
) -> list[Annotation]:
    """Label each (x, y, text) point, in the data coordinates of its axes, without any text covering another.

    Each label goes to the free spot nearest its point: beside it if that is free, else anywhere in its axes (else
    anywhere in the figure), joined to the point by a thin line. Free means clear of every other text of the figure
    (tick and axis labels, titles, the labels placed before it), of every legend and of every marker drawn in the
    labelled axes, so the figure must be complete but for the labels. The labels stay out of the layout
    (constrained layout would otherwise move the axes after they were placed) and each axes' legend is pinned
    where it was drawn. All panels in one call: the figure is laid out once."""
    if not any(points for _, points in panels):
        return []
    renderer = renderer_of(fig)
    for ax, _ in panels:
        _freeze_legend(ax, renderer)
    dpi = fig.dpi
    boxes = [b for _, b in text_boxes(fig, renderer)]
    boxes += [leg.get_window_extent(renderer) for leg in [*(ax.get_legend() for ax, _ in panels), *fig.legends] if leg]
    blocked = [(b.x0, b.y0, b.x1, b.y1) for b in boxes]
    for ax, _ in panels:
        for line in ax.get_lines():
            if line.get_marker() in (None, "", " ", "None", "none") or not line.get_visible():
                continue
            r = line.get_markersize() * dpi / 72 / 2
            for px, py in ax.transData.transform(line.get_xydata()):
                if np.isfinite(px) and np.isfinite(py):
                    blocked.append((px - r, py - r, px + r, py + r))
    out = []
    for ax, points in panels:
        area = ax.get_window_extent(renderer)
        for x, y, text in points:
            probe = ax.text(x, y, text, fontsize=fontsize, ha="center", va="center")
            own = probe.get_window_extent(renderer)
            probe.remove()
            w, h = own.width + 2 * _LABEL_PAD, own.height + 2 * _LABEL_PAD
            px, py = (float(v) for v in ax.transData.transform((x, y)))
            ring = np.array(
                [(px + dx * (w / 2 + g), py + dy * (h / 2 + g)) for g in _LABEL_GAPS for dx, dy in _LABEL_DIRECTIONS]
            )
            taken = np.array(blocked).reshape(-1, 4)
            centre = None
            for bounds in (area, fig.bbox):  # inside the axes where there is room anywhere there, else the figure
                found = _free(ring, w, h, bounds, taken)
                if found is not None:
                    centre = ring[found]
                    break
                gx = np.arange(bounds.x0 + w / 2, bounds.x1 - w / 2, 6.0)
                gy = np.arange(bounds.y0 + h / 2, bounds.y1 - h / 2, 6.0)
                grid = np.stack(np.meshgrid(gx, gy, indexing="ij"), axis=-1).reshape(-1, 2)
                grid = grid[np.argsort(np.hypot(grid[:, 0] - px, grid[:, 1] - py), kind="stable")]
                found = _free(grid, w, h, bounds, taken)
                if found is not None:
                    centre = grid[found]
                    break
            if centre is None:  # no free spot in the whole figure: beside the point, where the first try put it
                centre = ring[0]
            cx, cy = float(centre[0]), float(centre[1])
            arrow = None
            if max(abs(cx - px) - w / 2, abs(cy - py) - h / 2) > 10:  # away from its point: a leader line to it,
                # drawn from the side of the label that faces the point so it never runs through the words
                rel = (
                    0.0 if px < cx - w / 2 else 1.0 if px > cx + w / 2 else 0.5,
                    0.0 if py < cy - h / 2 else 1.0 if py > cy + h / 2 else 0.5,
                )
                arrow = {"arrowstyle": "-", "color": "#777777", "linewidth": 0.6, "shrinkA": 1, "shrinkB": 2}
                arrow["relpos"] = rel
            ann = ax.annotate(
                text,
                (x, y),
                xytext=((cx - px) * 72 / dpi, (cy - py) * 72 / dpi),
                textcoords="offset points",
                ha="center",
                va="center",
                fontsize=fontsize,
                arrowprops=arrow,
                # a light backing hides the grid, curves and other leader lines passing under the words
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
                zorder=5,
            )
            ann.set_in_layout(False)
            blocked.append((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
            out.append(ann)
    return out


def _bar_width(n: int) -> float:
    return max(5.5, 1.3 * n + 2.5)


def tick(model: str) -> str:
    """A model name for an axis tick: a variant's overrides go on wrapped lines under the architecture."""
    if " [" not in model:
        return model
    arch, rest = model.split(" [", 1)
    return arch + "\n" + textwrap.fill("[" + rest, 22)


def _x_labels(ax, models: list[str]) -> None:
    ax.set_xticks(range(len(models)))
    ticks = [tick(m) for m in models]
    crowded = len(models) > 7
    ax.set_xticklabels(
        ticks,
        rotation=25 if crowded else 0,
        ha="right" if crowded else "center",
        fontsize=9 if any("\n" in t for t in ticks) or crowded else None,
    )


def _title(ax: Any, main: str, lines: list[str]) -> None:
    """A bold figure title and smaller explanatory lines above the axes, wrapped to the axes' width."""
    width_in = ax.figure.get_size_inches()[0]
    chars = max(40, int(width_in * 14))
    ax.figure.suptitle(main, fontsize=12.5, fontweight="bold")
    ax.set_title(
        "\n".join(textwrap.fill(line, chars) for line in lines if line),
        fontsize=9.5,
        color="#333333",
        fontweight="normal",
    )


def hardware_line(ctx: Context) -> str:
    d = ctx.done
    if d.empty:
        return "hardware unknown"
    pairs = sorted({(str(a or "?"), str(b or "?")) for a, b in zip(d["device"], d["device_name"])})
    return "; ".join(f"{name} ({dev})" for dev, name in pairs)


def fig_loss_curves(ctx: Context, curves: pd.DataFrame) -> Any:
    """Figure 3 of the study: validation loss against tokens; mean over seeds, band = min–max over seeds;
    right panel zooms into the second half of each model's own training, where the models differ (models trained on
    different token counts each keep their second half in view)."""
    if curves.empty:
        return None
    models = [m for m in ctx.models if m in set(curves["model"])]
    colour, entry = legend_groups(ctx, models)
    xmax = float(curves["tokens"].max())
    scale, unit = (1e9, "B") if xmax >= 1e9 else (1e6, "M") if xmax >= 1e6 else (1e3, "k")
    with _style():
        fig = _figure(11.0, 5.2)
        axes = fig.subplots(1, 2)
        for ax, zoom in zip(axes, (False, True)):
            ymin, ymax = math.inf, -math.inf
            for m in models:
                c = curves[curves["model"] == m]
                if zoom:  # the second half of this model's own run: a model trained on fewer tokens stays in view
                    c = c[c["tokens"] >= float(c["tokens"].max()) / 2]
                if c.empty:
                    continue
                x = c["tokens"].to_numpy(float) / scale
                ax.plot(
                    x,
                    c["mean"],
                    color=colour[m],
                    linewidth=1.8,
                    label=entry[m],
                    marker="o" if len(c) < 12 else None,
                    markersize=3.5,
                )
                if (c["n"] > 1).any():
                    ax.fill_between(x, c["min"], c["max"], color=colour[m], alpha=0.2, linewidth=0)
                ymin, ymax = min(ymin, float(c["min"].min())), max(ymax, float(c["max"].max()))
            ax.set_xlabel(f"tokens seen ({unit})")
            ax.set_ylabel("validation loss (nats/token)")
            if zoom and math.isfinite(ymin):
                pad = max((ymax - ymin) * 0.08, 1e-3)
                ax.set_ylim(ymin - pad, ymax + pad)
            ax.set_title("second half of each model's training" if zoom else "whole run", fontsize=11)
        handles, labels = unique_entries(*axes[0].get_legend_handles_labels())
        n = int(curves["n"].max())
        band = "band = min–max over seeds" if n > 1 else "one seed per model: no band"
        what = "model" if len(models) <= MAX_LEGEND else f"architecture, {len(models)} models"
        fig.legend(
            handles,
            labels,
            title=f"{what} (line = mean over seeds, {band})",
            frameon=True,
            fontsize=9,
            title_fontsize=9.5,
            loc="outside lower center",
            ncols=min(len(labels), 6),
        )  # outside the axes: never covers a curve
        fig.suptitle(f"Validation loss during training · preset {ctx.preset}", fontsize=12.5, fontweight="bold")
    return fig


def fig_final_loss(ctx: Context, loss: pd.DataFrame) -> Any:
    """Final validation loss per model: one dot per seed, mean with 95% CI; a row per model when there are more
    models than columns fit the width."""
    df = loss[loss["final_mean"].notna()]
    if df.empty:
        return None
    models = list(df["model"])
    horizontal, width, height = bar_layout(len(models))
    colour, _ = legend_groups(ctx, models)

    def at(pos: Any, value: Any) -> tuple[Any, Any]:
        return (value, pos) if horizontal else (pos, value)

    with _style():
        fig = _figure(width, height)
        ax = fig.add_subplot()
        for i, row in enumerate(df.itertuples()):
            seeds = vals(ctx.done_of(row.model), "final_val_loss")
            offs = np.linspace(-0.12, 0.12, len(seeds)) if len(seeds) > 1 else np.zeros(1)
            ax.scatter(
                *at(i + offs, seeds),
                s=22,
                color=colour[row.model],
                edgecolor="black",
                linewidth=0.6,
                alpha=0.8,
                zorder=3,
                label="seed" if i == 0 else None,
            )
            if not missing(row.final_lo):
                err = [[row.final_mean - row.final_lo], [row.final_hi - row.final_mean]]
                ax.errorbar(
                    *at(i + 0.28, row.final_mean),
                    **({"xerr": err} if horizontal else {"yerr": err}),
                    fmt="D",
                    color="black",
                    markersize=5,
                    capsize=5,
                    zorder=4,
                    label="mean ± 95% CI" if i == 0 else None,
                )
            else:
                ax.plot(
                    *at(i + 0.28, row.final_mean),
                    "D",
                    color="black",
                    markersize=5,
                    zorder=4,
                    label="mean (no CI)" if i == 0 else None,
                )
            if ctx.is_paper and row.study_final is not None:
                ax.plot(
                    *at(i - 0.3, row.study_final),
                    marker="*",
                    color="#C00000",
                    markersize=11,
                    linestyle="none",
                    zorder=4,
                    label="study" if i == 0 else None,
                )
        if horizontal:
            _y_labels(ax, models)
            ax.set_ylabel("model")
            ax.set_xlabel("final validation loss (nats/token)")
            # above the rows, outside them: no room beside a hundred rows is free of points
            fig.legend(*ax.get_legend_handles_labels(), fontsize=9, frameon=True, loc="outside lower center", ncols=3)
            ax.grid(axis="y", visible=False)
        else:
            _x_labels(ax, models)
            ax.set_xlim(-0.6, len(models) - 0.4)
            ax.margins(y=0.15)  # room above the highest point for the legend
            ax.set_xlabel("model")
            ax.set_ylabel("final validation loss (nats/token)")
            ax.legend(fontsize=9, frameon=True, loc="best")
            ax.grid(axis="x", visible=False)
        _title(
            ax,
            "Final validation loss per model",
            [
                f"preset {ctx.preset} · {tokens_per_run(df['tokens'])} · dots = seeds, "
                + ("diamond = mean ± 95% CI" if df["final_n"].max() > 1 else "diamond = mean (one seed: no CI)")
            ],
        )
    return fig


def tokens_per_run(tokens: pd.Series) -> str:
    """The training tokens of a figure's models, as its subtitle states them: one count when every model trained on
    as many, else the range (a model trained on more, such as a compute-matched control, must not lend its count to
    the others)."""
    values = sorted({float(t) for t in tokens if not missing(t)})
    if not values:
        return "tokens per run unknown"
    if len(values) == 1:
        return f"{ftokens(values[0])} tokens per run"
    return f"{ftokens(values[0])} to {ftokens(values[-1])} tokens per run (by model)"


def legend_groups(ctx: Context, models: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(colour, legend entry) of each model. Up to MAX_LEGEND models each is its own entry in its own colour; past
    that (an IsoFLOP grid has a model per architecture, width and budget) there is one colour and one entry per
    architecture: a legend of a hundred names has no room outside the panels, and its colours repeat anyway."""
    if len(models) <= MAX_LEGEND:
        return {m: ctx.colours[m] for m in models}, {m: tick(m) for m in models}
    archs = list(dict.fromkeys(ctx.arch_of[m] for m in models))
    by_arch = colours_for(archs, {a: a for a in archs})
    return {m: by_arch[ctx.arch_of[m]] for m in models}, {m: ctx.arch_of[m] for m in models}


def unique_entries(handles: list[Any], labels: list[str]) -> tuple[list[Any], list[str]]:
    """A legend's entries with each label once (models grouped by architecture share theirs), in first-seen order."""
    seen: dict[str, Any] = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    return list(seen.values()), list(seen)


def bar_layout(n: int) -> tuple[bool, float, float]:
    """(horizontal, width, height) in inches of a chart with a bar or column per model: side by side while they fit
    MAX_FIG_WIDTH, else one row per model (the names read across, the width stays bounded, the height grows)."""
    width = _bar_width(n)
    if width <= MAX_FIG_WIDTH:
        return False, width, 4.6
    return True, min(10.0, MAX_FIG_WIDTH), 1.9 + 0.22 * n


def _y_labels(ax: Any, models: list[str]) -> None:
    """A horizontal chart's model names, the first at the top."""
    ax.set_yticks(range(len(models)))
    ax.set_yticklabels([tick(m).replace("\n", " ") for m in models], fontsize=8.5)
    ax.set_ylim(len(models) - 0.4, -0.6)


def save_figure(fig: Any, path: Path) -> None:
    """PNG without a timestamp or software tag, so the same data gives the same file."""
    fig.savefig(path, dpi=FIG_DPI, metadata={"Software": None})


def save_figures(figures: dict[str, Any], folder: Path, workers: int | None = None, patience: float = 30.0) -> None:
    """Every figure as folder/<name>, the same bytes as `save_figure` one by one, on up to `workers` cores (default:
    the cores this process may use); a forked writer still busy `patience` seconds (or five times this process's
    own share) after this process finished its share is stopped.

    Drawing a figure is most of a report's time and each is independent of the others, so on Linux the figures are
    split among forked copies of this process: a child inherits the built figures (nothing is pickled or imported
    again) and only writes files. A child that fails leaves its figures to this process, which writes them again and
    so raises the real error where it belongs. Elsewhere (no fork that is safe with the GUI frameworks macOS and
    Windows load) the figures are written in turn."""
    items = sorted(figures.items())
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    workers = max(1, min(workers, len(items)))
    if workers == 1 or sys.platform != "linux":
        for name, fig in items:
            save_figure(fig, folder / name)
        return
    groups = [items[i::workers] for i in range(workers)]
    children: dict[int, list[tuple[str, Any]]] = {}
    for group in groups[1:]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: write its share, then leave without running the parent's exit handlers
            code = 1
            try:
                for name, fig in group:
                    save_figure(fig, folder / name)
                code = 0
            finally:
                os._exit(code)
        children[pid] = group
    failed: list[tuple[str, Any]] = []
    start = time.monotonic()
    try:
        for name, fig in groups[0]:
            save_figure(fig, folder / name)
    finally:
        # a child forked while another thread held a lock it then needs would wait forever: past a generous
        # deadline (its share is about this process's own) it is stopped and its figures are written here
        deadline = time.monotonic() + max(patience, 5 * (time.monotonic() - start))
        for pid, group in children.items():
            if _wait(pid, deadline) != 0:
                failed += group
    for name, fig in failed:
        save_figure(fig, folder / name)


def _wait(pid: int, deadline: float) -> int:
    """The exit status of child `pid`, killed once `deadline` (time.monotonic) has passed."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1] or 1
