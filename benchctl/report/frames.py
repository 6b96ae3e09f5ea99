"""Pure computations from the loaded tables to one DataFrame per report table or figure (no I/O, no formatting).

Only runs with status `done` enter the statistics. Means carry 95% t-intervals over seeds (benchctl.core.stats);
comparisons between models carry Holm-adjusted p-values per quantity, and their verdicts are decided on those.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import pandas as pd

import architectures
from benchctl.core import accounting, paper
from benchctl.core import stats
from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError
from benchctl.report.context import CONTROL, Context, arch_rank, model_keys
from benchctl.report.fmt import py
from benchctl.report.load import Data

CRITERIA = ("grammar", "creativity", "consistency", "plot")
JUDGE_COLUMNS = CRITERIA + ("average",)
N_BOOT = 2_000  # bootstrap resamples behind the judge's agreement intervals (Krippendorff's alpha)


def vals(df: pd.DataFrame, col: str) -> list[float]:
    return [float(v) for v in pd.to_numeric(df[col], errors="coerce") if pd.notna(v)]


def _ci_cols(prefix: str, ci: stats.MeanCI) -> dict[str, Any]:
    return {f"{prefix}_n": ci.n, f"{prefix}_mean": ci.mean, f"{prefix}_lo": ci.lo, f"{prefix}_hi": ci.hi}


def status_frame(ctx: Context) -> pd.DataFrame:
    """Runs per model and status, with the seeds that are done."""
    rows = []
    for m in ctx.models:
        g = ctx.runs[ctx.runs["model"] == m]
        row: dict[str, Any] = {"model": m}
        for s in ("done", "running", "pending", "failed"):
            row[s] = int((g["status"] == s).sum())
        row["other"] = int((~g["status"].isin(["done", "running", "pending", "failed"])).sum())
        row["seeds_done"] = sorted(int(x) for x in g.loc[g["status"] == "done", "seed"])
        rows.append(row)
    return pd.DataFrame(rows, columns=["model", "done", "running", "pending", "failed", "other", "seeds_done"])


def accounting_frame(ctx: Context) -> pd.DataFrame:
    """Parameters by component, totals, effective parameters and FLOPs/token per model, from the runs' configs
    (benchctl.core.accounting); falls back to the numbers recorded in the runs table when a config cannot be rebuilt.

    Components are whatever the models report, not a fixed list, so a new architecture's own parts get columns:
    the `components` column holds each row's component names in model order, `component_order` merges them, and
    every row has a column per component (0 where a rebuilt model has no such part, None for runs-table rows)."""
    rows = []
    for m in ctx.models:
        g = ctx.runs[ctx.runs["model"] == m]
        first = g.sort_values(["seed", "id"]).iloc[0]
        recorded = sorted({int(v) for v in pd.to_numeric(g["n_params"], errors="coerce").dropna()})
        row: dict[str, Any] = {"model": m, "arch": ctx.arch_of[m], "recorded_n_params": recorded}
        try:
            described = _describe(first["config_json"])
        except (ConfigError, TypeError):  # config from another benchctl version: use what training recorded
            row.update({
                "components": [],
                "total_params": _first_num(g["n_params"]),
                "effective_params": _first_num(g["effective_params"]),
                "flops_per_token": _first_num(g["flops_per_token"]),
                "effective_depth": None,
                "paper_total_params": None,
                "matches_paper": None,
                "source": "runs table",
            })
        else:
            row.update(described)
            row.update({"model": m, "components": _components_of(described), "source": "config"})
        rows.append(row)
    order = component_order(r["components"] for r in rows)
    for r in rows:
        for c in order:
            r.setdefault(c, 0 if r["source"] == "config" else None)
    return pd.DataFrame(rows)


def _components_of(described: dict[str, Any]) -> list[str]:
    """The component names of one accounting row, in the model's order. Rows that do not list them carry the
    accounting module's fixed set of components instead."""
    if described.get("components") is not None:
        return [str(c) for c in described["components"]]
    return [c for c in getattr(accounting, "COMPONENTS", ()) if c in described]


def component_order(per_model: Iterable[list[str]]) -> list[str]:
    """Every component any model has, in first-seen order: a component new to the table goes right before the
    next component of its own model that already has a column (at the end when there is none), so every model's
    own order holds, the embedding stays first and the final norm last."""
    out: list[str] = []
    for names in per_model:
        for i, name in enumerate(names):
            if name in out:
                continue
            after = [n for n in names[i + 1:] if n in out]
            out.insert(out.index(after[0]) if after else len(out), name)
    return out


