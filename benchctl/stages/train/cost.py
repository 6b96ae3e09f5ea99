"""How much each model costs to train, read so that it survives a shared machine and jobs run side by side.

Three measures of a model's time per token relative to the control, from the cleanest to the most fragile:

- bench: `benchctl bench` times every model's training step in one process, the models taking turns step by step,
  so whatever else the machine does falls on all of them alike. Its ratio is the headline whenever the latest bench
  invocation for the report's preset and device measured the control and the model at the model's config.
- CPU time: the process CPU time of a run's timed steps (`runs.cpu_seconds`). Time the process spends descheduled
  while other work runs is not counted, but threads that spin while waiting for a descheduled sibling (OpenMP's
  default) are, so heavy load inflates it too, unevenly between models. The headline when there is no bench ratio,
  and a fallback even then.
- wall time: a cost measure only on a quiet machine with one job at a time.

`contention` decides, per run, whether its wall time could be read as a cost at all; `seed_spread` flags a model
whose seeds' wall times disagree by more than `SEED_SPREAD_LIMIT`. Both only ever add a plain sentence; the numbers
themselves are shown as measured.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from benchctl.core import stats
from benchctl.report.context import CONTROL, Context, model_keys
from benchctl.report.fmt import missing
from benchctl.report.frames import ci_cols, vals

# Slack over the core count before a run's load counts as contention: the kernel's and other daemons' brief wake-ups
# lift a quiet machine's load average by a few tenths, and a run that keeps every core busy by itself reads ~cores.
LOAD_SLACK = 0.5
SEED_SPREAD_LIMIT = 1.5  # max/min of a model's seeds' training times above which its wall time is not trusted


def cores_of(device_name: Any) -> int | None:
    """Logical cores of the machine from a CPU run's device name ('AMD EPYC (2 cores, 2 threads)'); None otherwise."""
    m = re.search(r"\((\d+) cores", str(device_name or ""))
    return int(m.group(1)) if m else None


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v


def contention(run: dict[str, Any]) -> str | None:
    """Why this run's wall time is not a cost measure, or None when nothing says it is contended.

    The rule, with J = runs.concurrent_jobs (benchctl jobs the executor ran side by side, 1 when alone), C = the
    machine's logical cores (a row's own `cores` where it records them, as inference_results does; else from
    runs.device_name, CPU runs only) and L = runs.load_avg (mean of the 1-minute load average sampled during
    training, which counts every runnable thread on the machine, the run's own included):

    - J > 1: the run shared the machine with J - 1 other benchctl jobs on purpose. Each job's share is C / J cores,
      and memory bandwidth and caches are shared too, so its wall time is the cost of running beside them, not its
      own.
    - L > C + LOAD_SLACK: the machine had more runnable threads than cores for much of the run, i.e. the total load
      exceeded every job's share of the cores put together (J shares of C / J), so some threads, possibly the run's,
      waited for a core.

    The 1-minute average lags by about a minute, so a run shorter than that partly reports the load before it.
    """
    jobs = _num(run.get("concurrent_jobs"))
    if jobs is not None and jobs > 1:
        return f"trained beside {int(jobs) - 1} other job(s) ({int(jobs)} at once)"
    own = _num(run.get("cores"))
    cores, load = int(own) if own else cores_of(run.get("device_name")), _num(run.get("load_avg"))
    if cores is not None and load is not None and load > cores + LOAD_SLACK:
        return f"mean load {load:.1f} on {cores} cores"
    return None


def _per_token(runs: list[dict[str, Any]], col: str) -> list[float]:
    """Seconds per trained token over the timed steps, one value per run, from `col` (train_seconds, cpu_seconds)."""
    out = []
    for r in runs:
        secs, steps, wall = _num(r.get(col)), _num(r.get("timed_steps")), _num(r.get("train_seconds"))
        tps, seen, step = _num(r.get("tokens_per_s")), _num(r.get("tokens_seen")), _num(r.get("step"))
        if secs is None:
            continue
        if steps and seen and step:  # the exact timed tokens: steps times tokens per step
            out.append(secs / (steps * seen / step))
        elif tps and wall:  # older rows: wall time per token from the throughput, CPU time scaled by CPU/wall
            out.append(secs / wall / tps)
    return out


