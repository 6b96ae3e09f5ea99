"""Report sections that close the report: significance tests between models (loss and judge grades, seeds as the
unit), the latest `benchctl bench` rows, and the provenance of every run (versions, commits, data, devices)."""

from __future__ import annotations

import json

from benchctl.core import stats
from benchctl.report.context import CONTROL
from benchctl.report.fmt import counts, date, fnum, fp, max_str, md_table, min_str, missing, need, py, scaled
from benchctl.report.frames import Frames
from benchctl.stages.bench.frames import bench_frame
from benchctl.stages.judge.frames import judge_groups_of, primary_judge
from benchctl.stages.judge.reliability import rank_disagreements
from benchctl.stages.report.frames import LOSS, comparison_frame
from benchctl.stages.train.report_scaling import only_isoflop

_TESTS = {
    "paired-t": "paired t over shared seeds",
    "welch": "Welch t over seeds",
    "seed-t": "t over per-seed means",
    "prompt-t": "paired t over prompts (one seed)",
}


def comparisons_section(frames: Frames) -> list[str]:
    ctx, primary = frames.ctx, primary_judge(frames)
    out = ["## Comparisons", ""]
    if len(ctx.done_models) < 2:
        return out + need("Needs finished runs of at least two models: `benchctl train-all` produces them.")
    if only_isoflop(frames):
        return out + need(
            f"Every model here is a point of an IsoFLOP grid ({len(ctx.done_models)} sizes × budgets): the "
            "architectures are compared at their compute-optimal sizes in the Scaling section, not pairwise."
        )
    cmp = comparison_frame(ctx, primary)
    headers = [
        "a",
        "b",
        "quantity",
        "test",
        "n (a, b)",
        "a − b",
        "95% CI",
        "p",
        "p (sign-flip)",
        "p (Holm, per quantity)",
        "p (Wilcoxon)",
    ]
    rows = []
    for r in cmp.to_dict("records"):
        digits = 3 if r["quantity"] == LOSS else 2
        paired = r["method"] != "welch"
        n = f"{r['n_a']} shared" if paired else f"{r['n_a']}, {r['n_b']}"
        if r["method"] == "seed-t":
            n += f" ({int(r['n_prompts'])} prompts)"
        ci = "-" if missing(r["lo"]) else f"{fnum(r['lo'], digits)} to {fnum(r['hi'], digits)}"
        rows.append(
            [
                r["a"],
                r["b"],
                r["quantity"],
                _TESTS.get(r["method"], r["method"]),
                n,
                fnum(r["diff"], digits),
                ci,
                fp(r["p"]),
                fp(r["p_sign_flip"]),
                fp(r["p_holm"]),
                fp(r["p_wilcoxon"]),
            ]
        )
    out += md_table(headers, rows, right=range(4, len(headers))) + [""]
    out += [f"- {v}" for v in cmp["verdict"]] + [""]
    families = "; ".join(dict.fromkeys(f for f in cmp["family"] if isinstance(f, str)))
    out.append(
        "a − b: negative means a has the lower value (lower loss is better; a higher judge grade is better). "
        "Loss: at a given seed every model trains on the same data stream, so models with the same seeds are "
        "compared by a paired t-test over those seeds; models with different seeds by Welch's t-test. Judge: "
        "each sample's repeats are averaged, each seed's paired difference is averaged over the prompts both "
        "models were graded on, and a t-test over those per-seed means decides, so the verdict is about the "
        "architectures; with one seed a paired t over prompts decides, and the verdict is about the two trained "
        f"models only. p (sign-flip): up to {stats.MAX_SIGN_FLIP_PAIRS} pairs, the exact paired permutation "
        "test over every sign pattern of the differences, which needs no normality but cannot go below 2/2^n "
        f"({stats.sign_flip_floor(3):g} at 3 seeds): a t p below that is significant only if the differences "
        f"are normal, which so few cannot show. p (Wilcoxon): the signed-rank test, from "
        f"{stats.MIN_WILCOXON_PAIRS} pairs on. p (Holm, per quantity) adjusts each quantity's pairwise "
        f"comparisons as one family ({families}); a verdict calls a difference real only when its Holm-adjusted "
        "p is below 0.05. The CI is unadjusted."
    )
    out.append("")
    if primary is None:
        out += need("Judge comparisons need grades: `benchctl sample` then `benchctl judge`.")
    else:
        others = [g for g in judge_groups_of(frames) if g is not primary]
        line = (
            f"Judge comparisons use one set of grades: judge `{primary.judge_model}`, protocol "
            f"`{primary.protocol}`, prompt `{primary.prompt_hash}` ({primary.n_ok} ok grades, the most complete)"
        )
        if others:
            line += "; not mixed with: " + "; ".join(
                f"`{g.judge_model}` / `{g.protocol}` / `{g.prompt_hash}` ({g.n_ok})" for g in others
            )
        out += [line + ".", ""]
        disagree = rank_disagreements(frames)
        if disagree:
            out += [
                "The judges disagree about the rank of " + "; ".join(disagree) + " (on the samples they all "
                "graded; see Judge reliability): a verdict on these models' order holds for the primary judge only.",
                "",
            ]
    return out


