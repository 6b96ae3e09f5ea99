"""Report section of the infer stage, "Inference cost": per model and inference setting the decode speed at batch 1
and at a batch, KV-cache megabytes per 1,000 tokens, FLOPs spent per generated token, the teacher-forced loss and the
agreement with full depth, and the machine's load and the process's CPU share while it was timed, rows timed on a
contended machine flagged as contended training runs are; a frontier figure (per recurrent model, each setting's
paired decode speed-up and KV bytes against full depth's, against its loss change, every point labelled); one
sentence per recurrent model on which setting, if any, is both cheaper and shown no worse than its full depth
(non-inferiority within MARGIN, Holm-adjusted over the settings it picks from); and the latent view: per-position
convergence across iterations as a heatmap and 2-D PCA trajectories of a few tokens' states.

Rows come from `inference_results` and `inference_latents` (`benchctl infer`), only for runs that are done in the
report's preset. Means over seeds carry 95% t-intervals (benchctl.core.stats); the loss change against full depth is
paired by seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

import architectures
from benchctl.core import stats
from benchctl.report.figures import _figure, _style, label_points, tick
from benchctl.report.fmt import fnum, md_table, need
from benchctl.report.frames import Frames
from benchctl.stages.train.cost import contention

FIGURES = ("infer_frontier.png", "infer_convergence.png", "infer_trajectories.png")
FULL = "full depth"  # the label `benchctl infer` stores for the full-depth setting
# nats: a setting is "no worse" than full depth when its loss is shown to rise by less than this: a one-sided t over
# the seeds' paired changes (non-inferiority, stats.noninferiority) at ALPHA. The sentence names one setting out of
# every cheaper one it looked at, so the p-values are Holm-adjusted over those settings before any is chosen.
MARGIN = 0.01
ALPHA = 0.05
_SIZES = ("prompts", "single", "prompt_tokens", "new_tokens", "windows")


def _iterable(ctx: Any, model: str) -> bool:
    try:
        return architectures.get(ctx.arch_of.get(model, "")).iterable()
    except architectures.UnknownArchitectureError:
        return False


def infer_frame(frames: Frames) -> pd.DataFrame:
    """inference_results rows of the preset's done runs with model and seed; per model the measurement sizes with
    the most rows (rows of other sizes measure other prompts and are not comparable)."""
    ctx, d = frames.ctx, frames.data.inference_results
    if d is None or d.empty or ctx.done.empty:
        return pd.DataFrame()
    runs = ctx.done[["id", "model", "seed"]].rename(columns={"id": "run_id"})
    df = d.merge(runs, on="run_id", how="inner")
    if df.empty:
        return df
    df["sizes"] = [tuple(r) for r in df[list(_SIZES)].itertuples(index=False)]
    keep = df.groupby("model")["sizes"].agg(lambda s: s.value_counts().index[0]).to_dict()
    df = df[[s == keep[m] for m, s in zip(df["model"], df["sizes"])]]
    return df.reset_index(drop=True)


def _order(g: pd.DataFrame) -> list[str]:
    """Settings in display order: full depth, the exit settings by threshold and KV strategy, the drafts."""
    first = g.drop_duplicates("setting").copy()
    first["rank"] = [0 if s == FULL else 1 if k == "plain" else 2 for s, k in zip(first["setting"], first["kind"])]
    first = first.sort_values(["rank", "warm_start", "exit_threshold", "kv", "draft_n_recur", "setting"])
    return list(first["setting"])


def _mean(h: pd.DataFrame, col: str) -> float | None:
    v = pd.to_numeric(h[col], errors="coerce").dropna()
    return float(v.mean()) if len(v) else None


def _changes(g: pd.DataFrame, setting: str) -> list[float]:
    """Loss under `setting` minus loss at full depth, one per seed that has both."""
    per_seed = g.pivot_table(index="seed", columns="setting", values="val_loss", aggfunc="first")
    if FULL not in per_seed.columns or setting not in per_seed.columns:
        return []
    return [float(v) for v in (per_seed[setting] - per_seed[FULL]).dropna()]


def _loss_change(g: pd.DataFrame, setting: str) -> stats.MeanCI:
    """Loss under `setting` minus loss at full depth, paired by seed: mean and 95% CI."""
    return stats.mean_ci(_changes(g, setting))


def _ci_text(ci: stats.MeanCI, digits: int = 4) -> str:
    if ci.mean is None:
        return "-"
    if ci.lo is None:
        return f"{ci.mean:+.{digits}f} (1 seed)"
    return f"{ci.mean:+.{digits}f} [{ci.lo:+.{digits}f}, {ci.hi:+.{digits}f}]"


def _repeats_note(df: Any) -> str:
    """How many timed generations each speed is the median of (rows measured before benchctl repeated them have
    none recorded: one generation each)."""
    if "repeats" not in df:
        return ", one timed generation each"
    counts = sorted({int(r) if r == r and r is not None else 1 for r in df["repeats"]})
    if len(counts) == 1:
        n = counts[0]
        return ", one timed generation each" if n == 1 else f", each the median of {n} timed generations"
    return f", each the median of its row's timed generations ({counts[0]} to {counts[-1]})"


def paired_speedups(h: pd.DataFrame, size: str = "single") -> list[float]:
    """Every repeat's paired speed-up ratio (setting over full depth, timed beside it) over the rows (seeds) of one
    setting; rows measured without pairing add none."""
    out: list[float] = []
    if "speedups_json" not in h:
        return out
    for text in h["speedups_json"]:
        if isinstance(text, str) and text:
            out += [float(v) for v in json.loads(text).get(size, []) if v is not None]
    return out


def speed_text(h: pd.DataFrame) -> str | None:
    """The batch-1 speed-up of one setting over full depth from its paired timings: the median ratio, how many of
    the timings were faster, and the one-sided sign-test p of "faster" (each timing's ratio above or below 1 is a
    fair coin if the setting is no faster)."""
    ratios = paired_speedups(h)
    if not ratios:
        return None
    faster = sum(r > 1 for r in ratios)
    p = stats.binom_above_chance(faster, len(ratios), 0.5)
    return (
        f"decode at batch 1 ×{fnum(float(np.median(ratios)), 2)} full depth's tokens/s (median of {len(ratios)} "
        f"timings beside full depth, {min(ratios):.2f}–{max(ratios):.2f}; faster in {faster} of {len(ratios)}, "
        f"sign test {stats.fmt_p(p)})"
    )


def row_contention(r: dict[str, Any]) -> str | None:
    """Why one inference_results row's timings are not a cost measure, by the rule training runs are read with
    (benchctl.stages.train.cost.contention): the machine's load above its cores. None when nothing says so, also
    for rows measured before the load was recorded."""
    return contention({"load_avg": r.get("load_avg"), "cores": r.get("cores")})


def _contended(h: pd.DataFrame) -> bool:
    return any(row_contention(r) for r in h.to_dict("records"))


def _has_load(df: pd.DataFrame) -> bool:
    return any(c in df and pd.to_numeric(df[c], errors="coerce").notna().any() for c in ("load_avg", "cpu_share"))


def contention_note(ctx: Any, df: pd.DataFrame) -> list[str]:
    """One paragraph naming the rows (model, setting, seeds) timed on a contended machine, the mark † explains."""
    flagged = [(r, why) for r in df.to_dict("records") if (why := row_contention(r))]
    if not flagged:
        return []
    loads = [float(r["load_avg"]) for r, _ in flagged]
    cores = sorted({int(r["cores"]) for r, _ in flagged})
    span = fnum(min(loads), 1) if min(loads) == max(loads) else f"{fnum(min(loads), 1)}–{fnum(max(loads), 1)}"
    under = f"mean load {span} on {'/'.join(map(str, cores))} cores"
    if len(flagged) == len(df):
        who = f"All {len(df)} rows were"
    else:
        seeds: dict[tuple[str, str], list[int]] = {}
        for r, _ in flagged:
            seeds.setdefault((r["model"], r["setting"]), []).append(int(r["seed"]))
        order = {m: i for i, m in enumerate(ctx.models)}
        parts = [
            f"{m} `{s}` seed{'s' if len(v) > 1 else ''} {', '.join(map(str, sorted(v)))}"
            for (m, s), v in sorted(seeds.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1]))
        ]
        who = "; ".join(parts) + (" were" if len(flagged) > 1 else " was")
    their = "their" if len(flagged) > 1 else "its"
    return [
        f"† {who} timed on a contended machine ({under}; training runs are flagged by the same rule): {their} "
        "tokens/s are not a cost measure here. A paired ratio (× full b1, and the figure's speed-ups) is timed "
        "beside full depth in each repeat, so the load falls on both of its sides alike.",
        "",
    ]


def _table(ctx: Any, model: str, g: pd.DataFrame, load: bool) -> list[str]:
    """One model's settings; `load`: with the load and CPU share columns (rows of an older benchctl have none)."""
    batch = int(g["prompts"].iloc[0])
    rows = []
    for setting in _order(g):
        h = g[g["setting"] == setting]
        loss = stats.mean_ci(h["val_loss"].astype(float))
        kv = _mean(h, "kv_bytes_per_1k")
        flops = _mean(h, "flops_per_token")
        rows.append(
            [
                setting + (" †" if _contended(h) else ""),
                int(h["seed"].nunique()),
                fnum(_mean(h, "tokens_per_s_1"), 0),
                fnum(float(np.median(r)), 2) if (r := paired_speedups(h)) else "-",
                fnum(_mean(h, "tokens_per_s_batch"), 0),
                fnum(None if kv is None else kv / 1e6, 3),
                fnum(None if flops is None else flops / 1e6, 3),
                fnum(_mean(h, "mean_depth"), 2),
                fnum(loss.mean, 4) + ("" if loss.lo is None else f" ± {fnum(loss.half_width, 4)}"),
                "-" if setting == FULL else _ci_text(_loss_change(g, setting)),
                fnum(_mean(h, "agreement"), 3),
                fnum(_mean(h, "acceptance_rate"), 3),
            ]
            + ([fnum(_mean(h, "load_avg"), 1), fnum(_mean(h, "cpu_share"), 2)] if load else [])
        )
    heads = [
        "setting",
        "seeds",
        "tok/s b1",
        "× full b1",
        f"tok/s b{batch}",
        "KV MB/1k tok",
        "MFLOP/tok",
        "mean depth",
        "loss",
        "Δ loss vs full [95% CI]",
        "agreement",
        "acceptance",
    ] + (["load avg", "CPU share"] if load else [])
    return (
        [f"**{model}**" + (" (reference)" if not _iterable(ctx, model) else ""), ""]
        + md_table(heads, rows, right=range(1, len(heads)))
        + [""]
    )


