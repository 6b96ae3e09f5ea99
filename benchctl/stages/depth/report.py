"""Report section of the depth stage, "Test-time recurrence": validation loss against inference depth, the adaptive
exit's loss against mean depth beside the fixed depths, a histogram of per-token exit depths, and one sentence per
architecture on what running past its trained depth does.

Rows come from `depth_results` (`benchctl depth`), only for runs that are done in the report's preset. A line is one
model (architecture + config variant) with one extrapolation rule and window count; means over seeds carry 95%
t-intervals (benchctl.core.stats).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.ticker import ScalarFormatter

import architectures
from benchctl.core import stats
from benchctl.report.figures import _figure, _style, label_points, tick
from benchctl.report.fmt import fnum, md_table, need
from benchctl.report.frames import Frames

FIGURES = ("depth_loss.png", "depth_frontier.png", "depth_exit_hist.png")
# nats: "saturates" claims the loss at 2x the trained depth is the same as at it, which needs a margin to be a claim
# at all: the change must be shown to lie within ±SATURATION_MARGIN by two one-sided t-tests over seeds (stats.tost).
# 0.01 nats is about 1% in perplexity, below the seed-to-seed spread of final losses at the presets benchctl ships.
SATURATION_MARGIN = 0.01
ALPHA = 0.05


def depth_frame(frames: Frames) -> pd.DataFrame:
    """depth_results rows of the preset's done runs, with model, seed, trained depth and a `line` label."""
    ctx, d = frames.ctx, frames.data.depth_results
    if d is None or d.empty or ctx.done.empty:
        return pd.DataFrame()
    runs = ctx.done[["id", "model", "seed", "config_json"]].rename(columns={"id": "run_id"})
    df = d.merge(runs, on="run_id", how="inner")
    if df.empty:
        return df
    df["trained"] = [int(json.loads(c)["model"]["n_recur"]) for c in df["config_json"]]
    df["exit_rule"] = df["exit_rule"].fillna("")
    df["extrapolate"] = df["extrapolate"].fillna("")
    multi = df.groupby("model")["extrapolate"].nunique().to_dict()
    df["line"] = [m + (f" ({e})" if multi.get(m, 1) > 1 and e else "") for m, e in zip(df["model"], df["extrapolate"])]
    # one window count per model: the largest measured (most windows = least noise)
    top = df.groupby("model")["windows"].transform("max")
    return df[df["windows"] == top].drop(columns=["config_json"]).reset_index(drop=True)


def _iterable(ctx: Any, g: pd.DataFrame) -> bool:
    """Whether the line's architecture has the iteration hooks (it runs past its trained depth and exits early)."""
    try:
        return architectures.get(ctx.arch_of.get(g["model"].iloc[0], "")).iterable()
    except architectures.UnknownArchitectureError:  # not registered here: it has the hooks if it ran past its depth
        return bool((g["n_recur"] > g["trained"]).any())


def _swept(ctx: Any, g: pd.DataFrame) -> bool:
    """Whether the line is a curve over depths (False: one depth, drawn as a reference line): every architecture
    with the iteration hooks, and one without them measured at several depths up to its trained one (ut-act, mor)."""
    return _iterable(ctx, g) or g["n_recur"].nunique() > 1


def _curve(g: pd.DataFrame, by: str = "n_recur") -> pd.DataFrame:
    """Mean and 95% CI over seeds of val_loss (and mean_depth) per value of `by`."""
    rows = []
    for key, h in g.groupby(by, sort=True):
        ci = stats.mean_ci(h["val_loss"].astype(float))
        rows.append(
            {
                by: key,
                "n": ci.n,
                "mean": ci.mean,
                "lo": ci.lo,
                "hi": ci.hi,
                "mean_depth": float(h["mean_depth"].astype(float).mean()),
            }
        )
    return pd.DataFrame(rows)


