"""Report sections for models that differ in size or compute: loss against training compute, against parameters,
and against training depth.

They appear when the preset's finished models span more than one unique-parameter count or FLOPs/token (equal
tokens then no longer mean equal compute). FLOPs are the project's analytic count (`BaseLM.flops_per_token`, through
`benchctl.core.accounting`): every matmul, attention scores and the tied head included, recurrence counted per block
application, forward + backward = 3x forward where gradients flow. A run's training FLOPs are what it spent, the
`train_flops` metric it recorded at its last step (its forwards' own count for an architecture whose compute depends
on the data: halting, routing); a run from before that metric was recorded falls back to its FLOPs per token times
the tokens it trained on, which for an adaptive architecture is the upper bound, shown beside what it spent.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

from benchctl.core import stats
from benchctl.report.context import ARCH_COLOURS, CONTROL, Context, model_keys
from benchctl.report.figures import MAX_LEGEND, _figure, _style, _title, legend_groups, unique_entries
from benchctl.report.fmt import fint, fnum, md_table, missing
from benchctl.report.frames import Frames, accounting_frame, curve_frame, vals

FLOP_DEFINITION = (
    "FLOPs are benchctl's analytic count: every matmul (the seven projections of each block "
    "application, LoRA and adapters, attention over the full score matrix, the tied head), forward + "
    "backward = 3x forward where gradients flow; elementwise ops and the embedding lookup are not "
    "counted. Training FLOPs = FLOPs/token x tokens trained on."
)


def run_frame(frames: Frames) -> pd.DataFrame:
    """One row per done run: model, arch, seed, final loss, unique and effective parameters, FLOPs/token, block
    applications per token, tokens and training FLOPs. The accounting comes from each model's config."""
    cols = [
        "model",
        "arch",
        "seed",
        "final",
        "params",
        "effective",
        "fpt",
        "depth",
        "tokens",
        "train_flops",
        "max_flops",
    ]
    ctx = frames.ctx
    if ctx.done.empty:
        return pd.DataFrame(columns=cols)
    acc = _accounting(frames)
    spent = spent_flops(frames)
    rows = []
    for r in ctx.done.to_dict("records"):
        a = acc.get(r["model"], {})
        fpt = _num(a.get("flops_per_token")) or _num(r.get("flops_per_token"))
        tokens = _num(r.get("tokens_seen"))
        analytic = fpt * tokens if fpt and tokens else None
        rows.append(
            {
                "model": r["model"],
                "arch": r["arch"],
                "seed": int(r["seed"]),
                "final": _num(r.get("final_val_loss")),
                "params": _num(a.get("total_params")) or _num(r.get("n_params")),
                "effective": _num(a.get("effective_params")) or _num(r.get("effective_params")),
                "fpt": fpt,
                "depth": _num(a.get("effective_depth")),
                "tokens": tokens,
                "train_flops": spent.get(r["id"], analytic),
                "max_flops": analytic,
            }
        )
    return pd.DataFrame(rows, columns=cols)


def _flops_metric(frames: Frames) -> pd.DataFrame:
    """The done runs' `train_flops` rows: run_id, step, value (cumulative training FLOPs spent up to the step);
    once per report."""

    def compute() -> pd.DataFrame:
        m = frames.data.metrics
        if m.empty or frames.ctx.done.empty:
            return pd.DataFrame(columns=["run_id", "step", "value"])
        df = m[(m["name"] == "train_flops") & m["run_id"].isin(set(frames.ctx.done["id"]))][["run_id", "step", "value"]]
        df = df.assign(
            step=pd.to_numeric(df["step"], errors="coerce"), value=pd.to_numeric(df["value"], errors="coerce")
        )
        return df.dropna().sort_values(["run_id", "step"])

    return frames.once("train_flops rows", compute)


def _flops_by_run(frames: Frames) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """run id -> (steps, cumulative FLOPs) of its `train_flops` rows, each starting at (0, 0); once per report."""

    def compute() -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {
            str(rid): (
                np.concatenate([[0.0], g["step"].to_numpy(float)]),
                np.concatenate([[0.0], g["value"].to_numpy(float)]),
            )
            for rid, g in _flops_metric(frames).groupby("run_id", sort=False)
        }

    return frames.once("train_flops by run", compute)