def verdict(ctx: Any, model: str, g: pd.DataFrame) -> str | None:
    """One sentence: the cheapest setting that is cheaper than full depth (no more FLOPs spent per generated token
    and no more KV bytes, less of one) and no worse, or that none is shown to be.

    No worse = non-inferior: the loss change against full depth, paired by seed, shown below +MARGIN by a one-sided
    t-test at ALPHA, its p Holm-adjusted over every cheaper setting of the model (the family the sentence picks
    from). With one seed nothing is tested: the sentence names the cheapest setting whose change is below MARGIN
    for that one trained model and says it is not a test."""
    if not _iterable(ctx, model):
        return None
    full = g[g["setting"] == FULL]
    if full.empty:
        return f"- {model}: no full-depth row to compare against; run `benchctl infer`."
    f_flops, f_kv = _mean(full, "flops_per_token"), _mean(full, "kv_bytes_per_1k")
    cheaper = []
    for setting in _order(g):
        if setting == FULL:
            continue
        h = g[g["setting"] == setting]
        flops, kv = _mean(h, "flops_per_token"), _mean(h, "kv_bytes_per_1k")
        if flops is None or kv is None or f_flops is None or f_kv is None:
            continue
        if flops <= f_flops and kv <= f_kv and (flops < f_flops or kv < f_kv):
            cheaper.append((flops, kv, setting, _loss_change(g, setting)))
    if not cheaper or f_flops is None or f_kv is None:
        return f"- {model}: no setting spends fewer FLOPs per generated token or holds fewer KV bytes than full depth."
    cheaper.sort(key=lambda c: (c[0], c[1]))

    def cost(flops: float, kv: float) -> str:
        return (
            f"{fnum(flops / 1e6, 3)} against {fnum(f_flops / 1e6, 3)} MFLOP per generated token, "
            f"{fnum(kv / 1e6, 3)} against {fnum(f_kv / 1e6, 3)} KV MB per 1,000 tokens"
        )

    seeds = int(full["seed"].nunique())
    if seeds < 2:
        below = [c for c in cheaper if c[3].mean is not None and c[3].mean < MARGIN]
        flops, kv, setting, ci = (below or cheaper)[0]
        if below:
            what = (
                f"`{setting}`, the cheapest setting whose loss change is below +{MARGIN:g} nats for this one "
                f"trained model, spends {cost(flops, kv)} with loss change {_ci_text(ci)}"
            )
        else:
            what = (
                f"no cheaper setting changes the loss by less than +{MARGIN:g} nats for this one trained model; the "
                f"cheapest, `{setting}`, spends {cost(flops, kv)} with loss change {_ci_text(ci)}"
            )
        return (
            f"- {model}: one seed, so nothing is tested: {what}; showing a setting no worse for the architecture "
            f"needs two seeds or more{_speed_clause(g, setting)}."
        )
    tests = [stats.noninferiority(_changes(g, c[2]), MARGIN, ALPHA) for c in cheaper]
    adjusted = stats.holm([t.p for t in tests])
    k = sum(1 for t in tests if t.p is not None)
    family = f"the {k} cheaper setting{'s' if k != 1 else ''} of {model}"
    test = f"a one-sided t over {seeds} seeds"

    def evidence(i: int) -> str:
        t, p_adj = tests[i], adjusted[i]
        if t.p is None or p_adj is None:
            return f"not testable: {t.reason}"
        return f"non-inferiority {stats.fmt_p(t.p)}, Holm-adjusted {stats.fmt_p(p_adj)} over {family}"

    good = [i for i, p in enumerate(adjusted) if p is not None and p < ALPHA]
    if not good:
        flops, kv, setting, ci = cheaper[0]
        return (
            f"- {model}: no cheaper setting is shown to be no worse than full depth (its loss change below "
            f"+{MARGIN:g} nats by {test}, Holm-adjusted over {family}); the cheapest, `{setting}`, spends "
            f"{cost(flops, kv)} with loss change {_ci_text(ci)} ({evidence(0)}){_speed_clause(g, setting)}."
        )
    flops, kv, setting, ci = cheaper[good[0]]
    return (
        f"- {model}: `{setting}` is cheaper than full depth ({cost(flops, kv)}) and no worse: loss change "
        f"{_ci_text(ci)}, shown below +{MARGIN:g} nats by {test} ({evidence(good[0])})"
        f"{_speed_clause(g, setting)}."
    )