@functools.lru_cache(maxsize=256)
def _describe(config_json: str) -> dict[str, Any]:
    """accounting.describe of a stored config; cached because building even a meta-device model is slow, and a
    report describes the same config once per run."""
    return dict(accounting.describe(RunConfig.from_json(config_json)))


def _first_num(s: pd.Series) -> float | None:
    v = pd.to_numeric(s, errors="coerce").dropna()
    return None if v.empty else float(v.iloc[0])


def paper_accounting_frame() -> pd.DataFrame:
    """The study's four models at the paper preset: our accounting beside the published totals."""
    return pd.DataFrame(list(_paper_accounting()))


@functools.lru_cache(maxsize=1)
def _paper_accounting() -> tuple[dict[str, Any], ...]:
    names = [a for a in architectures.names() if a in paper.TOTAL_PARAMS]
    return tuple(accounting.table("paper", names))


def _memory_kind(done: pd.DataFrame) -> str:
    """'gpu' when every done run has torch's peak GPU memory, else 'rss' (process peak resident set size)."""
    if done.empty:
        return "rss"
    gpu = pd.to_numeric(done["peak_gpu_mem_bytes"], errors="coerce")
    return "gpu" if gpu.notna().all() else "rss"


def cost_frame(ctx: Context) -> pd.DataFrame:
    """Training time, throughput and peak memory per model (done runs), with ratios to the control."""
    kind = _memory_kind(ctx.done)
    mem_col = "peak_gpu_mem_bytes" if kind == "gpu" else "peak_rss_bytes"
    rows = []
    for m in ctx.done_models:
        g = ctx.done[ctx.done["model"] == m]
        row: dict[str, Any] = {"model": m, "seeds": len(g), "memory_kind": kind}
        row["devices"] = ", ".join(sorted({str(d) for d in g["device_name"].dropna()})) or "unknown"
        # Cost is shown as mean and min–max over seeds: a t-interval from 2–3 timings (t = 12.7 at n = 2) is wide
        # enough to go below zero, which says nothing about a duration that is positive by construction.
        for q, col in (("time", "train_seconds"), ("mem", mem_col)):
            v = vals(g, col)
            row.update(_ci_cols(q, stats.mean_ci(v)))
            row[f"{q}_min"], row[f"{q}_max"] = (min(v), max(v)) if v else (None, None)
        for c, name in (("tokens_per_s", "tokens_per_s"), ("step_seconds", "step_seconds"),
                        ("peak_gpu_reserved_bytes", "reserved"), ("peak_nvml_mem_bytes", "nvml"),
                        ("peak_rss_bytes", "rss"), ("tokens_seen", "tokens")):
            v = vals(g, c)
            row[name] = float(np.mean(v)) if v else None
        # the model's own share of the peak RSS: peak minus the process's RSS before the model was built
        own = [float(p) - float(b) for p, b in zip(pd.to_numeric(g["peak_rss_bytes"], errors="coerce"),
                                                   pd.to_numeric(g["baseline_rss_bytes"], errors="coerce"))
               if pd.notna(p) and pd.notna(b)]
        row["own"] = float(np.mean(own)) if own else None
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


def loss_frame(ctx: Context) -> pd.DataFrame:
    """Initial and final validation loss per model: mean and 95% t-CI over seeds (done runs)."""
    rows = []
    for m in ctx.done_models:
        g = ctx.done[ctx.done["model"] == m]
        row: dict[str, Any] = {"model": m, "arch": ctx.arch_of[m], "seeds": len(g)}
        row.update(_ci_cols("initial", stats.mean_ci(vals(g, "initial_val_loss"))))
        row.update(_ci_cols("final", stats.mean_ci(vals(g, "final_val_loss"))))
        tok = vals(g, "tokens_seen")
        row["tokens"] = float(np.mean(tok)) if tok else None
        row["study_initial"] = paper.INITIAL_LOSS.get(m) if ctx.is_paper else None
        row["study_final"] = paper.FINAL_LOSS.get(m) if ctx.is_paper else None
        rows.append(row)
    return pd.DataFrame(rows)