def verdicts(ctx: Any, df: pd.DataFrame) -> list[str]:
    """One sentence per recurrent model on the change in loss from its trained depth T to 2T, per seed.

    improves / degrades: the 95% CI over seeds of the change lies below / above 0. saturates: the change is shown to
    lie within ±SATURATION_MARGIN (TOST at ALPHA, stats.tost), whatever the CI says of 0. A CI that contains 0
    without the TOST shows neither, and the sentence says so rather than calling it saturation. With one seed
    nothing is tested: the sentence gives the change of that one trained model and what would test it."""
    out = []
    fixed = df[df["exit_rule"] == ""]
    for line, g in fixed.groupby("line", sort=False):
        T = int(g["trained"].iloc[0])
        if not _swept(ctx, g):
            continue  # a fixed-depth architecture: the reference line
        if not _iterable(ctx, g):  # its forward runs at most its trained depth
            c = _curve(g)
            lo = c.iloc[0]
            at = c[c["n_recur"] == T]
            if lo["n_recur"] < T and not at.empty:
                out.append(
                    f"- {line} runs at most its trained depth {T}, so nothing is measured past it: loss "
                    f"{fnum(float(at['mean'].iloc[0]), 4)} at depth {T} and {fnum(float(lo['mean']), 4)} at depth "
                    f"{int(lo['n_recur'])}."
                )
            continue
        per_seed = g.pivot_table(index="seed", columns="n_recur", values="val_loss", aggfunc="first")
        if T not in per_seed.columns or 2 * T not in per_seed.columns:
            out.append(
                f"- {line}: depths {T} (trained) and {2 * T} are not both measured; run `benchctl depth "
                f"--depths {T},{2 * T}`."
            )
            continue
        diff = (per_seed[2 * T] - per_seed[T]).dropna().astype(float)
        ci = stats.mean_ci(diff)
        losses = (
            f"loss {fnum(float(per_seed[T].mean()), 4)} at its trained depth {T} and "
            f"{fnum(float(per_seed[2 * T].mean()), 4)} at depth {2 * T}"
        )
        ext = g["extrapolate"].iloc[0]
        rule = f", extrapolation rule `{ext}`" if ext else ""
        out.append(f"- {line} {_past_trained(ci, stats.tost(diff, SATURATION_MARGIN, ALPHA), losses)}{rule}.")
    return out


def _past_trained(ci: stats.MeanCI, eq: stats.MarginTest, losses: str) -> str:
    """The verdict and its evidence, after the model's name: "saturates past its trained depth: ...". `ci` is the
    95% CI of the per-seed change from T to 2T, `eq` its equivalence test against ±SATURATION_MARGIN."""
    margin = f"±{SATURATION_MARGIN:g} nats"
    assert ci.mean is not None
    if ci.n < 2:
        if abs(ci.mean) < SATURATION_MARGIN:
            what = f"within {margin}; whether the architecture saturates needs two seeds or more, to test it"
        else:
            word = "improves" if ci.mean < 0 else "degrades"
            what = f"outside {margin}; one seed has no CI, so whether the architecture {word} needs two seeds or more"
        return (
            f"has one seed, so nothing is tested past its trained depth: {losses} (change {_signed(ci.mean)} for "
            f"this one trained model, {what})"
        )
    assert ci.lo is not None and ci.hi is not None
    change = f"change {_signed(ci.mean)}, 95% CI [{_signed(ci.lo)}, {_signed(ci.hi)}] over {ci.n} seeds"
    if eq.shown:
        assert eq.lo is not None and eq.hi is not None and eq.p is not None
        real = (
            "; the 95% CI excludes 0, so the change is real but smaller than the margin"
            if ci.lo > 0 or ci.hi < 0
            else ""
        )
        return (
            f"saturates past its trained depth: {losses} ({change}; within {margin} by two one-sided t-tests, "
            f"{round(100 * eq.level)}% CI [{_signed(eq.lo)}, {_signed(eq.hi)}], {stats.fmt_p(eq.p)}{real})"
        )
    if ci.hi < 0:
        return f"improves past its trained depth: {losses} ({change})"
    if ci.lo > 0:
        return f"degrades past its trained depth: {losses} ({change})"
    tested = (
        f"its {round(100 * eq.level)}% CI [{_signed(eq.lo)}, {_signed(eq.hi)}] is not inside {margin} "
        f"(two one-sided t-tests, {stats.fmt_p(eq.p)})"
        if eq.p is not None and eq.lo is not None and eq.hi is not None
        else f"the equivalence test within {margin} cannot be run ({eq.reason})"
    )
    return (
        f"is not shown to improve, degrade or saturate past its trained depth: {losses} ({change} contains 0, "
        f"which is no evidence of saturation: {tested}; more seeds would narrow it)"
    )


def _signed(x: float) -> str:
    """'+0.0012', '-0.0480'; a change that rounds to zero is '+0.0000', never '-0.0000'."""
    s = f"{x:+.4f}"
    return "+0.0000" if s == "-0.0000" else s