def _speed_clause(g: pd.DataFrame, setting: str) -> str:
    """The setting's paired batch-1 speed-up, if it was timed beside full depth. The setting was chosen by its
    counts, not its timings, so its sign test is the only one the sentence rests on."""
    text = speed_text(g[g["setting"] == setting])
    return "" if text is None else f"; {text}"


@dataclass(frozen=True)
class _Point:
    """One setting of one model against its full depth: what the frontier figure draws."""

    setting: str
    loss_change: float  # nats/token, paired by seed (0 for full depth)
    speedup: float | None  # batch-1 decode rate over full depth's
    paired: bool  # speedup from timings beside full depth (else a ratio of medians timed apart)
    kv: float | None  # KV bytes per token over full depth's
    contended: bool


def _unpaired_speedup(g: pd.DataFrame, setting: str) -> float | None:
    """Median over seeds of a setting's batch-1 rate over full depth's of the same run: for rows measured without
    paired timings, whose rates were taken minutes apart."""
    per_seed = g.pivot_table(index="seed", columns="setting", values="tokens_per_s_1", aggfunc="first")
    if FULL not in per_seed.columns or setting not in per_seed.columns:
        return None
    ratios = (per_seed[setting] / per_seed[FULL]).replace([np.inf, -np.inf], np.nan).dropna()
    return float(ratios.median()) if len(ratios) else None