def spent_flops(frames: Frames) -> dict[str, float]:
    """run id -> the training FLOPs it spent, for the done runs that recorded them at their last step."""
    done = frames.ctx.done
    last_step = dict(zip(done["id"], pd.to_numeric(done["step"], errors="coerce"))) if "step" in done else {}
    out: dict[str, float] = {}
    for rid, g in _flops_metric(frames).groupby("run_id"):
        last = g.iloc[-1]
        if last_step.get(rid) is None or float(last["step"]) == float(last_step[rid]):
            out[str(rid)] = float(last["value"])
    return out


def flops_at_steps(frames: Frames, run_id: str, steps: np.ndarray) -> np.ndarray | None:
    """A run's cumulative training FLOPs spent at the given steps, interpolated between its logged steps (None when
    it recorded none)."""
    found = _flops_by_run(frames).get(run_id)
    if found is None:
        return None
    xs, ys = found
    return np.interp(steps.astype(float), xs, ys)


def _accounting(frames: Frames) -> dict[str, dict[str, Any]]:
    """model -> its accounting row, computed once per report (every section of a grid of a hundred models asks)."""

    def rows() -> dict[str, dict[str, Any]]:
        df = accounting_frame(frames.ctx)
        return {} if df.empty else {r["model"]: r for r in df.to_dict("records")}

    return frames.once("accounting rows", rows)


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def model_frame(runs: pd.DataFrame, ctx: Context) -> pd.DataFrame:
    """Per model: its arch, seeds, mean final loss with its 95% CI over seeds, and the mean of each accounting
    quantity, in the report's model order."""
    rows = []
    for m in ctx.done_models:
        g = runs[runs["model"] == m]
        if g.empty:
            continue
        ci = stats.mean_ci(vals(g, "final"))
        row = {"model": m, "arch": ctx.arch_of[m], "seeds": len(g), "final": ci.mean, "lo": ci.lo, "hi": ci.hi}
        for c in ("params", "effective", "fpt", "depth", "tokens", "train_flops", "max_flops"):
            v = vals(g, c)
            row[c] = float(np.mean(v)) if v else None
        rows.append(row)
    return pd.DataFrame(rows)


def spans_sizes(frames: Frames) -> bool:
    """True when the done models differ in unique parameters or FLOPs/token: then these sections are shown."""
    runs = run_frame(frames)
    if runs.empty:
        return False
    return runs["params"].nunique(dropna=True) > 1 or runs["fpt"].nunique(dropna=True) > 1


def is_control_family(ctx: Context, model: str) -> bool:
    return ctx.arch_of.get(model) == CONTROL


# --------------------------------------------------------------------------------------------------------------------
# Sections


def compute_section(frames: Frames) -> list[str]:
    if not spans_sizes(frames):
        return []
    ctx = frames.ctx
    runs = run_frame(frames)
    per = model_frame(runs, ctx)
    out = ["## Loss against compute", ""]
    scale, unit = flop_unit(max(vals(per, "train_flops"), default=0.0))
    # an architecture whose compute depends on the data spends less than its analytic count: both are shown
    adaptive = any(
        not (missing(r["train_flops"]) or missing(r["max_flops"])) and abs(r["train_flops"] / r["max_flops"] - 1) > 1e-9
        for r in per.to_dict("records")
    )
    headers = ["model", "arch", "seeds", "MFLOP/token", "tokens/run", f"training {unit}"]
    headers += [f"analytic max {unit}"] if adaptive else []
    headers += ["final val loss", "95% CI"]
    rows = [
        [
            r["model"],
            r["arch"],
            r["seeds"],
            fnum(_scale(r["fpt"], 1e6), 3),
            fint(r["tokens"]),
            fnum(_scale(r["train_flops"], scale), 3),
            *([fnum(_scale(r["max_flops"], scale), 3)] if adaptive else []),
            fnum(r["final"]),
            _ci(r),
        ]
        for r in per.to_dict("records")
    ]
    out += md_table(headers, rows, right=range(2, len(headers))) + [""]
    out.append(
        FLOP_DEFINITION + " The control's frontier (a step line over the models of the control architecture) is, "
        "at each x, the lowest mean final loss of any control model that spent that much compute or less: a model "
        "below it reaches a lower loss than every control model that used no more training compute (or, on the "
        "parameters panel, no more parameters). Between control models the frontier is flat, not interpolated: "
        "nothing was measured there."
    )
    if adaptive:
        out[-1] += (
            " Training FLOPs are as spent: a model whose depth depends on the data (halting, routing) counts the "
            "block applications its forwards really ran, and MFLOP/token and the analytic maximum are its "
            "full-depth cost, the upper bound."
        )
    out.append("")
    curves = curve_frame(ctx, frames.data.metrics)
    fig = fig_loss_vs_compute(ctx, runs, per, curves, frames)
    if fig is not None:
        frames.figures["loss_vs_compute.png"] = fig
        out += ["![Final validation loss against training FLOPs](figures/loss_vs_compute.png)", ""]
    return out