def bench_section(frames: Frames) -> list[str]:
    ctx, data = frames.ctx, frames.data
    out = ["## Benchmark", ""]
    b, earlier = bench_frame(ctx, data.bench)
    if b.empty:
        return out + need("No benchmark rows for this preset: `benchctl bench` produces them.")
    out.append(
        f"`benchctl bench` invocation `{b['bench_id'].iloc[0]}` ({date(b['created_at'].max())}"
        + (f"; {earlier} earlier invocation{'s' if earlier != 1 else ''} not shown" if earlier else "")
        + ")."
    )
    out.append("")
    headers = [
        "arch",
        "impl",
        "compiled",
        "device",
        "tokens/s",
        "range",
        "step (ms)",
        "MFLOP/token",
        "MFU",
        "peak FLOP/s source",
        "peak memory (MiB)",
        "cost ratio",
        "cost ratio (CPU)",
    ]
    ref = b[(b["arch"] == CONTROL) & (b["impl"] == "reference")]
    ours = b[(b["arch"] == CONTROL) & (b["impl"] == "benchctl")]
    ctrl = ours.to_dict("records")[0] if not ours.empty else None
    rows = []
    for r in b.to_dict("records"):
        cost = cost_cpu = "-"
        if ctrl is not None and r["impl"] == "benchctl" and r["compiled"] == ctrl["compiled"]:
            # time per token over the control's, divided by FLOPs per token over the control's (1 = pure arithmetic)
            flops = float(r["flops_per_token"]) / float(ctrl["flops_per_token"])
            cost = fnum((float(ctrl["tokens_per_s"]) / float(r["tokens_per_s"])) / flops, 2)
            if not missing(r.get("step_cpu_seconds")) and not missing(ctrl.get("step_cpu_seconds")):
                # the same in process CPU time per step (every row has the preset's tokens per step)
                cost_cpu = fnum(float(r["step_cpu_seconds"]) / float(ctrl["step_cpu_seconds"]) / flops, 2)
        impl = r["impl"] if missing(r.get("dtype")) else f"{r['impl']} ({r['dtype']})"
        rows.append(
            [
                r["arch"],
                impl,
                "yes" if py(r["compiled"]) else "no",
                r["device_name"] or r["device"],
                fnum(r["tokens_per_s"], 0),
                f"{fnum(r['tokens_per_s_min'], 0)}–{fnum(r['tokens_per_s_max'], 0)}",
                fnum(scaled(r["step_seconds"], 1e-3), 1),
                fnum(scaled(r["flops_per_token"], 1e6), 2),
                "-" if missing(r["mfu"]) else f"{100 * float(r['mfu']):.1f}%",
                r["peak_flops_source"] if not missing(r["peak_flops_source"]) else "-",
                fnum(scaled(r["peak_mem_bytes"], 2**20), 1),
                cost,
                cost_cpu,
            ]
        )
    out += md_table(headers, rows, right=[4, 5, 6, 7, 8, 10, 11, 12]) + [""]
    if not ref.empty and ctrl is not None:
        ref_row = ref.to_dict("records")[0]
        ratio = float(ctrl["tokens_per_s"]) / float(ref_row["tokens_per_s"])
        out.append(
            f"benchctl's control step runs at {ratio:.2f}× the eager reference's tokens/s at the same "
            "precision, measured side by side in the same invocation."
        )
        ref32 = b[(b["arch"] == CONTROL) & (b["impl"] == "reference-fp32")]
        if not ref32.empty:
            ratio32 = float(ctrl["tokens_per_s"]) / float(ref32.iloc[0]["tokens_per_s"])
            out.append(f"Against the reference in fp32 (as llama2.c runs on a CPU) it runs at {ratio32:.2f}×.")
        kernel = ctrl.get("kernel_seconds")
        if not missing(kernel) and float(kernel) > 0:
            out.append(
                f"Its step spends {fnum(kernel, 2)} s in matmul and attention kernels (best profiled step), so "
                f"even with everything else free it could run at most "
                f"{float(ref_row['step_seconds']) / float(kernel):.2f}× the reference on this machine."
            )
        out.append("")
    out.append(
        "Cost ratio: an architecture's time per token over the control's, divided by its FLOPs per token over "
        "the control's (1.00 = its recurrence costs exactly its arithmetic); cost ratio (CPU): the same from "
        "the process CPU time of a step, which time spent waiting for a core on a shared machine does not "
        "distort. "
        "MFU is empty when the device's peak FLOP/s is unknown (never a guessed peak)."
    )
    out.append("")
    return out