def _tokens_per_step(config_json: Any) -> float | None:
    keys = model_keys(config_json)
    try:
        return float(keys["train.batch_size"] * keys["train.grad_accum"] * keys["model.max_seq_len"])
    except (KeyError, TypeError):
        return None


def curve_frame(ctx: Context, metrics: pd.DataFrame) -> pd.DataFrame:
    """Validation loss against tokens per (model, step): mean, min and max over the done seeds."""
    cols = ["model", "step", "tokens", "mean", "min", "max", "n"]
    if ctx.done.empty or metrics.empty:
        return pd.DataFrame(columns=cols)
    runs = ctx.done[["id", "model", "config_json"]].rename(columns={"id": "run_id"})
    df = metrics[metrics["name"] == "val_loss"].merge(runs, on="run_id", how="inner")
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    df["step"] = pd.to_numeric(df["step"], errors="coerce")
    tps = df["config_json"].map(_tokens_per_step)
    df["tokens"] = pd.to_numeric(df["tokens"], errors="coerce").fillna(df["step"] * pd.to_numeric(tps))
    out = (
        df.groupby(["model", "step"], sort=True)
        .agg(tokens=("tokens", "mean"), mean=("value", "mean"), min=("value", "min"), max=("value", "max"),
             n=("value", "count"))
        .reset_index()
    )
    order = {m: i for i, m in enumerate(ctx.models)}
    out["_o"] = out["model"].map(order)
    return out.sort_values(["_o", "step"]).drop(columns="_o").reset_index(drop=True)[cols]


@dataclass
class JudgeGroup:
    """Grades from one judge model, protocol and prompt file on samples drawn with one set of sampling settings.

    The protocol is hashed into the prompt hash when grades are made, so one group never mixes protocols."""

    judge_model: str
    prompt_hash: str
    settings: dict[str, Any]
    table: pd.DataFrame  # one row per model
    per_prompt: dict[str, dict[str, float]]  # model -> prompt id -> mean judge average over seeds and repeats
    n_ok: int
    protocol: str = "json"  # grades stored before protocols existed were made with the JSON-only one
    # model -> (seed, prompt id) -> judge average of that sample, its repeats averaged: the unit the tests pair on
    per_seed_prompt: dict[str, dict[tuple[int, str], float]] = field(default_factory=dict)
    # every grade row of the group, with its model, run_seed and the sample's n_tokens
    grades: pd.DataFrame = field(default_factory=pd.DataFrame)


def judge_groups(ctx: Context, samples: pd.DataFrame, grades: pd.DataFrame) -> list[JudgeGroup]:
    """Judge grades of the done runs, grouped by (judge model, prompt hash, sampling settings), most grades first.

    Each sample's ok repeats are averaged first. The table's intervals are over seeds when there are two or more
    (each seed's mean over its graded samples is one value: the seed is the unit a claim about an architecture
    rests on); with one seed they are over that seed's samples and speak for the trained models only."""
    if ctx.done.empty or samples.empty or grades.empty:
        return []
    runs = ctx.done[["id", "model", "seed"]].rename(columns={"id": "run_id", "seed": "run_seed"})
    s = samples.merge(runs, on="run_id", how="inner").rename(columns={"id": "sample_id"})
    s["settings_key"] = s["settings_hash"].astype(object).where(s["settings_hash"].notna(), None)
    missing = s["settings_key"].isna()
    if missing.any():  # no hash recorded: the settings themselves are the key
        s.loc[missing, "settings_key"] = s.loc[missing].apply(
            lambda r: json.dumps([py(r[c]) for c in ("temperature", "top_k", "top_p", "max_new_tokens", "n_recur")]),
            axis=1,
        )
    g = grades.merge(s[["sample_id", "run_id", "prompt_id", "model", "run_seed", "n_tokens", "settings_key"]],
                     on="sample_id", how="inner")
    if g.empty:
        return []
    for c in CRITERIA + ("average",):
        g[c] = pd.to_numeric(g[c], errors="coerce")
    g["average"] = g["average"].fillna(g[list(CRITERIA)].mean(axis=1, skipna=False))
    out = [_judge_group(ctx, s[s["settings_key"] == sk], gg, str(jm), str(ph))
           for (jm, ph, sk), gg in g.groupby(["judge_model", "prompt_hash", "settings_key"], sort=True)]
    return sorted(out, key=lambda j: (-j.n_ok, j.judge_model, j.prompt_hash, json.dumps(j.settings, sort_keys=True)))