def params_section(frames: Frames) -> list[str]:
    if not spans_sizes(frames):
        return []
    ctx = frames.ctx
    runs = run_frame(frames)
    per = model_frame(runs, ctx)
    out = ["## Loss against parameters", ""]
    headers = ["model", "arch", "seeds", "unique params", "effective params", "final val loss", "95% CI"]
    rows = [
        [r["model"], r["arch"], r["seeds"], fint(r["params"]), fint(r["effective"]), fnum(r["final"]), _ci(r)]
        for r in per.to_dict("records")
    ]
    out += md_table(headers, rows, right=range(2, len(headers))) + [""]
    out.append(
        "Unique parameters are the weights stored (a shared block counted once); effective parameters count "
        "a block once per application to a token, as an unrolled model would store them."
    )
    out.append("")
    fig = fig_loss_vs_params(ctx, runs, per)
    if fig is not None:
        frames.figures["loss_vs_params.png"] = fig
        out += ["![Final validation loss against parameters](figures/loss_vs_params.png)", ""]
    return out


def depth_families(ctx: Context, per: pd.DataFrame) -> dict[str, list[str]]:
    """arch -> its models that differ from each other only in model.n_recur (two or more), by depth."""
    out: dict[str, list[str]] = {}
    for arch in dict.fromkeys(per["arch"]) if not per.empty else []:
        groups: dict[str, list[str]] = {}
        for m in per.loc[per["arch"] == arch, "model"]:
            cfg = ctx.done_of(m)["config_json"].iloc[0]
            keys = {k: v for k, v in model_keys(cfg).items() if k != "model.n_recur"}
            groups.setdefault(repr(sorted(keys.items(), key=lambda kv: kv[0])), []).append(m)
        best = max(groups.values(), key=len)
        if len(best) > 1:
            depth = dict(zip(per["model"], per["depth"]))
            out[arch] = sorted(best, key=lambda m: depth.get(m) or 0)
    return out


def depth_section(frames: Frames) -> list[str]:
    ctx = frames.ctx
    runs = run_frame(frames)
    per = model_frame(runs, ctx)
    fams = depth_families(ctx, per)
    if not fams:
        return []
    out = ["## Loss against training depth", ""]
    headers = ["arch", "model", "seeds", "block applications/token", "n_recur", "final val loss", "95% CI"]
    rows = []
    for arch, models in fams.items():
        for m in models:
            r = per[per["model"] == m].iloc[0].to_dict()
            n_recur = model_keys(ctx.done_of(m)["config_json"].iloc[0]).get("model.n_recur")
            rows.append(
                [
                    arch,
                    m,
                    r["seeds"],
                    fint(r["depth"]),
                    n_recur if n_recur is not None else "-",
                    fnum(r["final"]),
                    _ci(r),
                ]
            )
    out += md_table(headers, rows, right=range(2, len(headers))) + [""]
    out.append(
        "Each architecture trained at several depths, everything else equal; x = block applications per token "
        "(frailt and relaxed: passes × 4 blocks; three-part: prelude + core iterations × core blocks + coda). "
        "Deeper models also cost more FLOPs per token, so this is not an equal-compute comparison."
    )
    out.append("")
    fig = fig_loss_vs_depth(ctx, per, fams)
    if fig is not None:
        frames.figures["loss_vs_depth.png"] = fig
        out += ["![Final validation loss against training depth](figures/loss_vs_depth.png)", ""]
    return out


def flop_unit(max_flops: float) -> tuple[float, str]:
    """The largest of GFLOP, TFLOP, PFLOP, EFLOP that keeps `max_flops` at 1 or more (GFLOP below that)."""
    for scale, unit in ((1e18, "EFLOP"), (1e15, "PFLOP"), (1e12, "TFLOP")):
        if max_flops >= scale:
            return scale, unit
    return 1e9, "GFLOP"