def _given_source(config_json: object, stored: object) -> object:
    """The data source as the run was given it (`--data`, e.g. 'hub' or a directory as typed), which is what a reader
    would pass to reproduce the run; the resolved local location stays in `runs.data_source`, and the fingerprint
    beside it identifies the content wherever it lives."""
    try:
        given = json.loads(str(config_json))["data"]["source"]
    except (ValueError, KeyError, TypeError):
        return stored
    return given if isinstance(given, str) and given else stored


def provenance_section(frames: Frames) -> list[str]:
    ctx, data, groups = frames.ctx, frames.data, judge_groups_of(frames)
    out = ["## Provenance", ""]
    if ctx.runs.empty:
        return out + need("No runs: `benchctl train-all` records versions, commits, data and devices.")
    r = ctx.runs
    items = [
        ("benchctl version", counts(r["benchctl_version"])),
        ("git commit", counts(r["git_commit"])),
        (
            "preset",
            f"{ctx.preset}"
            + (
                f" (others in the database: {', '.join(p for p, _, _ in ctx.other_presets)})"
                if ctx.other_presets
                else ""
            ),
        ),
        ("data source", counts(_given_source(c, s) for c, s in zip(r["config_json"], r["data_source"]))),
        ("data fingerprint", counts(r["data_fingerprint"])),
        ("device", counts(f"{a} / {b}" if not missing(b) else a for a, b in zip(r["device"], r["device_name"]))),
        # train.dtype=auto resolves per machine: the precision each run actually trained in, and why
        ("precision", counts(r["precision_reason"])),
        # train.compile=auto too: compiled or eager, and why (absent for runs stored before it was recorded)
        ("compile", counts(r["compile_reason"], absent="not recorded")),
        ("torch", counts(r["torch_version"])),
        ("CUDA", counts(r["cuda_version"], absent="none")),
        ("driver", counts(r["driver_version"], absent="none")),
        ("python", counts(r["python_version"])),
        ("first run created", date(min_str(r["created_at"]))),
        ("last run finished", date(max_str(r["finished_at"]))),
    ]
    if groups:
        items.append(
            (
                "judge",
                "; ".join(
                    f"{g.judge_model} / {g.protocol} / prompt {g.prompt_hash} ({g.n_ok} ok grades; {g.identity()})"
                    for g in groups
                ),
            )
        )
    ev = data.eval_results[data.eval_results["run_id"].isin(ctx.done["id"])]
    if not ev.empty:
        items.append(("lm-eval", counts(ev.drop_duplicates(["run_id", "lm_eval_version"])["lm_eval_version"])))
    out += md_table(["what", "value"], items) + [""]
    return out
