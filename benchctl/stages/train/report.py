"""Report sections of the train stage: the runs and their status, the models' parameter accounting, training cost
(time and memory) and validation loss, each beside the study's published numbers where it has them."""

from __future__ import annotations

import math
import textwrap
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from benchctl.core import paper
from benchctl.report.context import CONTROL, Context, model_keys, study_order
from benchctl.report.figures import (
    _figure,
    _style,
    _title,
    _x_labels,
    _y_labels,
    bar_layout,
    fig_final_loss,
    fig_loss_curves,
    hardware_line,
    legend_groups,
)
from benchctl.report.fmt import (
    bytes_unit,
    fci,
    fint,
    fnum,
    ftokens,
    md_table,
    missing,
    need,
    scaled,
    time_unit,
    value_range,
)
from benchctl.report.frames import (
    Frames,
    accounting_frame,
    component_order,
    curve_frame,
    loss_frame,
    paper_accounting_frame,
    status_frame,
)
from benchctl.stages.train import conditions
from benchctl.stages.train.cost import benched_models, contention, cost_frame, headline, timing_frame, warnings

# Short column headers for the components the study's architectures have; any other component is shown by name.
_COMPONENT_NAMES = {
    "depth_encoding": "depth enc.",
    "recurrent_norm": "rec. norm",
    "lora": "LoRA",
    "final_norm": "final norm",
}