def frontier_points(g: pd.DataFrame) -> list[_Point]:
    """Every setting of one model's rows against its full depth (none without a full-depth row): the loss change
    paired by seed, the stored paired speed-up (a ratio of medians only where a row has none) and the KV ratio."""
    full = g[g["setting"] == FULL]
    if full.empty:
        return []
    f_kv = _mean(full, "kv_bytes_per_1k")
    out = []
    for setting in _order(g):
        h = g[g["setting"] == setting]
        kv = _mean(h, "kv_bytes_per_1k")
        if setting == FULL:
            change, speed, paired = 0.0, 1.0, True
        else:
            change = _loss_change(g, setting).mean
            ratios = paired_speedups(h)
            paired = bool(ratios)
            speed = float(np.median(ratios)) if ratios else _unpaired_speedup(g, setting)
        if change is None:
            continue
        out.append(
            _Point(
                setting,
                float(change),
                speed,
                paired,
                None if kv is None or not f_kv else kv / f_kv,
                _contended(h),
            )
        )
    return out


_CONTENDED_EDGE = "#C00000"


def _draw_points(ax: Any, pts: list[_Point], colour: Any, value: str) -> list[tuple[float, float, str]]:
    """Plot one panel's points (`value`: "speedup" or "kv") and return the labels: points on the same spot share one,
    their settings one per line. Only a timing is flagged as contended or unpaired: the KV bytes are a count."""
    at: dict[tuple[float, float], list[str]] = {}
    for p in pts:
        y = getattr(p, value)
        if y is None:
            continue
        timing = value == "speedup"
        busy = timing and p.contended
        ax.plot(
            [p.loss_change],
            [y],
            marker="D" if p.setting == FULL else "o" if p.paired or not timing else "^",
            markersize=8 if p.setting == FULL else 6.5,
            linestyle="none",
            color=colour,
            markerfacecolor="white" if busy else colour,
            markeredgecolor=_CONTENDED_EDGE if busy else "black",
            markeredgewidth=1.6 if busy else 0.6,
            zorder=3,
        )
        at.setdefault((round(p.loss_change, 12), round(y, 12)), []).append(p.setting)
    return [(x, y, "\n".join(names)) for (x, y), names in at.items()]