def latest_bench(ctx: Context, bench: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """model -> its benchctl row in the newest bench invocation of the report's preset, on the runs' device, that
    measured the control at the control's config. Only rows whose config matches the model's runs count (a bench at
    other settings measures another model)."""
    if bench.empty or ctx.done.empty or ctx.preset is None or CONTROL not in ctx.done_models:
        return {}
    first = ctx.done.iloc[0]
    hardware = str(first["device_name"] or "").split(" (", 1)[0]
    b = bench[(bench["preset"] == ctx.preset) & (bench["impl"] == "benchctl") & (bench["device"] == first["device"])]
    b = b[b["device_name"].map(lambda n: str(n or "").split(" (", 1)[0] == hardware)]
    keys = {m: model_keys(ctx.done_of(m)["config_json"].iloc[0]) for m in ctx.done_models}
    order = b.groupby("bench_id")["created_at"].max().sort_values(ascending=False, kind="mergesort").index
    for bench_id in order:
        rows = b[b["bench_id"] == bench_id].to_dict("records")
        found = {
            m: r
            for m in keys
            for r in rows
            if r["arch"] == ctx.arch_of[m] and r.get("config_json") and model_keys(r["config_json"]) == keys[m]
        }
        if CONTROL in found:
            return found
    return {}


def timing_frame(ctx: Context, bench: pd.DataFrame) -> pd.DataFrame:
    """Per model: time per token from wall time and from CPU time (means over seeds), their ratios to the control,
    threads, jobs and load, and the bench ratios (time per token, FLOPs and their quotient, the cost ratio)."""
    rows = []
    bench_rows = latest_bench(ctx, bench)
    for m in ctx.done_models:
        g = ctx.done_of(m)
        runs = ctx.records_of(m)
        wall, cpu = _per_token(runs, "train_seconds"), _per_token(runs, "cpu_seconds")
        secs = [v for v in (_num(x) for x in g["train_seconds"]) if v]
        row: dict[str, Any] = {
            "model": m,
            "seeds": len(g),
            "wall": np.mean(wall) if wall else None,
            "cpu": np.mean(cpu) if len(cpu) == len(g) and cpu else None,
            "cuda": _mean(pd.Series(_per_token(runs, "cuda_seconds"))),
            "gpu_util": _mean(g["gpu_util"]),
            "threads": _distinct(g["threads"]),
            "jobs": _distinct(g["concurrent_jobs"]),
            "load": _mean(g["load_avg"]),
            "spread": max(secs) / min(secs) if len(secs) > 1 else None,
        }
        row["flops_per_token"] = _mean(g["flops_per_token"])
        b, c = bench_rows.get(m), bench_rows.get(CONTROL)
        if b is not None and c is not None:
            row["bench_time"] = float(c["tokens_per_s"]) / float(b["tokens_per_s"])
            row["bench_cost"] = row["bench_time"] / (float(b["flops_per_token"]) / float(c["flops_per_token"]))
        rows.append(row)
    df = pd.DataFrame(rows)
    for q in ("wall", "cpu"):
        base = df.loc[df["model"] == CONTROL, q]
        b0 = _num(base.iloc[0]) if not base.empty else None
        df[f"{q}_ratio"] = [(_num(v) / b0) if b0 and _num(v) is not None else None for v in df[q]]
    ctrl_flops = df.loc[df["model"] == CONTROL, "flops_per_token"]
    f0 = _num(ctrl_flops.iloc[0]) if not ctrl_flops.empty else None
    df["flops"] = [(_num(v) / f0) if f0 and _num(v) is not None else None for v in df["flops_per_token"]]
    for col in ("bench_time", "bench_cost"):
        if col not in df:
            df[col] = None
    return df


def _distinct(s: pd.Series) -> str:
    vals = sorted({int(v) for v in pd.to_numeric(s, errors="coerce").dropna()})
    return ", ".join(map(str, vals)) or "-"


def _seeds(seeds: list[Any]) -> str:
    """'0, 1 and 2'."""
    words = [str(x) for x in seeds]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _mean(s: pd.Series) -> float | None:
    v = pd.to_numeric(s, errors="coerce").dropna()
    return float(v.mean()) if len(v) else None


def headline(t: pd.DataFrame) -> str:
    """'bench', 'cpu' or 'wall': the ratio every model in `t` has, cleanest first."""
    for q in ("bench_time", "cpu_ratio"):
        if not t.empty and all(not missing(v) for v in t[q]):
            return "bench" if q == "bench_time" else "cpu"
    return "wall"


def benched_models(t: pd.DataFrame) -> list[str]:
    """The models of the timing frame that the latest `benchctl bench` measured, in the frame's order."""
    return [r["model"] for r in t.to_dict("records") if not missing(r["bench_time"])]


def warnings(ctx: Context, t: pd.DataFrame) -> list[str]:
    """Plain sentences on the runs whose wall times are not a cost measure, each saying which number to trust
    instead: one per reason a run was contended (naming its runs) and one per model whose seeds' wall times
    disagree."""
    fallback = {
        "bench": "the bench ratio",
        "cpu": "the CPU-time ratio (better: run `benchctl bench`)",
        "wall": "none measured here: run `benchctl bench` for a clean ratio",
    }[headline(t)]
    benched = set(benched_models(t))

    def trust(model: str) -> str:  # a model the latest bench measured has its clean ratio, whatever the others have
        return "the bench ratio" if model in benched else fallback

    # Runs contended for the same reason, with the same number to trust, share one sentence: a study run with
    # --jobs has every run contended alike, and a line per run would bury the other warnings.
    groups: dict[tuple[str, str], dict[str, list[Any]]] = {}
    done = ctx.done.sort_values(["model", "seed", "id"]).to_dict("records")
    for r in done:
        why = contention(r)
        if why:
            groups.setdefault((why, trust(r["model"])), {}).setdefault(r["model"], []).append(r["seed"])
    out = []
    for (why, to_trust), seeds in groups.items():
        n = sum(len(v) for v in seeds.values())
        if n == 1:
            ((model, (seed,)),) = seeds.items()
            out.append(
                f"{model} seed {seed} was contended ({why}): its wall time is not a cost measure here; trust "
                f"{to_trust} instead."
            )
            continue
        if n == len(done):
            who = f"All {n} runs"
        else:
            who = ", ".join(f"{m} seed {v[0]}" if len(v) == 1 else f"{m} seeds {_seeds(v)}" for m, v in seeds.items())
        out.append(
            f"{who} were contended ({why}): their wall times are not a cost measure here; trust {to_trust} instead."
        )
    for r in t.to_dict("records"):
        if not missing(r["spread"]) and r["spread"] > SEED_SPREAD_LIMIT:
            out.append(
                f"{r['model']}'s seeds took {r['spread']:.1f}× as long as each other (slowest over fastest, "
                f"above {SEED_SPREAD_LIMIT}×): its wall time is not a cost measure here; trust "
                f"{trust(r['model'])} instead."
            )
    return out


def _memory_kind(done: pd.DataFrame) -> str:
    """'gpu' when every done run has torch's peak GPU memory, else 'step': a training step's own memory
    (`step_mem_bytes`). The process's peak RSS is never the compared figure: in a train-all or study process it
    holds what earlier runs left to the allocator, so it tells nothing about the model."""
    if done.empty:
        return "step"
    gpu = pd.to_numeric(done["peak_gpu_mem_bytes"], errors="coerce")
    return "gpu" if gpu.notna().all() else "step"


def cost_frame(ctx: Context) -> pd.DataFrame:
    """Training time, throughput and memory per model (done runs), with ratios to the control."""
    kind = _memory_kind(ctx.done)
    mem_col = "peak_gpu_mem_bytes" if kind == "gpu" else "step_mem_bytes"
    rows = []
    for m in ctx.done_models:
        g = ctx.done_of(m)
        row: dict[str, Any] = {"model": m, "seeds": len(g), "memory_kind": kind}
        row["devices"] = ", ".join(sorted({str(d) for d in g["device_name"].dropna()})) or "unknown"
        # Cost is shown as mean and min–max over seeds: a t-interval from 2–3 timings (t = 12.7 at n = 2) is wide
        # enough to go below zero, which says nothing about a duration that is positive by construction.
        for q, col in (("time", "train_seconds"), ("mem", mem_col)):
            v = vals(g, col)
            row.update(ci_cols(q, stats.mean_ci(v)))
            row[f"{q}_min"], row[f"{q}_max"] = (min(v), max(v)) if v else (None, None)
        for c, name in (
            ("tokens_per_s", "tokens_per_s"),
            ("step_seconds", "step_seconds"),
            ("peak_gpu_reserved_bytes", "reserved"),
            ("peak_nvml_mem_bytes", "nvml"),
            ("peak_rss_bytes", "rss"),
            ("step_mem_bytes", "step_mem"),
            ("tokens_seen", "tokens"),
        ):
            v = vals(g, c)
            row[name] = float(np.mean(v)) if v else None
        row["step_mem_n"] = len(vals(g, "step_mem_bytes"))
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    ctrl = df[df["model"] == CONTROL]
    for q in ("time", "mem"):
        base = ctrl[f"{q}_mean"].iloc[0] if not ctrl.empty else None
        df[f"{q}_ratio"] = [
            (v / base) if (base is not None and pd.notna(base) and base > 0 and v is not None and pd.notna(v)) else None
            for v in df[f"{q}_mean"]
        ]
    return df