def fig_depth_loss(ctx: Any, df: pd.DataFrame) -> Any:
    fixed = df[df["exit_rule"] == ""]
    if fixed.empty:
        return None
    with _style():
        fig = _figure(8.5, 5.2)
        ax = fig.subplots()
        xs = sorted(fixed["n_recur"].unique())
        for line, g in fixed.groupby("line", sort=False):
            colour = ctx.colours.get(g["model"].iloc[0])
            c = _curve(g)
            if not _swept(ctx, g):
                ax.axhline(c["mean"][0], color=colour, linestyle="--", linewidth=1.5, label=f"{tick(line)} (fixed)")
                continue
            ax.plot(c["n_recur"], c["mean"], color=colour, marker="o", markersize=4, linewidth=1.8, label=tick(line))
            if c["lo"].notna().any():
                ax.fill_between(c["n_recur"], c["lo"], c["hi"], color=colour, alpha=0.2, linewidth=0)
            T = int(g["trained"].iloc[0])
            at = c[c["n_recur"] == T]
            if not at.empty:
                ax.plot(
                    [T],
                    [at["mean"].iloc[0]],
                    marker="*",
                    markersize=14,
                    color=colour,
                    markeredgecolor="black",
                    linestyle="none",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("inference depth (iterations, log2)")
        ax.set_ylabel("validation loss (nats/token)")
        n = int(fixed.groupby(["line", "n_recur"])["seed"].nunique().max())
        band = "band = 95% CI over seeds" if n > 1 else "one seed: no band"
        ax.set_title(f"Loss against inference depth · ★ = trained depth · {band}", fontsize=11)
        ax.legend(fontsize=8.5, frameon=True)
    return fig


def _threshold_labels(points: list[tuple[float, float, float]]) -> list[tuple[float, float, str]]:
    """One label per distinct point: exit points of several lines (or thresholds) that land on the same spot share
    one label listing their thresholds, instead of one label each printed over the others."""
    at: dict[tuple[float, float], list[float]] = {}
    for x, y, thr in points:
        key = (round(x, 9), round(y, 9))
        if thr not in at.setdefault(key, []):
            at[key].append(thr)
    return [(x, y, ", ".join(f"{t:g}" for t in sorted(thrs))) for (x, y), thrs in at.items()]


def fig_frontier(ctx: Any, df: pd.DataFrame) -> Any:
    ex = df[df["exit_rule"] != ""]
    if ex.empty:
        return None
    with _style():
        fig = _figure(8.5, 5.2)
        ax = fig.subplots()
        exits: list[tuple[float, float, float]] = []
        for line, g in df.groupby("line", sort=False):
            colour = ctx.colours.get(g["model"].iloc[0])
            fixed = _curve(g[g["exit_rule"] == ""])
            if len(fixed) > 1:
                ax.plot(
                    fixed["n_recur"],
                    fixed["mean"],
                    color=colour,
                    marker="o",
                    markersize=4,
                    linewidth=1.5,
                    label=f"{tick(line)}: fixed depth",
                )
            for rule, h in g[g["exit_rule"] != ""].groupby("exit_rule"):
                c = _curve(h, by="threshold")
                ax.plot(
                    c["mean_depth"],
                    c["mean"],
                    color=colour,
                    marker="D" if rule == "kl" else "s",
                    markersize=6,
                    linestyle=":",
                    linewidth=1.2,
                    label=f"{tick(line)}: exit {rule}",
                )
                exits += [(float(r.mean_depth), float(r.mean), float(r.threshold)) for r in c.itertuples()]
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("mean depth per token (iterations; exit: what skipping exited tokens would compute)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("Compute/quality frontier: adaptive exit (labels = thresholds) vs fixed depth", fontsize=11)
        ax.legend(fontsize=8, frameon=True)
        label_points(fig, [(ax, _threshold_labels(exits))])
    return fig


def fig_exit_hist(df: pd.DataFrame) -> tuple[Any, str]:
    """Histogram of per-token exit depths of the first run with exit rows, one series per threshold."""
    ex = df[df["exit_rule"] != ""]
    if ex.empty:
        return None, ""
    first = ex.sort_values(["model", "seed", "run_id"]).iloc[0]
    rows = ex[
        (ex["run_id"] == first["run_id"])
        & (ex["exit_rule"] == first["exit_rule"])
        & (ex["n_recur"] == first["n_recur"])
    ].sort_values("threshold", ascending=False)
    maxd = int(first["n_recur"])
    width = 0.8 / max(len(rows), 1)
    with _style():
        fig = _figure(8.5, 4.6)
        ax = fig.subplots()
        for i, r in enumerate(rows.itertuples()):
            hist = {int(k): v for k, v in json.loads(r.depth_hist or "{}").items()}
            total = sum(hist.values()) or 1
            ys = [hist.get(d, 0) / total for d in range(1, maxd + 1)]
            ax.bar(
                np.arange(1, maxd + 1) + (i - (len(rows) - 1) / 2) * width,
                ys,
                width=width,
                label=f"threshold {r.threshold:g} (mean {r.mean_depth:.2f})",
            )
        ax.set_xticks(range(1, maxd + 1))
        ax.set_xlabel("exit depth (iteration the token froze at)")
        ax.set_ylabel("share of tokens")
        what = f"{first['model']} seed {first['seed']}, exit {first['exit_rule']}, max depth {maxd}"
        ax.set_title(f"Per-token exit depths · {what}", fontsize=11)
        ax.legend(fontsize=8.5, frameon=True)
    return fig, what


def _tables(df: pd.DataFrame) -> list[str]:
    out: list[str] = []
    fixed = df[df["exit_rule"] == ""]
    if not fixed.empty:
        depths = sorted(fixed["n_recur"].unique())
        rows = []
        for line, g in fixed.groupby("line", sort=False):
            c = _curve(g).set_index("n_recur")
            T = int(g["trained"].iloc[0])
            cells = [_cell(c, d) + (" ★" if d == T else "") if d in c.index else "-" for d in depths]
            rows.append([line, T, int(g["seed"].nunique())] + cells)
        out += md_table(
            ["model", "trained", "seeds"] + [f"depth {d}" for d in depths], rows, right=range(1, len(depths) + 3)
        ) + [""]
        out.append(
            "Validation loss (nats/token), mean over seeds ± half-width of the 95% CI; ★ = trained depth. "
            "A fixed-depth architecture has one value (its own depth)."
        )
        out.append("")
    ex = df[df["exit_rule"] != ""]
    if not ex.empty:
        rows = []
        for (line, rule, maxd), g in ex.groupby(["line", "exit_rule", "n_recur"], sort=False):
            for thr, h in g.groupby("threshold", sort=False):
                ci = stats.mean_ci(h["val_loss"].astype(float))
                rows.append(
                    [
                        line,
                        rule,
                        f"{thr:g}",
                        int(maxd),
                        fnum(float(h["mean_depth"].mean()), 2),
                        _fmt_ci(ci),
                        fnum(float(h["flops_per_token"].mean()) / 1e6, 2),
                    ]
                )
        out += md_table(
            ["model", "exit", "threshold", "max depth", "mean depth", "val loss", "MFLOP/token"],
            rows,
            right=range(2, 7),
        ) + [""]
        out.append(
            "Mean depth = average exit iteration over tokens. Every iteration is still computed for every "
            "token here, so mean depth (and the FLOPs/token at it) is the compute an implementation that "
            "skips exited tokens would spend."
        )
        out.append("")
    return out


def _fmt_ci(ci: stats.MeanCI) -> str:
    if ci.mean is None:
        return "-"
    return fnum(ci.mean, 4) + ("" if ci.lo is None else f" ± {fnum((ci.hi - ci.lo) / 2, 4)}")


def _cell(c: pd.DataFrame, d: int) -> str:
    r = c.loc[d]
    if r["lo"] is None or (isinstance(r["lo"], float) and math.isnan(r["lo"])):
        return fnum(r["mean"], 4)
    return f"{fnum(r['mean'], 4)} ± {fnum((r['hi'] - r['lo']) / 2, 4)}"


def depth_section(frames: Frames) -> list[str]:
    out = ["## Test-time recurrence", ""]
    df = depth_frame(frames)
    if df.empty:
        return out + need("No test-time depth rows: `benchctl depth` (and `benchctl depth --exit kl`) produce them.")
    out.append(
        "Validation loss on the runs' fixed validation windows when the recurrent models run more or fewer "
        "iterations than they were trained with (past the trained depth FraiLT and relaxed follow the "
        "extrapolation rule shown), and with the per-token adaptive exit."
    )
    out.append("")
    out += _tables(df)
    sentences = verdicts(frames.ctx, df)
    if sentences:
        out += [
            "Past the trained depth (loss at 2× the trained depth minus loss at it, per seed): improves / degrades "
            f"= its 95% CI over seeds lies below / above 0; saturates = the change is shown to lie within "
            f"±{SATURATION_MARGIN:g} nats by two one-sided t-tests at α = {ALPHA} (TOST: its "
            f"{round(100 * (1 - 2 * ALPHA))}% CI inside the margin); a CI that merely contains 0 shows none of the "
            "three. Over training seeds only, on the same validation windows for every depth:",
            "",
        ]
        out += sentences + [""]
    ctx = frames.ctx
    hist, what = fig_exit_hist(df)
    for name, f, alt in (
        ("depth_loss.png", fig_depth_loss(ctx, df), "Validation loss against inference depth"),
        ("depth_frontier.png", fig_frontier(ctx, df), "Loss against mean depth: exit vs fixed"),
        ("depth_exit_hist.png", hist, f"Per-token exit depths ({what})"),
    ):
        if f is not None:
            frames.figures[name] = f
            out += [f"![{alt}](figures/{name})", ""]
    return out