def fig_cost_bars(ctx: Context, cost: pd.DataFrame, what: str) -> Any:
    """Figures 1–2 of the study: training time or peak memory per model; bar = mean, one dot per seed, labelled
    with the mean and its ratio to the control (a time ratio only where neither side has a contended run: a wall
    time measured beside other work is no cost measure, so neither is a ratio of two)."""
    q = "time" if what == "time" else "mem"
    df = cost[cost[f"{q}_mean"].notna()]
    if df.empty:
        return None
    models = list(df["model"])
    if q == "time":
        scale, unit = time_unit(float(df["time_mean"].max()))
        col = "train_seconds"
        ylabel = f"training time ({unit})"
        title = "Training time per model"
    else:
        scale, unit = bytes_unit(float(df["mem_mean"].max()))
        gpu = df["memory_kind"].iloc[0] == "gpu"
        col = "peak_gpu_mem_bytes" if gpu else "step_mem_bytes"
        ylabel = f"{'peak GPU memory allocated' if gpu else 'memory of one training step'} ({unit})"
        title = "Peak GPU memory per model" if gpu else "Memory of one training step per model (torch allocations)"
    # A wall time is flagged where the timing table's notes flag it (benchctl.stages.train.cost.contention): the
    # bar of a model with a contended run is hatched, and where only some of its seeds were, their dots are red.
    per_seed: dict[str, list[tuple[float, bool]]] = {}
    for m in models:
        runs = ctx.records_of(m)
        per_seed[m] = [
            (float(v), q == "time" and contention(r) is not None)
            for r in runs
            if pd.notna(v := pd.to_numeric(r[col], errors="coerce"))
        ]
    flagged = sum(b for pts in per_seed.values() for _, b in pts)
    control_busy = any(b for _, b in per_seed.get(CONTROL, []))
    partly = False
    horizontal, width, height = bar_layout(len(models))
    colour, _ = legend_groups(ctx, models)
    with _style():
        fig = _figure(width, height + (0.6 if flagged else 0.0))
        ax = fig.add_subplot()
        for i, row in enumerate(df.itertuples()):
            m = row.model
            mean = getattr(row, f"{q}_mean") / scale
            busy = [b for _, b in per_seed[m]]
            seeds = [v for v, _ in per_seed[m]]
            ratio = getattr(row, f"{q}_ratio")
            top = max([mean] + [v / scale for v in seeds])
            label = f"{mean:.{1 if mean < 100 else 0}f} {unit}"
            if not missing(ratio) and m != CONTROL and not (any(busy) or control_busy):
                label += f"{' · ' if horizontal else chr(10)}{ratio:.2f}× control"
            hatch = "///" if any(busy) else None
            mixed = any(busy) and not all(busy)
            partly |= mixed and len(seeds) > 1
            offs = np.linspace(-0.18, 0.18, len(seeds)) if len(seeds) > 1 else None
            dots = {
                "s": 18,
                "color": ["#C00000" if b else "white" for b in busy] if mixed else "white",
                "edgecolors": "black",
                "linewidth": 0.8,
                "zorder": 4,
            }
            bar = {"color": colour[m], "edgecolor": "black", "linewidth": 0.6, "zorder": 2, "hatch": hatch}
            if horizontal:  # a row per model, its numbers at the end of its bar
                ax.barh(i, mean, height=0.65, **bar)
                if offs is not None:
                    ax.scatter(np.array(seeds) / scale, i + offs, **dots)
                ax.annotate(label, (top, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
            else:
                ax.bar(i, mean, width=0.65, **bar)
                if offs is not None:
                    ax.scatter(i + offs, np.array(seeds) / scale, **dots)
                ax.annotate(
                    label, (i, top), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=9
                )
        if horizontal:
            _y_labels(ax, models)
            ax.set_xlabel(ylabel)
            ax.set_ylabel("model")
            ax.set_xlim(0, ax.get_xlim()[1] * 1.3)  # room for the numbers right of the longest bar
            ax.grid(axis="y", visible=False)
        else:
            _x_labels(ax, models)
            ax.set_ylabel(ylabel)
            ax.set_xlabel("model")
            ax.set_ylim(0, ax.get_ylim()[1] * 1.18)
            ax.grid(axis="x", visible=False)
        _title(ax, title, [hardware_line(ctx), f"preset {ctx.preset} · {_seed_line(df)}"])
        if flagged:
            total = sum(len(pts) for pts in per_seed.values())
            what = (
                f"hatched: contended runs ({flagged} of {total}; see the notes under the timing table), "
                "wall time not a cost measure, no ratio to the control"
            )
            wrap = max(30, int(fig.get_size_inches()[0] * 11))  # the legend stays inside a narrow figure
            handles = [Patch(facecolor="white", edgecolor="black", hatch="///", label=textwrap.fill(what, wrap))]
            if partly:
                handles.append(
                    Line2D(
                        [],
                        [],
                        marker="o",
                        linestyle="none",
                        color="#C00000",
                        markeredgecolor="black",
                        label="red dot: a contended seed",
                    )
                )
            fig.legend(handles=handles, loc="outside lower center", fontsize=8.5, frameon=True)
    return fig


def _seed_line(df: pd.DataFrame) -> str:
    n = sorted({int(v) for v in df["seeds"]})
    s = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    return f"{s} seed{'s' if n[-1] != 1 else ''} per model, bar = mean" + (", dots = seeds" if n[-1] > 1 else "")


def runs_section(frames: Frames) -> list[str]:
    ctx = frames.ctx
    out = ["## Runs", ""]
    if ctx.runs.empty:
        return out + need("No runs for this preset: `benchctl train-all` produces them.")
    sf = status_frame(ctx)
    always = ("done", "running", "pending", "failed")  # interrupted, and a status benchctl does not know: when met
    shown = [s for s in ("done", "running", "interrupted", "pending", "failed", "other") if s in always or sf[s].sum()]
    headers = ["model", *shown, "seeds done"]
    rows = [
        [r.model, *(getattr(r, s) for s in shown)] + [", ".join(map(str, r.seeds_done)) or "-"] for r in sf.itertuples()
    ]
    out += md_table(headers, rows, right=range(1, len(headers) - 1)) + [""]
    if sf["interrupted"].sum():
        out += [
            "Interrupted: recorded as running, but the process that trained the run is gone (killed, or its machine "
            "lost); the command that trained it resumes it.",
            "",
        ]
    variants = [m for m in ctx.models if ctx.overrides.get(m)]
    if variants:
        out.append(
            "Config overrides against the preset's defaults (runs with different configs are different "
            "models, never pooled as seeds):"
        )
        out.append("")
        out += [f"- {m}: `{ctx.overrides[m]}`" for m in variants] + [""]
    bad = ctx.runs[ctx.runs["status"] != "done"]
    if not bad.empty:
        out.append("Runs not in the statistics:")
        out.append("")
        rows = []
        for r in bad.sort_values(["status", "model", "seed", "id"]).itertuples():
            err = "" if missing(r.error) else str(r.error)
            rows.append(
                [
                    r.id,
                    r.model,
                    r.seed,
                    r.status,
                    fint(r.step) + " / " + fint(r.max_steps),
                    (err[:160] + "…") if len(err) > 160 else (err or "-"),
                ]
            )
        out += md_table(["run", "model", "seed", "status", "step", "error"], rows, right=[2]) + [""]
    return out


def models_section(frames: Frames) -> list[str]:
    ctx = frames.ctx
    out = ["## Models", ""]
    if ctx.runs.empty:
        out += need(
            "No runs for this preset: `benchctl train-all` produces them "
            "(`benchctl params` shows the accounting without training)."
        )
    else:
        acc = frames.once("accounting frame", lambda: accounting_frame(ctx))
        comps = [c for c in component_order(acc["components"]) if acc[c].fillna(0).astype(float).any()]
        headers = ["model"] + [_COMPONENT_NAMES.get(c, c) for c in comps]
        headers += ["unique total", "effective", "depth", "MFLOP/token"]
        if ctx.is_paper:
            headers += ["study total", "match"]
        rows = []
        for r in acc.to_dict("records"):
            row = [r["model"]] + [fint(r[c]) for c in comps]
            row += [
                fint(r["total_params"]),
                fint(r["effective_params"]),
                fint(r["effective_depth"]),
                fnum(None if missing(r["flops_per_token"]) else r["flops_per_token"] / 1e6, 2),
            ]
            if ctx.is_paper:
                study = paper.TOTAL_PARAMS.get(r["arch"]) if r["model"] == r["arch"] else None
                row += [fint(study), "-" if study is None else ("yes" if study == r["total_params"] else "NO")]
            rows.append(row)
        out += md_table(headers, rows, right=range(1, len(headers) - (2 if ctx.is_paper else 0))) + [""]
        out.append(
            "unique total = trainable parameters, the tied embedding counted once; effective = parameters "
            "applied per token with the recurrence unrolled; depth = block applications per token; "
            "MFLOP/token = training FLOPs per token (forward + backward, attention and recurrence included)."
        )
        out.append("")
        mism = [
            (r["model"], r["recorded_n_params"], r["total_params"])
            for r in acc.to_dict("records")
            if r["recorded_n_params"] and r["recorded_n_params"] != [r["total_params"]]
        ]
        for m, rec, tot in mism:
            out.append(
                f"Warning: the runs table records {', '.join(f'{v:,}' for v in rec)} parameters for {m}, "
                f"the accounting gives {fint(tot)}."
            )
        if mism:
            out.append("")
        if any(r["source"] != "config" for r in acc.to_dict("records")):
            out.append(
                "Rows without components come from the runs table (their config could not be rebuilt by "
                "this benchctl version)."
            )
            out.append("")
    if not ctx.is_paper:
        pa = paper_accounting_frame()
        out.append(
            "The study's published totals, at the paper preset (benchctl's accounting of the same configs "
            "beside them; `benchctl params --preset paper`):"
        )
        out.append("")
        rows = [
            [r["arch"], fint(r["total_params"]), fint(r["paper_total_params"]), "yes" if r["matches_paper"] else "NO"]
            for r in pa.to_dict("records")
        ]
        out += md_table(["model", "ours (paper preset)", "study", "match"], rows, right=[1, 2]) + [""]
    out.append(
        "Rows of the study that are inconsistent with its own totals or tables (shown, never silently corrected):"
    )
    out.append("")
    out += md_table(
        ["study row", "study", "ours", "why"], [[f["what"], f["study"], f["ours"], f["why"]] for f in paper.FLAGS]
    ) + [""]
    return out


def cost_section(frames: Frames) -> list[str]:
    ctx = frames.ctx
    out = ["## Training cost", ""]
    cost = cost_frame(ctx)
    if cost.empty:
        return out + need("No finished runs: `benchctl train-all` records training time and peak memory.")
    devices = sorted({str(x) for x in ctx.done["device_name"].dropna()})
    out.append(
        f"Hardware: {hardware_line(ctx)}; torch "
        f"{', '.join(sorted({str(x) for x in ctx.done['torch_version'].dropna()})) or 'unknown'}."
    )
    precisions = sorted({str(x) for x in ctx.done["dtype"].dropna()})
    if precisions:
        out.append(f"Precision: {', '.join(precisions)} (train.dtype=auto resolves per machine; see Provenance).")
    if len(devices) > 1:
        out.append("Warning: these runs were made on different devices, so time and memory ratios mix hardware.")
    out.append("")
    tmax = cost["time_mean"].dropna()
    tscale, tunit = time_unit(float(tmax.max()) if not tmax.empty else 0.0)
    gpu = cost["memory_kind"].iloc[0] == "gpu"
    mmax = cost["mem_mean"].dropna()
    mscale, munit = bytes_unit(float(mmax.max()) if not mmax.empty else 0.0)
    smax = cost["step_mem"].dropna()
    sscale, sunit = bytes_unit(float(smax.max()) if not smax.empty else 0.0)
    rmax = cost["rss"].dropna()
    rscale, runit = bytes_unit(float(rmax.max()) if not rmax.empty else 0.0)
    headers = [
        "model",
        "seeds",
        f"training time ({tunit})",
        "range over seeds",
        "× control",
        "tokens/s",
        "step (ms)",
    ]
    if gpu:
        headers += [f"peak GPU memory (torch allocated) ({munit})", "× control"]
        headers += [f"torch reserved ({munit})", f"NVML device ({munit})", f"step memory ({sunit})"]
    else:
        headers += [f"step memory ({sunit})", "× control", f"process peak RSS ({runit})"]
    unmeasured = "not measured"
    # A wall-time ratio is no cost measure where either side has a run that shared the machine (the notes under
    # "Time per trained token" name them): the cell says so instead of giving one, as the figure does.
    busy = {str(r["model"]) for r in ctx.done.to_dict("records") if contention(r) is not None}
    rows = []
    for r in cost.to_dict("records"):
        contended = r["model"] != CONTROL and (r["model"] in busy or CONTROL in busy)
        row = [
            r["model"],
            r["seeds"],
            fnum(scaled(r["time_mean"], tscale), 2),
            value_range(r["time_min"], r["time_max"], r["time_n"], tscale),
            "contended" if contended and not missing(r["time_ratio"]) else fnum(r["time_ratio"], 2),
            fnum(r["tokens_per_s"], 0),
            fnum(scaled(r["step_seconds"], 1e-3), 1),
        ]
        step_mem = unmeasured if missing(r["step_mem"]) else fnum(scaled(r["step_mem"], sscale), 2)
        if gpu:
            row += [fnum(scaled(r["mem_mean"], mscale), 2), fnum(r["mem_ratio"], 2)]
            row += [fnum(scaled(r["reserved"], mscale), 2), fnum(scaled(r["nvml"], mscale), 2), step_mem]
        else:
            row += [step_mem, fnum(r["mem_ratio"], 2), fnum(scaled(r["rss"], rscale), 2)]
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    partly = [
        f"{r['model']} ({r['step_mem_n']} of {r['seeds']})"
        for r in cost.to_dict("records")
        if 0 < r["step_mem_n"] < r["seeds"]
    ]
    out.append(
        (
            "Training time counts optimizer steps only (no warm-up/compile, evaluation or checkpoints); "
            "mean and range (fastest to slowest) over seeds; step = median optimizer-step time; "
            "× control = ratio of means to the control"
            + ("" if (cost["model"] == CONTROL).any() else " (no control runs, so no ratios)")
            + (
                ", not given ('contended') where the model's or the control's runs shared the machine: a wall time "
                "measured beside other work is no cost measure (see the CPU-time ratio below)"
                if busy
                else ""
            )
            + ". "
            + ("Peak GPU memory is torch's peak allocated GPU memory over the run. " if gpu else "")
            + "Step memory is the memory of one training step as `benchctl bench` measures it: parameters, optimizer "
            "state and the peak of torch's own allocations during one optimizer step (activations, gradients, "
            "temporaries; "
            + ("CUDA's allocator peak" if gpu else "torch's profiler memory events on the CPU")
            + "), measured by `train` on a warm-up step of each run, mean over seeds; it counts only the run's own "
            "tensors, so runs trained one after another in one process do not inflate each other's. "
            + (
                ""
                if gpu
                else "Process peak RSS is a fact about the training process, not the model's cost: it includes the "
                "interpreter, libraries and data pages, and in a `train-all` or `study` process what earlier runs "
                "left to the allocator. "
            )
            + (
                f"{unmeasured.capitalize()}: runs recorded by a benchctl from before this measurement (or on a device "
                "without it); `benchctl bench` measures the same figure. "
                if (cost["step_mem_n"] == 0).any()
                else ""
            )
            + (f"Measured for some seeds only: {', '.join(partly)}." if partly else "")
        ).rstrip()
    )
    out.append("")
    out += timing_lines(frames)
    out.append(f"The study ({paper.HARDWARE}, paper preset): {paper.COST_NOTES}")
    out.append("")
    for name, what, alt in (
        ("training_time.png", "time", "Training time per model"),
        ("peak_memory.png", "memory", "Peak memory per model"),
    ):
        f = fig_cost_bars(ctx, cost, what)
        if f is not None:
            frames.figures[name] = f
            out += [f"![{alt}](figures/{name})", ""]
    return out


def timing_lines(frames: Frames) -> list[str]:
    """Time per token from wall time and from CPU time, the bench ratios, which one is the headline, and a sentence
    for every run or model whose wall time is not a cost measure (see benchctl.stages.train.cost)."""
    ctx = frames.ctx
    t = timing_frame(ctx, frames.data.bench)
    if t.empty:
        return []
    headers = [
        "model",
        "wall (µs/token)",
        "× control",
        "CPU (µs/token)",
        "× control",
        "threads",
        "jobs",
        "load avg",
        "bench × control",
        "FLOPs × control",
        "bench cost ratio",
    ]
    rows = [
        [
            r["model"],
            fnum(scaled(r["wall"], 1e-6), 1),
            fnum(r["wall_ratio"], 2),
            fnum(scaled(r["cpu"], 1e-6), 1),
            fnum(r["cpu_ratio"], 2),
            r["threads"],
            r["jobs"],
            fnum(r["load"], 1),
            fnum(r["bench_time"], 2),
            fnum(r["flops"], 2),
            fnum(r["bench_cost"], 2),
        ]
        for r in t.to_dict("records")
    ]
    if t["cuda"].notna().any():  # CUDA runs: the GPU's own time of the same steps, and how busy NVML saw it
        headers += ["GPU (µs/token)", "GPU util (%)"]
        rows = [
            row + [fnum(scaled(r["cuda"], 1e-6), 1), fnum(r["gpu_util"], 0)]
            for row, r in zip(rows, t.to_dict("records"))
        ]
    out = ["Time per trained token over the timed steps (mean over seeds):", ""]
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    head = headline(t)
    out.append(
        "CPU = process CPU time of the same steps, all threads; load avg = the machine's 1-minute load "
        "average during training (mean over seeds); jobs = benchctl jobs run side by side; bench × control = "
        "time per token over the control's in the latest `benchctl bench` of this preset and device at the "
        "same config, whose quotient by FLOPs × control is the bench cost ratio (1.00 = costs exactly its "
        "arithmetic)."
    )
    out.append(
        {
            "bench": "Headline: the bench ratio, because bench times every model's step in one process, taking turns "
            "step by step, so other load falls on all of them alike; the CPU-time ratio comes next (time spent "
            "waiting for a core is not counted, threads spinning while they wait are), and the wall-time ratio "
            "holds only on a quiet machine.",
            "cpu": "Headline: the CPU-time ratio, because time a run spends waiting for a core is not counted; it is a "
            "fallback, since threads that spin while they wait are counted, so heavy load distorts it too. The "
            "wall-time ratio holds only on a quiet machine; `benchctl bench` (or `benchctl study --bench`) gives "
            "the cleanest ratio, measured interleaved in one process.",
            "wall": "Headline: the wall-time ratio, the only one recorded for every model here, which is a cost "
            "measure only on a quiet machine; `benchctl bench` gives a clean ratio.",
        }[head]
    )
    benched = benched_models(t)
    if head != "bench" and benched:
        out.append(
            f"The latest `benchctl bench` measured only {', '.join(benched)}: for "
            f"{'it' if len(benched) == 1 else 'them'} the bench ratio is the cleaner number."
        )
    out.append("")
    notes = warnings(ctx, t)
    return out + ([f"- {n}" for n in notes] + [""] if notes else [])


def loss_section(frames: Frames) -> list[str]:
    ctx = frames.ctx
    out = ["## Loss", ""]
    loss = loss_frame(ctx)
    if loss.empty:
        return out + need("No finished runs: `benchctl train-all` records initial and final validation loss.")
    rf = conditions.run_frame(frames)
    warmup, dirty = conditions.warmups_differ(rf), bool(rf["dirty"].any())
    headers = ["model", "seeds", "tokens/run", "epochs"] + (["warm-up"] if warmup else [])
    headers += ["initial val loss", "95% CI", "final val loss", "95% CI"]
    if ctx.is_paper:
        headers += ["study initial", "study final"]
    if dirty:
        headers += ["uncommitted changes"]
    rows = []
    for r in loss.to_dict("records"):
        g = rf[rf["model"] == r["model"]]
        row = [r["model"], r["seeds"], ftokens(r["tokens"]), conditions.epochs_cell(g)]
        row += [conditions.warmup_cell(g)] if warmup else []
        row += [
            fnum(r["initial_mean"]),
            fci(r["initial_lo"], r["initial_hi"], r["initial_n"]),
            fnum(r["final_mean"]),
            fci(r["final_lo"], r["final_hi"], r["final_n"]),
        ]
        if ctx.is_paper:
            flag = " (Table 5: 1.492)" if r["model"] == CONTROL and not missing(r["study_final"]) else ""
            row += [fnum(r["study_initial"]), fnum(r["study_final"]) + flag]
        row += [conditions.dirty_cell(g)] if dirty else []
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers) - (1 if dirty else 0))) + [""]
    out += conditions.lines(frames, list(loss["model"]))
    vocab = sorted({model_keys(c).get("model.vocab_size") for c in ctx.done["config_json"]} - {None})
    if len(vocab) == 1:
        out.append(
            f"A uniform guess over the {vocab[0]:,}-token vocabulary scores ln {vocab[0]:,} = {math.log(vocab[0]):.3f}."
        )
    if any(r["seeds"] == 1 for r in loss.to_dict("records")):
        out.append("A model with one seed has no confidence interval: its run-to-run spread is unknown.")
    if ctx.is_paper:
        out.append(
            "The study's control final loss is 1.429 in its Table 3 and 1.492 in its Table 5; Table 3's value is shown."
        )
    else:
        ref = ", ".join(f"{a} {paper.FINAL_LOSS[a]:.3f}" for a in study_order(paper.FINAL_LOSS))
        out.append(
            f"The study (paper preset, {paper.TOKENS_PER_MODEL / 1e6:.1f} M tokens per model) reported final "
            f"validation losses {ref}; they are not comparable with this preset."
        )
    out.append("")
    curves = curve_frame(ctx, frames.data.metrics)
    for name, f, alt in (
        ("final_val_loss.png", fig_final_loss(ctx, loss), "Final validation loss per model"),
        ("val_loss_curves.png", fig_loss_curves(ctx, curves), "Validation loss against tokens"),
    ):
        if f is not None:
            frames.figures[name] = f
            out += [f"![{alt}](figures/{name})", ""]
    if curves.empty:
        out += need("No validation-loss curves in the metrics table: `benchctl train` writes them.")
    return out
