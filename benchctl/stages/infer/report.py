"""Report section of the infer stage, "Inference cost": per model and inference setting the decode speed at batch 1
and at a batch, KV-cache megabytes per 1,000 tokens, FLOPs spent per generated token, the teacher-forced loss and the
agreement with full depth; a frontier figure (decode speed and KV bytes against loss, the control marked); one
sentence per recurrent model on which setting, if any, is both cheaper and shown no worse than its full depth
(non-inferiority within MARGIN, Holm-adjusted over the settings it picks from); and the latent view: per-position
convergence across iterations as a heatmap and 2-D PCA trajectories of a few tokens' states.

Rows come from `inference_results` and `inference_latents` (`benchctl infer`), only for runs that are done in the
report's preset. Means over seeds carry 95% t-intervals (benchctl.core.stats); the loss change against full depth is
paired by seed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

import architectures
from benchctl.core import stats
from benchctl.report.figures import _figure, _style, tick
from benchctl.report.fmt import fnum, md_table, need
from benchctl.report.frames import Frames

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


def _table(ctx: Any, model: str, g: pd.DataFrame) -> list[str]:
    batch = int(g["prompts"].iloc[0])
    rows = []
    for setting in _order(g):
        h = g[g["setting"] == setting]
        loss = stats.mean_ci(h["val_loss"].astype(float))
        kv = _mean(h, "kv_bytes_per_1k")
        flops = _mean(h, "flops_per_token")
        rows.append(
            [
                setting,
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
    ]
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


def fig_frontier(ctx: Any, df: pd.DataFrame) -> Any:
    with _style():
        fig = _figure(11.5, 4.8)
        axes = fig.subplots(1, 2)
        for model, g in df.groupby("model", sort=False):
            colour = ctx.colours.get(model)
            ref = not _iterable(ctx, model)
            for ax, col, scale in ((axes[0], "tokens_per_s_1", 1.0), (axes[1], "kv_bytes_per_1k", 1e-6)):
                pts = []
                for setting in _order(g):
                    h = g[g["setting"] == setting]
                    y = _mean(h, col)
                    if y is not None:
                        pts.append((setting, float(h["val_loss"].mean()), y * scale))
                if not pts:
                    continue
                xs = [p[1] for p in pts]
                ys = [p[2] for p in pts]
                if ref:
                    ax.plot(
                        xs,
                        ys,
                        marker="*",
                        markersize=16,
                        color=colour,
                        markeredgecolor="black",
                        linestyle="none",
                        label=f"{tick(model)} (reference)",
                    )
                    continue
                ax.plot(xs, ys, marker="o", markersize=5, color=colour, linestyle="none", alpha=0.8, label=tick(model))
                full = [p for p in pts if p[0] == FULL]
                if full:
                    ax.plot(
                        [full[0][1]],
                        [full[0][2]],
                        marker="D",
                        markersize=9,
                        color=colour,
                        markeredgecolor="black",
                        linestyle="none",
                    )
        axes[0].set_ylabel("decode tokens/s, batch 1")
        axes[1].set_ylabel("KV cache, MB per 1,000 tokens")
        for ax in axes:
            ax.set_xlabel("teacher-forced validation loss (nats/token)")
        axes[0].legend(fontsize=8, frameon=True)
        fig.suptitle(
            "Inference cost against loss, per setting · ◆ = full depth · ★ = reference (mean over seeds)",
            fontsize=11,
            fontweight="bold",
        )
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
    )
    out.append("")
    for model in [m for m in ctx.models if m in set(df["model"])]:
        out += _table(ctx, model, df[df["model"] == model])
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
    frames.figures["infer_frontier.png"] = fig_frontier(ctx, df)
    out += ["![Decode speed and KV cache against loss](figures/infer_frontier.png)", ""]
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