_FRONTIER_COLUMNS = 3  # models side by side; more wrap to further rows, so the figure keeps a page's width


def fig_frontier(ctx: Any, df: pd.DataFrame) -> Any:
    """Per recurrent model, each setting against the model's own full depth: the paired batch-1 decode speed-up
    (top) and the KV cache (below it) against the loss change, every point labelled with its setting. Raw tokens/s
    of different rows were measured minutes apart, under whatever load the machine had then; a ratio timed beside
    full depth in each repeat is not (see the table's × full b1). None without a model that has settings to set
    against its full depth."""
    models = [m for m in ctx.models if m in set(df["model"]) and _iterable(ctx, m)]
    panels = [(m, pts) for m in models if len(pts := frontier_points(df[df["model"] == m])) > 1]
    if not panels:
        return None
    cols = min(len(panels), _FRONTIER_COLUMNS)
    blocks = -(-len(panels) // cols)
    with _style():
        fig = _figure(max(7.0, 0.6 + 4.6 * cols), 1.0 + 8.0 * blocks)  # one model: wide enough for the legend
        axes = fig.subplots(2 * blocks, cols, squeeze=False)
        for ax in axes.flat[2 * len(panels) :]:
            ax.set_visible(False)
        placed = []
        for i, (model, pts) in enumerate(panels):
            colour = ctx.colours.get(model)
            block, col = divmod(i, cols)
            for ax, value, ylabel in (
                (axes[2 * block, col], "speedup", "decode speed-up over full depth, batch 1 (×)"),
                (axes[2 * block + 1, col], "kv", "KV cache per token ÷ full depth's"),
            ):
                ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--", zorder=1)
                ax.axvline(0.0, color="#888888", linewidth=0.8, linestyle="--", zorder=1)
                placed.append((ax, _draw_points(ax, pts, colour, value)))
                ax.margins(x=0.25, y=0.25)  # room around the outermost points for their labels
                ax.set_ylabel(ylabel, fontsize=9.5)
                ax.set_xlabel("loss change vs full depth (nats/token)", fontsize=9.5)
                ax.set_title(tick(model), fontsize=11)
        handles = [
            Line2D([], [], marker="D", linestyle="none", color="#555555", markeredgecolor="black", label="full depth"),
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                color="#555555",
                markeredgecolor="black",
                label="paired: median ratio of the timings beside full depth",
            ),
        ]
        if any(not p.paired and p.speedup is not None for _, pts in panels for p in pts):
            handles.append(
                Line2D(
                    [],
                    [],
                    marker="^",
                    linestyle="none",
                    color="#555555",
                    markeredgecolor="black",
                    label="unpaired: ratio of medians timed apart",
                )
            )
        if any(p.contended for _, pts in panels for p in pts):
            handles.append(
                Line2D(
                    [],
                    [],
                    marker="o",
                    linestyle="none",
                    color="#555555",
                    markerfacecolor="white",
                    markeredgecolor=_CONTENDED_EDGE,
                    markeredgewidth=1.6,
                    label="hollow, red edge: a speed-up timed on a contended machine (†)",
                )
            )
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 2), fontsize=9, frameon=True)
        fig.suptitle(
            "Each setting against its model's full depth (mean over seeds)",
            fontsize=11.5,
            fontweight="bold",
        )
        label_points(fig, placed)
    return fig