def _judge_group(ctx: Context, ss: pd.DataFrame, gg: pd.DataFrame, jm: str, ph: str) -> JudgeGroup:
    ok = gg[gg["status"] == "ok"]
    per_sample = (ok.groupby(["model", "run_seed", "sample_id", "prompt_id"], sort=True)[list(JUDGE_COLUMNS)]
                  .mean().reset_index())
    rows, per_prompt, per_seed_prompt = [], {}, {}
    for m in ctx.done_models:
        ms = ss[ss["model"] == m]
        if ms.empty:
            continue
        mg, mps = gg[gg["model"] == m], per_sample[per_sample["model"] == m]
        seeds = int(mps["run_seed"].nunique())
        row: dict[str, Any] = {
            "model": m,
            "samples": len(ms),
            "graded": int(mps["sample_id"].nunique()),
            "failed": int((mg["status"] != "ok").sum()),
            "repeats": int(mg["repeat"].nunique()) if not mg.empty else 0,
            "prompts": int(mps["prompt_id"].nunique()),
            "seeds": seeds,
            "ci_unit": "seeds" if seeds >= 2 else "samples",
        }
        for c in JUDGE_COLUMNS:
            values = mps.groupby("run_seed", sort=True)[c].mean().tolist() if seeds >= 2 else mps[c].tolist()
            row.update(_ci_cols(c, stats.mean_ci(values)))
        rows.append(row)
        per_prompt[m] = {str(k): float(v) for k, v in mps.groupby("prompt_id", sort=True)["average"].mean().items()}
        per_seed_prompt[m] = {(int(r.run_seed), str(r.prompt_id)): float(r.average)
                              for r in mps.groupby(["run_seed", "prompt_id"], sort=True)["average"].mean()
                              .reset_index().itertuples()}
    first = ss.sort_values("sample_id").iloc[0] if not ss.empty else None
    settings = {} if first is None else {c: py(first[c]) for c in ("temperature", "top_k", "top_p", "max_new_tokens")}
    protocols = sorted({str(p) for p in gg["protocol"].dropna()}) if "protocol" in gg else []
    return JudgeGroup(jm, ph, settings, pd.DataFrame(rows), per_prompt, len(ok),
                      protocol="/".join(protocols) or "json", per_seed_prompt=per_seed_prompt,
                      grades=gg.reset_index(drop=True))