def _scale(x: Any, s: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x) / s


def _ci(r: dict[str, Any]) -> str:
    if r["lo"] is None or (isinstance(r["lo"], float) and math.isnan(r["lo"])):
        return "-"
    return f"{fnum(r['lo'])} to {fnum(r['hi'])}"


# --------------------------------------------------------------------------------------------------------------------
# Figures


def _scatter_panel(ax: Any, ctx: Context, runs: pd.DataFrame, per: pd.DataFrame, x: str, xlabel: str) -> None:
    """Final loss against `x` (log scale): a dot per seed, a diamond per model mean, the control's frontier as a
    step line."""
    colour, entry = legend_groups(ctx, list(per["model"]))
    for m in per["model"]:
        g, r = runs[runs["model"] == m], per[per["model"] == m].iloc[0]
        if missing(r[x]) or missing(r["final"]):
            continue
        ax.scatter(g[x], g["final"], s=18, color=colour[m], alpha=0.55, edgecolor="none", zorder=2)
        ax.scatter(
            [r[x]],
            [r["final"]],
            s=60,
            marker="D",
            color=colour[m],
            edgecolor="black",
            linewidth=0.7,
            zorder=3,
            label=entry[m],
        )
    fam = per[[is_control_family(ctx, m) for m in per["model"]]].dropna(subset=[x, "final"])
    if len(fam) > 1:
        xs, ys = lower_envelope(fam[x].to_numpy(float), fam["final"].to_numpy(float))
        ax.plot(
            xs,
            ys,
            color=ctx.colours.get(CONTROL, "#4D4D4D"),
            linewidth=1.4,
            linestyle="--",
            drawstyle="steps-post",
            zorder=1,
            label="control frontier (best control at ≤ x)",
        )
    _log_x(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final validation loss (nats/token)")


def lower_envelope(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The staircase of the best y reached at or below each x: the points (sorted by x) where the running minimum
    of y changes, then the largest x at the last minimum, so a "steps-post" line spans every model. A point under it
    beats every model at its x or less; a line joining the models sorted by x claims that only where it happens to
    fall."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    keep_x, keep_y = [xs[0]], [ys[0]]
    for a, b in zip(xs[1:], ys[1:]):
        if b < keep_y[-1]:
            keep_x.append(a)
            keep_y.append(b)
    if xs[-1] > keep_x[-1]:
        keep_x.append(xs[-1])
        keep_y.append(keep_y[-1])
    return np.array(keep_x), np.array(keep_y)


def _log_x(ax: Any) -> None:
    """Log x labelled at 1, 2 and 5 times each power of ten in short engineering form (70k, 2M, 5G), so a range
    narrower than a decade still has labels and neighbouring labels never overlap."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _legend(fig: Any, ax: Any, n_models: int) -> None:
    """Below the panels (never over a point): a model per entry, or an architecture per entry past MAX_LEGEND."""
    handles, labels = unique_entries(*ax.get_legend_handles_labels())
    what = "model" if n_models <= MAX_LEGEND else f"architecture, {n_models} models"
    fig.legend(
        handles,
        labels,
        title=f"{what} (diamond = mean over seeds, dot = seed)",
        frameon=True,
        fontsize=8.5,
        title_fontsize=9,
        loc="outside lower center",
        ncols=min(len(labels), 5),
    )


def _curve_flops(frames: Frames | None, model: str, c: pd.DataFrame, fpt: float | None) -> np.ndarray | None:
    """x of a model's validation curve: the cumulative training FLOPs its runs spent at each step (mean over its
    seeds), or tokens x FLOPs/token for runs that recorded none."""
    if frames is not None:
        per_run = [flops_at_steps(frames, rid, c["step"].to_numpy(float)) for rid in frames.ctx.done_of(model)["id"]]
        got = [f for f in per_run if f is not None]
        if got and len(got) == len(per_run):
            return np.mean(got, axis=0)
    return c["tokens"].to_numpy(float) * fpt if fpt else None


def fig_loss_vs_compute(
    ctx: Context, runs: pd.DataFrame, per: pd.DataFrame, curves: pd.DataFrame, frames: Frames | None = None
) -> Any:
    """Left: final loss against training FLOPs (as spent). Right: the validation curves against cumulative training
    FLOPs."""
    if per.empty or per["train_flops"].isna().all():
        return None
    fpt = dict(zip(per["model"], per["fpt"]))
    colour, _ = legend_groups(ctx, list(per["model"]))
    with _style():
        fig = _figure(12.0, 5.8)
        left, right = fig.subplots(1, 2)
        _scatter_panel(left, ctx, runs, per, "train_flops", "training FLOPs (log scale)")
        left.set_title("final loss against training compute", fontsize=11)
        for m in [m for m in ctx.models if m in set(curves["model"])] if not curves.empty else []:
            c = curves[(curves["model"] == m) & (curves["tokens"] > 0)]
            x = None if c.empty else _curve_flops(frames, m, c, fpt.get(m))
            if x is None:
                continue
            right.plot(x, c["mean"], color=colour.get(m, ctx.colours[m]), linewidth=1.6)
        _log_x(right)
        right.set_xlabel("cumulative training FLOPs (log scale)")
        right.set_ylabel("validation loss (nats/token), mean over seeds")
        right.set_title("validation loss during training", fontsize=11)
        _legend(fig, left, len(per))
        fig.suptitle(f"Loss against training compute · preset {ctx.preset}", fontsize=12.5, fontweight="bold")
    return fig


def fig_loss_vs_params(ctx: Context, runs: pd.DataFrame, per: pd.DataFrame) -> Any:
    if per.empty or per["params"].isna().all():
        return None
    with _style():
        fig = _figure(12.0, 5.6)
        left, right = fig.subplots(1, 2, sharey=True)
        _scatter_panel(left, ctx, runs, per, "params", "unique parameters (log scale)")
        left.set_title("against unique parameters", fontsize=11)
        _scatter_panel(right, ctx, runs, per, "effective", "effective parameters (log scale)")
        right.set_title("against effective (unrolled) parameters", fontsize=11)
        _legend(fig, left, len(per))
        fig.suptitle(f"Loss against parameters · preset {ctx.preset}", fontsize=12.5, fontweight="bold")
    return fig


def fig_loss_vs_depth(ctx: Context, per: pd.DataFrame, fams: dict[str, list[str]]) -> Any:
    with _style():
        fig = _figure(8.0, 5.0)
        ax = fig.add_subplot()
        for arch, models in fams.items():
            g = per.set_index("model").loc[models]
            colour = ARCH_COLOURS.get(arch, ctx.colours[models[0]])
            ax.plot(g["depth"], g["final"], color=colour, marker="o", linewidth=1.8, label=arch)
            ok = g["lo"].notna()
            if ok.any():
                ax.errorbar(
                    g.loc[ok, "depth"],
                    g.loc[ok, "final"],
                    yerr=[g.loc[ok, "final"] - g.loc[ok, "lo"], g.loc[ok, "hi"] - g.loc[ok, "final"]],
                    fmt="none",
                    color=colour,
                    capsize=4,
                    linewidth=1,
                )
            for m, row in g.iterrows():
                ax.annotate(
                    m,
                    (row["depth"], row["final"]),
                    xytext=(4, 4),
                    textcoords="offset points",
                    fontsize=7.5,
                    color="#333333",
                )
        ax.set_xscale("log", base=2)
        depths = sorted({float(d) for models in fams.values() for d in per.set_index("model").loc[models, "depth"]})
        ax.set_xticks(depths, _spaced_labels(depths))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("block applications per token (log scale)")
        ax.set_ylabel("final validation loss (nats/token)")
        ax.legend(title="architecture", fontsize=9, title_fontsize=9, frameon=True, loc="best")
        n = int(per["seeds"].max())
        _title(
            ax,
            "Loss against training depth",
            [
                f"preset {ctx.preset} · point = mean over {n} seed{'s' if n != 1 else ''}"
                + (", bar = 95% CI" if n > 1 else "")
            ],
        )
    return fig


def _spaced_labels(ticks: list[float], min_log2_gap: float = 0.2) -> list[str]:
    """Tick labels on a log2 axis, blank where a tick sits too close to the previous labelled one (30 and 32 block
    applications would print as one unreadable '3032'); the point's own annotation still names it."""
    out, last = [], -math.inf
    for t in ticks:
        x = math.log2(t) if t > 0 else -math.inf
        out.append(f"{t:g}" if x - last >= min_log2_gap else "")
        if out[-1]:
            last = x
    return out