def _latent_runs(ctx: Any, frames: Frames) -> pd.DataFrame:
    """The first traced window of each model's first traced run (lowest seed)."""
    lat = frames.data.inference_latents
    if lat is None or lat.empty or ctx.done.empty:
        return pd.DataFrame()
    runs = ctx.done[["id", "model", "seed"]].rename(columns={"id": "run_id"})
    df = lat.merge(runs, on="run_id", how="inner")
    if df.empty:
        return df
    df = df.sort_values(["seed", "run_id", "sequence"])
    order = {m: i for i, m in enumerate(ctx.models)}
    firsts = df.groupby("model", sort=False).head(1)
    return firsts.sort_values("model", key=lambda s: s.map(lambda m: order.get(m, len(order)))).reset_index(drop=True)


def fig_convergence(lat: pd.DataFrame) -> Any:
    n = len(lat)
    with _style():
        fig = _figure(11.5, 1.2 + 2.4 * n)
        axes = np.atleast_1d(fig.subplots(n, 1, squeeze=False)[:, 0])
        for ax, r in zip(axes, lat.itertuples()):
            conv = np.asarray(json.loads(r.convergence_json), dtype=float)  # (iterations, positions)
            img = ax.imshow(
                np.log10(np.clip(conv, 1e-8, None)),
                aspect="auto",
                cmap="viridis",
                origin="lower",
                extent=(-0.5, conv.shape[1] - 0.5, 0.5, conv.shape[0] + 0.5),
            )
            ax.set_ylabel("iteration")
            ax.grid(False)
            ax.set_title(f"{r.model} · seed {r.seed} · window {r.sequence}", fontsize=10)
            fig.colorbar(img, ax=ax, label="log10 relative change")
        axes[-1].set_xlabel("position in the window")
        fig.suptitle(
            "Latent convergence: ||s_i − s_(i−1)|| / ||s_i|| per position and iteration", fontsize=11, fontweight="bold"
        )
    return fig


def fig_trajectories(lat: pd.DataFrame) -> Any:
    n = len(lat)
    with _style():
        fig = _figure(min(4.2 * n, 16), 4.4)
        axes = np.atleast_1d(fig.subplots(1, n, squeeze=False)[0])
        for ax, r in zip(axes, lat.itertuples()):
            xy = json.loads(r.pca_json)
            explained = json.loads(r.explained)
            for pos, traj in zip(json.loads(r.positions_json), xy):
                a = np.asarray(traj, dtype=float)
                line = ax.plot(a[:, 0], a[:, 1], marker="o", markersize=3, linewidth=1.2, label=f"pos {pos}")[0]
                ax.plot(a[-1:, 0], a[-1:, 1], marker="*", markersize=11, color=line.get_color(), linestyle="none")
            ax.set_title(f"{r.model} · seed {r.seed}", fontsize=10)
            ax.set_xlabel(f"PC1 ({100 * explained[0]:.0f}%)")
            ax.set_ylabel(f"PC2 ({100 * explained[1]:.0f}%)" if len(explained) > 1 else "PC2")
            ax.legend(fontsize=7, frameon=True)
        fig.suptitle(
            "State trajectories across iterations (2-D PCA) · ★ = last iteration", fontsize=11, fontweight="bold"
        )
    return fig