def eval_frame(ctx: Context, evals: pd.DataFrame) -> pd.DataFrame:
    """lm-eval results per (model, n_recur, limit, task, metric): mean over seeds, mean stderr, seed count."""
    cols = ["model", "n_recur", "trained_n_recur", "limit_n", "task", "metric", "value", "stderr", "seeds"]
    if ctx.done.empty or evals.empty:
        return pd.DataFrame(columns=cols)
    runs = ctx.done[["id", "model", "config_json"]].rename(columns={"id": "run_id"})
    df = evals.merge(runs, on="run_id", how="inner")
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["trained_n_recur"] = df["config_json"].map(lambda c: model_keys(c).get("model.n_recur"))
    for c in ("value", "stderr", "n_recur", "limit_n"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df["n_recur"] = df["n_recur"].fillna(df["trained_n_recur"])
    df["limit_n"] = df["limit_n"].fillna(0)
    rows = []
    for (m, r, lim, task, metric), g in df.groupby(["model", "n_recur", "limit_n", "task", "metric"], sort=True):
        se = g["stderr"].dropna()
        rows.append({
            "model": m, "n_recur": int(r), "trained_n_recur": py(g["trained_n_recur"].iloc[0]), "limit_n": int(lim),
            "task": str(task), "metric": str(metric), "value": float(g["value"].mean()),
            "stderr": float(se.mean()) if not se.empty else None, "seeds": int(g["run_id"].nunique()),
        })
    out = pd.DataFrame(rows, columns=cols)
    order = {m: i for i, m in enumerate(ctx.models)}
    out["_o"] = out["model"].map(order)
    return out.sort_values(["_o", "n_recur", "limit_n", "task", "metric"]).drop(columns="_o").reset_index(drop=True)


def _pairs(models: list[str]) -> list[tuple[str, str]]:
    """Each other model against the control, then every pair of the other models (display order)."""
    others = [m for m in models if m != CONTROL]
    pairs = [(m, CONTROL) for m in others] if CONTROL in models else []
    pairs += [(a, b) for i, a in enumerate(others) for b in others[i + 1:]]
    return pairs


LOSS = "final validation loss"
JUDGE_AVERAGE = "judge average"


def comparison_frame(ctx: Context, judge: JudgeGroup | None = None) -> pd.DataFrame:
    """Differences a − b in final validation loss (benchctl.core.stats.compare_seeds: paired t over shared seeds, Welch
    when the seeds differ) and judge average (stats.compare_judge: t over per-seed mean differences, or over prompts
    with one seed), with 95% CI, p, Holm-adjusted p per quantity, and a verdict sentence decided on the adjusted p."""
    cols = ["a", "b", "quantity", "method", "n_a", "n_b", "n_prompts", "scope", "diff", "lo", "hi", "p",
            "p_wilcoxon", "p_holm", "verdict"]
    found: list[tuple[str, str, str, stats.Comparison]] = []
    pairs = _pairs(ctx.done_models)
    for a, b in pairs:
        found.append((a, b, LOSS, stats.compare_seeds(_per_seed(ctx, a), _per_seed(ctx, b))))
    if judge is not None:
        for a, b in pairs:
            if a in judge.per_seed_prompt and b in judge.per_seed_prompt:
                found.append((a, b, JUDGE_AVERAGE,
                              stats.compare_judge(judge.per_seed_prompt[a], judge.per_seed_prompt[b])))
    adjusted: list[float | None] = [None] * len(found)
    for q in (LOSS, JUDGE_AVERAGE):
        idx = [i for i, f in enumerate(found) if f[2] == q]
        for i, p in zip(idx, stats.holm([found[i][3].p for i in idx])):
            adjusted[i] = p
    rows = []
    for (a, b, q, c), p_adj in zip(found, adjusted):
        family = f"the {sum(1 for f in found if f[2] == q and f[3].testable)} pairwise comparisons of {q}"
        rows.append({
            "a": a, "b": b, "quantity": q, "method": c.method, "n_a": c.n_a, "n_b": c.n_b, "n_prompts": c.n_prompts,
            "scope": c.scope, "diff": c.diff, "lo": c.lo, "hi": c.hi, "p": c.p, "p_wilcoxon": c.p_wilcoxon,
            "p_holm": p_adj,
            "verdict": stats.verdict(a, b, q, c, p_adj=p_adj, family=family, digits=3 if q == LOSS else 2),
        })
    return pd.DataFrame(rows, columns=cols)


def _per_seed(ctx: Context, model: str) -> dict[int, float | None]:
    """seed -> final validation loss of the model's done run at that seed (the mean if a seed ran twice)."""
    g = ctx.done[ctx.done["model"] == model]
    v = pd.to_numeric(g["final_val_loss"], errors="coerce")
    return {int(k): (None if pd.isna(x) else float(x)) for k, x in v.groupby(g["seed"].astype(int)).mean().items()}


def bench_frame(ctx: Context, bench: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The latest `benchctl bench` invocation for the preset (and how many earlier invocations exist)."""
    if bench.empty or ctx.preset is None:
        return bench.iloc[0:0], 0
    b = bench[bench["preset"] == ctx.preset].copy()
    if b.empty:
        return b, 0
    ids = b.groupby("bench_id")["created_at"].max().reset_index()
    ids = ids.sort_values(["created_at", "bench_id"], na_position="first")
    latest = ids["bench_id"].iloc[-1]
    b = b[b["bench_id"] == latest].copy()
    b["_o"] = b["arch"].map(lambda a: arch_rank(str(a)))
    b = b.sort_values(["_o", "impl", "compiled", "id"]).drop(columns="_o").reset_index(drop=True)
    return b, len(ids) - 1


@dataclass
class Frames:
    """What every report section reads: the preset's models, the loaded tables, and frames that several sections
    share (computed once, on first use). Sections add the figures they draw to `figures` (file name -> Figure)."""

    ctx: Context
    data: Data
    figures: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def judge_groups(self) -> list[JudgeGroup]:
        """Judge grades grouped by judge model, prompt and sampling settings; the first is the primary group."""
        return judge_groups(self.ctx, self.data.samples, self.data.judge_grades)

    @property
    def primary_judge(self) -> JudgeGroup | None:
        groups = self.judge_groups
        return groups[0] if groups else None