def inference_section(frames: Frames) -> list[str]:
    out = ["## Inference cost", ""]
    ctx = frames.ctx
    df = infer_frame(frames)
    if df.empty:
        return out + need("No inference rows: `benchctl infer` (or `benchctl study`) measures them.")
    first = df.iloc[0]
    out.append(
        f"Generation on the same {int(first['prompts'])} prompts of {int(first['prompt_tokens'])} tokens (the start "
        f"of validation windows), {int(first['new_tokens'])} greedy new tokens each, per inference setting: decode "
        f"tokens/s at batch 1 (the first {int(first['single'])} prompts one at a time) and at batch "
        f"{int(first['prompts'])}, prefill and the warm-up excluded; KV-cache MB per 1,000 cached tokens; forward "
        f"FLOPs spent per generated token and the mean depth (exited tokens are not computed further); the "
        f"teacher-forced loss under the setting on {int(first['windows'])} validation windows (mean ± 95% CI over "
        "seeds; Δ paired by seed); agreement = share of greedy tokens equal to the run's full-depth continuation; "
        "acceptance = speculative drafts' accepted share; × full b1 = the median ratio of the batch-1 decode rate to "
        "full depth's timed right beside it in each repeat (over repeats and seeds). Speeds are as measured on the "
        f"machine that ran `benchctl infer`{_repeats_note(df)}."
        + (
            " Load avg = the machine's 1-minute load average while the row was timed; CPU share = the process's "
            "CPU time over the timed generations' wall time times its threads (near 1: every thread ran "
            "throughout); both mean over seeds."
            if _has_load(df)
            else ""
        )
    )
    out.append("")
    load = _has_load(df)
    for model in [m for m in ctx.models if m in set(df["model"])]:
        out += _table(ctx, model, df[df["model"] == model], load)
    out += contention_note(ctx, df)
    sentences = [s for m in ctx.models if m in set(df["model"]) if (s := verdict(ctx, m, df[df["model"] == m]))]
    if sentences:
        out += [
            "Cheaper than full depth (no more FLOPs per generated token and KV bytes, less of one; the counts, not "
            f"the timings, which vary with the machine's load) and no worse in loss: the loss change against full "
            f"depth, paired by seed, shown to be below +{MARGIN:g} nats by a one-sided t-test (non-inferiority, "
            f"α = {ALPHA}), each p Holm-adjusted over the model's cheaper settings, since the sentence picks one of "
            "them. Over training seeds only, on the same validation windows for every setting:",
            "",
            *sentences,
            "",
        ]
    frontier = fig_frontier(ctx, df)
    alone = [m for m in ctx.models if m in set(df["model"]) and len(set(df[df["model"] == m]["setting"])) == 1]
    if frontier is not None:
        frames.figures["infer_frontier.png"] = frontier
        out += [
            "Each setting against its model's full depth: the batch-1 decode speed-up (the paired ratio, as in "
            "× full b1) and the KV cache per token, against the loss change paired by seed; ◆ = full depth itself."
            + (f" {', '.join(alone)}: full depth only, nothing to set against it." if alone else "")
            + (" Hollow speed-ups with a red edge were timed on a contended machine (†)." if _contended(df) else ""),
            "",
            "![Decode speed-up and KV cache against the loss change, per setting](figures/infer_frontier.png)",
            "",
        ]
    lat = _latent_runs(ctx, frames)
    if lat.empty:
        return out + need("No latent traces: `benchctl infer --latent-sequences N` stores them for recurrent runs.")
    out += [
        "Latent view: the recurrent state of a validation window after each iteration at the trained depth. The "
        "heatmap shows each position's relative change per iteration (dark = settled); the trajectories project a "
        "few positions' states, iteration 0 (before the first) to the last, on their first two principal "
        "components.",
        "",
    ]
    frames.figures["infer_convergence.png"] = fig_convergence(lat)
    frames.figures["infer_trajectories.png"] = fig_trajectories(lat)
    out += [
        "![Per-position convergence across iterations](figures/infer_convergence.png)",
        "",
        "![State trajectories across iterations](figures/infer_trajectories.png)",
        "",
    ]
    return out
