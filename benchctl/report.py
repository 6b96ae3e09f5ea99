"""The study's report from results.db: tables and figures with seeds and statistics, beside the published numbers.

PRACTICES.md item 9: a report is a pure function of the database — query -> DataFrame -> markdown table / seaborn
figure — with a fixed colour and order per architecture. `load` is the only function that touches SQLite (read
only); `render` turns the loaded tables into markdown and matplotlib figures without I/O; `write_report` saves them.
The sections follow the study (SPEC §6): its Figures 1–2 (training time and memory), Tables 3 and 5 and Figure 3
(validation loss), Table 4 (judge grades), plus what benchctl adds: seeds with 95% CIs, lm-eval, significance tests
between models (benchctl.stats), benchmark numbers and provenance.

Rules the output keeps:
- only runs with status `done` enter the statistics; other runs are listed with their status and error;
- runs of one preset whose configs differ (a `--set` override) are different models, never pooled as seeds;
- a missing stage leaves its section with one line naming the command that produces it;
- the same database gives byte-identical markdown: everything sorted, fixed float formats, no "now" timestamps.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from benchctl import paper, stats
from benchctl.db import SCHEMA_VERSION, schema_columns
from benchctl.errors import ConfigError, DatabaseError

CRITERIA = ("grammar", "creativity", "consistency", "plot")
JUDGE_COLUMNS = CRITERIA + ("average",)

# The study's four architectures keep these colours everywhere (colour-blind safe, control in neutral grey);
# other architectures and config variants take EXTRA_COLOURS in a fixed order.
ARCH_COLOURS = {"control": "#4D4D4D", "frailt": "#0173B2", "three-part": "#DE8F05", "relaxed": "#029E73"}
EXTRA_COLOURS = (
    "#CC78BC", "#D55E00", "#56B4E9", "#CA9161", "#FBAFE4", "#949494", "#ECE133", "#8C564B", "#17BECF", "#BCBD22",
)
CONTROL = "control"
FIG_DPI = 150
N_BOOT = 10_000

# Config keys that do not change what a run computes (how it is logged, where the data was read from) or that are
# the axis being averaged over (seed): runs differing only in these are seeds of one model.
_NOT_MODEL_KEYS = frozenset(
    {"arch", "preset", "seed", "train.log_interval", "train.ckpt_interval", "train.eval_interval", "data.source"}
)

# Columns the report reads; large text columns (completions, raw judge answers, configs of bench rows) are skipped.
_SKIP_COLUMNS = {"samples": {"completion", "settings_json"}, "judge_grades": {"raw_text"}, "bench": {"config_json"},
                 "prompts": {"text"}}
_TABLES = ("runs", "metrics", "prompts", "samples", "judge_grades", "eval_results", "bench")
_PKS = {
    "runs": ["preset", "arch", "seed", "id"],
    "metrics": ["run_id", "name", "step"],
    "prompts": ["id"],
    "samples": ["id"],
    "judge_grades": ["sample_id", "judge_model", "prompt_hash", "repeat"],
    "eval_results": ["run_id", "task", "metric", "n_recur", "limit_n"],
    "bench": ["id"],
}


# ======================================================================================================================
# Loading (the only I/O on the database)


@dataclass(frozen=True)
class Data:
    """The tables the report reads, one DataFrame each, sorted by primary key (empty when a table is absent)."""

    runs: pd.DataFrame
    metrics: pd.DataFrame  # val_loss rows only
    prompts: pd.DataFrame
    samples: pd.DataFrame
    grades: pd.DataFrame
    evals: pd.DataFrame
    bench: pd.DataFrame


def open_db(path: str | os.PathLike) -> sqlite3.Connection:
    """Open results.db read-only; a missing or unreadable file is a DatabaseError that says what to do."""
    p = Path(path)
    if not p.is_file():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' (or 'benchctl study') first, "
            "or pass --db PATH (or set BENCHCTL_DB)"
        )
    try:
        conn = sqlite3.connect(p.resolve().as_uri() + "?mode=ro", uri=True, timeout=30.0)
        conn.execute("select count(*) from sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database {p}: {e}") from None
    return conn


def load(conn: sqlite3.Connection) -> Data:
    """Read the report's tables into DataFrames with every schema column present (older databases get NULLs)."""
    try:
        have = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
        if "meta" in have:
            row = conn.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise DatabaseError(
                    f"results database has schema version {row[0]}, newer than this benchctl ({SCHEMA_VERSION}); "
                    "upgrade benchctl"
                )
        frames = {t: _read_table(conn, t, have) for t in _TABLES}
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database: {e}") from None
    return Data(
        runs=frames["runs"], metrics=frames["metrics"], prompts=frames["prompts"], samples=frames["samples"],
        grades=frames["judge_grades"], evals=frames["eval_results"], bench=frames["bench"],
    )


def _read_table(conn: sqlite3.Connection, table: str, have: set[str]) -> pd.DataFrame:
    wanted = [c for c in schema_columns(table) if c not in _SKIP_COLUMNS.get(table, set())]
    if table not in have:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in wanted})
    present = {r[1] for r in conn.execute(f"pragma table_info('{table}')")}
    cols = [c for c in wanted if c in present]
    where = " where name = 'val_loss'" if table == "metrics" else ""
    sql = f"select {', '.join(cols)} from {table}{where}"
    df = pd.DataFrame.from_records(conn.execute(sql).fetchall(), columns=cols)
    for c in wanted:
        if c not in df.columns:
            df[c] = None
    df = df[wanted]
    keys = [k for k in _PKS[table] if k in df.columns]
    return df.sort_values(keys, kind="mergesort", na_position="first").reset_index(drop=True)


# ======================================================================================================================
# Which runs, which models


@dataclass
class Context:
    """One preset's runs, split into models (architecture + config variant), in the fixed order with colours."""

    preset: str | None
    runs: pd.DataFrame  # every run of the preset, with `model` and `overrides` columns
    done: pd.DataFrame  # status == done
    models: list[str]  # in display order (architecture order, then variants)
    colours: dict[str, str]
    arch_of: dict[str, str]
    overrides: dict[str, str]  # model -> keys that differ from the preset's defaults ("" when none)
    other_presets: list[tuple[str, int, int]] = field(default_factory=list)  # (preset, done, total)

    @property
    def done_models(self) -> list[str]:
        have = set(self.done["model"])
        return [m for m in self.models if m in have]

    @property
    def is_paper(self) -> bool:
        return self.preset == "paper"


def choose_preset(runs: pd.DataFrame, preset: str | None) -> tuple[str | None, list[tuple[str, int, int]]]:
    """The requested preset, or the one with most done runs (ties: most runs, then name); plus the others' counts."""
    counts: list[tuple[str, int, int]] = []
    for p, g in runs.groupby("preset", sort=True):
        counts.append((str(p), int((g["status"] == "done").sum()), len(g)))
    if preset is None:
        if not counts:
            return None, []
        chosen = sorted(counts, key=lambda c: (-c[1], -c[2], c[0]))[0][0]
    else:
        from benchctl.config import preset_names

        known = sorted(set(preset_names()) | {c[0] for c in counts})
        if preset not in known:
            import difflib

            close = difflib.get_close_matches(preset, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown preset '{preset}'{hint} known: {', '.join(known)}")
        chosen = preset
    return chosen, [c for c in counts if c[0] != chosen]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _model_keys(config_json: Any) -> dict[str, Any]:
    try:
        raw = json.loads(config_json) if isinstance(config_json, str) else {}
    except json.JSONDecodeError:
        return {"config_json": str(config_json)}
    return {k: v for k, v in _flatten(raw if isinstance(raw, dict) else {}).items() if k not in _NOT_MODEL_KEYS}


def _preset_defaults(preset: str | None, arch: str) -> dict[str, Any] | None:
    from benchctl.config import make_config

    try:
        flat = _flatten(make_config(preset or "", arch).to_dict())
        return {k: v for k, v in flat.items() if k not in _NOT_MODEL_KEYS}
    except ConfigError:  # an architecture or preset this benchctl does not know: no defaults to compare with
        return None


def _diff(keys: dict[str, Any], base: dict[str, Any]) -> list[str]:
    def show(v: Any) -> str:
        return "none" if v is None else (json.dumps(v) if isinstance(v, (list, dict)) else str(v))

    return [f"{k}={show(keys.get(k))}" for k in sorted(set(keys) | set(base)) if keys.get(k) != base.get(k)]


def _arch_rank(arch: str) -> tuple[int, str]:
    import architectures

    names = architectures.names()
    return (names.index(arch), "") if arch in names else (len(names), arch)


def build_context(runs: pd.DataFrame, preset: str | None) -> Context:
    """Select a preset's runs and split them into models. Pure: runs frame in, Context out."""
    chosen, others = choose_preset(runs, preset)
    sel = runs[runs["preset"] == chosen].copy() if chosen is not None else runs.iloc[0:0].copy()
    sel["model"] = sel["arch"].astype(object)
    sel["overrides"] = ""
    ordered: list[tuple[tuple, str]] = []
    arch_of: dict[str, str] = {}
    overrides: dict[str, str] = {}
    for arch in sorted(set(sel["arch"]), key=_arch_rank):
        idx = sel.index[sel["arch"] == arch]
        sig = {i: (_model_keys(sel.at[i, "config_json"]), str(sel.at[i, "data_fingerprint"] or "")) for i in idx}
        variants: dict[str, tuple[dict[str, Any], str]] = {}
        members: dict[str, list[int]] = {}
        for i, (keys, fp) in sig.items():
            s = json.dumps([keys, fp], sort_keys=True, default=str)
            variants[s] = (keys, fp)
            members.setdefault(s, []).append(i)
        defaults = _preset_defaults(chosen, arch)
        vs_default = {s: ("" if defaults is None else ", ".join(_diff(k, defaults))) for s, (k, _) in variants.items()}
        # The base variant: the preset's defaults if some runs have them, else the one with most runs.
        base = sorted(variants, key=lambda s: (vs_default[s] != "", -len(members[s]), s))[0]
        for rank, s in enumerate(sorted(variants, key=lambda s: (s != base, s))):
            keys, fp = variants[s]
            if s == base:
                name = arch
            else:
                parts = _diff(keys, variants[base][0])
                if fp != variants[base][1]:
                    parts.append(f"data={fp[:8]}")
                name = f"{arch} [{', '.join(parts)}]"
            sel.loc[members[s], "model"] = name
            sel.loc[members[s], "overrides"] = vs_default[s]
            ordered.append(((_arch_rank(arch), rank), name))
            arch_of[name] = arch
            overrides[name] = vs_default[s]
    models = [name for _, name in sorted(ordered)]
    return Context(
        preset=chosen, runs=sel.reset_index(drop=True), done=sel[sel["status"] == "done"].reset_index(drop=True),
        models=models, colours=colours_for(models, arch_of), arch_of=arch_of, overrides=overrides,
        other_presets=others,
    )


def colours_for(models: list[str], arch_of: dict[str, str]) -> dict[str, str]:
    """Fixed colours: the study's four keep theirs; other registered architectures take EXTRA_COLOURS by registry
    position; unregistered architectures and config variants take the colours after those, in display order."""
    import architectures

    extra_registered = [n for n in architectures.names() if n not in ARCH_COLOURS]
    out: dict[str, str] = {}
    k = len(extra_registered)
    for m in models:
        arch = arch_of.get(m, m)
        if m == arch and arch in ARCH_COLOURS:
            out[m] = ARCH_COLOURS[arch]
        elif m == arch and arch in extra_registered:
            out[m] = EXTRA_COLOURS[extra_registered.index(arch) % len(EXTRA_COLOURS)]
        else:
            out[m] = EXTRA_COLOURS[k % len(EXTRA_COLOURS)]
            k += 1
    return out


# ======================================================================================================================
# Frames: pure functions from the loaded tables to one DataFrame per table/figure


def _vals(df: pd.DataFrame, col: str) -> list[float]:
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
    (benchctl.accounting); falls back to the numbers recorded in the runs table when a config cannot be rebuilt."""
    from benchctl import accounting

    rows = []
    for m in ctx.models:
        g = ctx.runs[ctx.runs["model"] == m]
        first = g.sort_values(["seed", "id"]).iloc[0]
        recorded = sorted({int(v) for v in pd.to_numeric(g["n_params"], errors="coerce").dropna()})
        row: dict[str, Any] = {"model": m, "arch": ctx.arch_of[m], "recorded_n_params": recorded}
        try:
            row.update(_describe(first["config_json"]))
            row["model"] = m
            row["source"] = "config"
        except (ConfigError, TypeError):  # config from another benchctl version: use what training recorded
            row.update(
                {c: None for c in accounting.COMPONENTS}
                | {
                    "total_params": _first_num(g["n_params"]),
                    "effective_params": _first_num(g["effective_params"]),
                    "flops_per_token": _first_num(g["flops_per_token"]),
                    "effective_depth": None,
                    "paper_total_params": None,
                    "matches_paper": None,
                    "source": "runs table",
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


@functools.lru_cache(maxsize=256)
def _describe(config_json: str) -> dict[str, Any]:
    """accounting.describe of a stored config; cached because building even a meta-device model takes ~0.5 s."""
    from benchctl import accounting
    from benchctl.config import RunConfig

    return dict(accounting.describe(RunConfig.from_json(config_json)))


def _first_num(s: pd.Series) -> float | None:
    v = pd.to_numeric(s, errors="coerce").dropna()
    return None if v.empty else float(v.iloc[0])


def paper_accounting_frame() -> pd.DataFrame:
    """The study's four models at the paper preset: our accounting beside the published totals."""
    return pd.DataFrame(list(_paper_accounting()))


@functools.lru_cache(maxsize=1)
def _paper_accounting() -> tuple[dict[str, Any], ...]:
    import architectures

    from benchctl import accounting

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
            v = _vals(g, col)
            row.update(_ci_cols(q, stats.mean_ci(v)))
            row[f"{q}_min"], row[f"{q}_max"] = (min(v), max(v)) if v else (None, None)
        for c, name in (("tokens_per_s", "tokens_per_s"), ("step_seconds", "step_seconds"),
                        ("peak_gpu_reserved_bytes", "reserved"), ("peak_nvml_mem_bytes", "nvml"),
                        ("peak_rss_bytes", "rss"), ("tokens_seen", "tokens")):
            v = _vals(g, c)
            row[name] = float(np.mean(v)) if v else None
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
        row.update(_ci_cols("initial", stats.mean_ci(_vals(g, "initial_val_loss"))))
        row.update(_ci_cols("final", stats.mean_ci(_vals(g, "final_val_loss"))))
        tok = _vals(g, "tokens_seen")
        row["tokens"] = float(np.mean(tok)) if tok else None
        row["study_initial"] = paper.INITIAL_LOSS.get(m) if ctx.is_paper else None
        row["study_final"] = paper.FINAL_LOSS.get(m) if ctx.is_paper else None
        rows.append(row)
    return pd.DataFrame(rows)


def _tokens_per_step(config_json: Any) -> float | None:
    keys = _model_keys(config_json)
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
    """Grades from one judge model and prompt file on samples drawn with one set of sampling settings."""

    judge_model: str
    prompt_hash: str
    settings: dict[str, Any]
    table: pd.DataFrame  # one row per model
    per_prompt: dict[str, dict[str, float]]  # model -> prompt id -> mean judge average over seeds and repeats
    n_ok: int


def judge_groups(ctx: Context, samples: pd.DataFrame, grades: pd.DataFrame) -> list[JudgeGroup]:
    """Judge grades of the done runs, grouped by (judge model, prompt hash, sampling settings), most grades first.

    Each sample's ok repeats are averaged first, so a CI is over samples (prompts × seeds), not over repeats."""
    if ctx.done.empty or samples.empty or grades.empty:
        return []
    s = samples.merge(ctx.done[["id", "model"]].rename(columns={"id": "run_id"}), on="run_id", how="inner")
    s = s.rename(columns={"id": "sample_id"})
    s["settings_key"] = s["settings_hash"].astype(object).where(s["settings_hash"].notna(), None)
    missing = s["settings_key"].isna()
    if missing.any():  # no hash recorded: the settings themselves are the key
        s.loc[missing, "settings_key"] = s.loc[missing].apply(
            lambda r: json.dumps([_py(r[c]) for c in ("temperature", "top_k", "top_p", "max_new_tokens", "n_recur")]),
            axis=1,
        )
    g = grades.merge(s[["sample_id", "run_id", "prompt_id", "model", "settings_key"]], on="sample_id", how="inner")
    if g.empty:
        return []
    for c in CRITERIA + ("average",):
        g[c] = pd.to_numeric(g[c], errors="coerce")
    g["average"] = g["average"].fillna(g[list(CRITERIA)].mean(axis=1, skipna=False))
    out: list[JudgeGroup] = []
    for (jm, ph, sk), gg in g.groupby(["judge_model", "prompt_hash", "settings_key"], sort=True):
        ss = s[s["settings_key"] == sk]
        ok = gg[gg["status"] == "ok"]
        per_sample = (ok.groupby(["model", "sample_id", "prompt_id"], sort=True)[list(JUDGE_COLUMNS)]
                      .mean().reset_index())
        rows, per_prompt = [], {}
        for m in ctx.done_models:
            ms = ss[ss["model"] == m]
            if ms.empty:
                continue
            mg, mps = gg[gg["model"] == m], per_sample[per_sample["model"] == m]
            row: dict[str, Any] = {
                "model": m,
                "samples": len(ms),
                "graded": int(mps["sample_id"].nunique()),
                "failed": int((mg["status"] != "ok").sum()),
                "repeats": int(mg["repeat"].nunique()) if not mg.empty else 0,
                "prompts": int(mps["prompt_id"].nunique()),
            }
            for c in JUDGE_COLUMNS:
                row.update(_ci_cols(c, stats.mean_ci(mps[c].tolist())))
            rows.append(row)
            per_prompt[m] = {str(k): float(v) for k, v in mps.groupby("prompt_id", sort=True)["average"].mean().items()}
        first = ss.sort_values("sample_id").iloc[0] if not ss.empty else None
        settings = {} if first is None else {
            c: _py(first[c]) for c in ("temperature", "top_k", "top_p", "max_new_tokens")
        }
        out.append(JudgeGroup(str(jm), str(ph), settings, pd.DataFrame(rows), per_prompt, len(ok)))
    return sorted(out, key=lambda j: (-j.n_ok, j.judge_model, j.prompt_hash, json.dumps(j.settings, sort_keys=True)))


def _py(v: Any) -> Any:
    """numpy/pandas scalars and NaN as plain Python values (for JSON and formatting)."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return None
    if isinstance(v, np.generic):
        return v.item()
    return v


def eval_frame(ctx: Context, evals: pd.DataFrame) -> pd.DataFrame:
    """lm-eval results per (model, n_recur, limit, task, metric): mean over seeds, mean stderr, seed count."""
    cols = ["model", "n_recur", "trained_n_recur", "limit_n", "task", "metric", "value", "stderr", "seeds"]
    if ctx.done.empty or evals.empty:
        return pd.DataFrame(columns=cols)
    runs = ctx.done[["id", "model", "config_json"]].rename(columns={"id": "run_id"})
    df = evals.merge(runs, on="run_id", how="inner")
    if df.empty:
        return pd.DataFrame(columns=cols)
    df["trained_n_recur"] = df["config_json"].map(lambda c: _model_keys(c).get("model.n_recur"))
    for c in ("value", "stderr", "n_recur", "limit_n"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df["n_recur"] = df["n_recur"].fillna(df["trained_n_recur"])
    df["limit_n"] = df["limit_n"].fillna(0)
    rows = []
    for (m, r, lim, task, metric), g in df.groupby(["model", "n_recur", "limit_n", "task", "metric"], sort=True):
        se = g["stderr"].dropna()
        rows.append({
            "model": m, "n_recur": int(r), "trained_n_recur": _py(g["trained_n_recur"].iloc[0]), "limit_n": int(lim),
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


def comparison_frame(ctx: Context, judge: JudgeGroup | None = None) -> pd.DataFrame:
    """Differences a − b in final validation loss (Welch over seeds) and judge average (paired bootstrap over
    shared prompts), with 95% CI, p, Holm-adjusted p per quantity, and a verdict sentence."""
    cols = ["a", "b", "quantity", "method", "n_a", "n_b", "diff", "lo", "hi", "p", "p_holm", "verdict"]
    rows = []
    pairs = _pairs(ctx.done_models)
    for a, b in pairs:
        d = stats.welch(_vals(ctx.done[ctx.done["model"] == a], "final_val_loss"),
                        _vals(ctx.done[ctx.done["model"] == b], "final_val_loss"))
        rows.append(_comparison_row(a, b, "final validation loss", d, "seeds", 3))
    if judge is not None:
        for a, b in pairs:
            if a not in judge.per_prompt or b not in judge.per_prompt:
                continue
            d = stats.paired_bootstrap(judge.per_prompt[a], judge.per_prompt[b], n_boot=N_BOOT,
                                       seed=zlib.crc32(f"{a}|{b}".encode()))
            rows.append(_comparison_row(a, b, "judge average", d, "prompts", 2))
    df = pd.DataFrame(rows, columns=cols)
    for q in df["quantity"].unique():
        mask = df["quantity"] == q
        df.loc[mask, "p_holm"] = pd.Series(stats.holm([_py(p) for p in df.loc[mask, "p"]]), index=df.index[mask],
                                           dtype=object)
    return df


def _comparison_row(a: str, b: str, quantity: str, d: stats.Diff, unit: str, digits: int) -> dict[str, Any]:
    return {
        "a": a, "b": b, "quantity": quantity, "method": d.method, "n_a": d.n_a, "n_b": d.n_b, "diff": d.diff,
        "lo": d.lo, "hi": d.hi, "p": d.p, "p_holm": None,
        "verdict": stats.verdict(a, b, quantity, d, unit=unit, digits=digits),
    }


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
    b["_o"] = b["arch"].map(lambda a: _arch_rank(str(a)))
    b = b.sort_values(["_o", "impl", "compiled", "id"]).drop(columns="_o").reset_index(drop=True)
    return b, len(ids) - 1


# ======================================================================================================================
# Formatting


def _missing(x: Any) -> bool:
    return x is None or x is pd.NA or (isinstance(x, (float, np.floating)) and math.isnan(x))


def fnum(x: Any, digits: int = 3) -> str:
    """Fixed-point with thousands separators; '-' for a missing value; never '-0.000'."""
    if _missing(x):
        return "-"
    s = f"{float(x):,.{digits}f}"
    return s[1:] if s.startswith("-") and float(s.replace(",", "")) == 0 else s


def fint(x: Any) -> str:
    return "-" if _missing(x) else f"{int(round(float(x))):,}"


def fci(lo: Any, hi: Any, n: Any, digits: int = 3, unit: str = "seed") -> str:
    if _missing(lo) or _missing(hi):
        if _missing(n) or int(n) == 0:
            return "-"
        return f"no CI ({int(n)} {unit})" if int(n) == 1 else "-"
    return f"{fnum(lo, digits)} to {fnum(hi, digits)}"


def fpm(mean: Any, lo: Any, hi: Any, digits: int = 2) -> str:
    """'3.41 ± 0.12' (symmetric t-interval half width), or '3.41 (no CI)' from a single value."""
    if _missing(mean):
        return "-"
    if _missing(lo) or _missing(hi):
        return f"{fnum(mean, digits)} (no CI)"
    return f"{fnum(mean, digits)} ± {fnum((float(hi) - float(lo)) / 2, digits)}"


def fp(p: Any) -> str:
    if _missing(p):
        return "-"
    return stats.fmt_p(float(p)).replace("p = ", "").replace("p ", "")


def cell(x: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return " ".join(str(x).split()).replace("|", "\\|")


def md_table(headers: list[str], rows: Iterable[Iterable[Any]], right: Iterable[int] = ()) -> list[str]:
    r = set(right)
    out = ["| " + " | ".join(cell(h) for h in headers) + " |",
           "|" + "|".join("---:" if i in r else "---" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out


def _bytes_unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 2**30 else (2**20, "MiB")


def _time_unit(max_s: float) -> tuple[float, str]:
    if max_s >= 2 * 3600:
        return 3600.0, "h"
    if max_s >= 120:
        return 60.0, "min"
    return 1.0, "s"


def _tokens(x: Any) -> str:
    if _missing(x):
        return "-"
    x = float(x)
    if x >= 1e9:
        return f"{x / 1e9:.2f} B"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


# ======================================================================================================================
# Figures (matplotlib Figure objects, no pyplot state; seaborn styles applied per figure)


def _style():
    import seaborn as sns

    from contextlib import ExitStack

    stack = ExitStack()
    stack.enter_context(sns.axes_style("whitegrid"))
    stack.enter_context(sns.plotting_context("paper", font_scale=1.35))
    import matplotlib

    stack.enter_context(matplotlib.rc_context({"font.family": "DejaVu Sans", "svg.hashsalt": "benchctl",
                                               "axes.titleweight": "bold"}))
    return stack


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=FIG_DPI, layout="constrained")


def _bar_width(n: int) -> float:
    return max(5.5, 1.3 * n + 2.5)


def _tick(model: str) -> str:
    """A model name for an axis tick: a variant's overrides go on wrapped lines under the architecture."""
    import textwrap

    if " [" not in model:
        return model
    arch, rest = model.split(" [", 1)
    return arch + "\n" + textwrap.fill("[" + rest, 22)


def _x_labels(ax, models: list[str]) -> None:
    ax.set_xticks(range(len(models)))
    ticks = [_tick(m) for m in models]
    crowded = len(models) > 7
    ax.set_xticklabels(ticks, rotation=25 if crowded else 0, ha="right" if crowded else "center",
                       fontsize=9 if any("\n" in t for t in ticks) or crowded else None)


def fig_cost_bars(ctx: Context, cost: pd.DataFrame, what: str) -> Any:
    """Figures 1–2 of the study: training time or peak memory per model; bar = mean, one dot per seed, labelled
    with the mean and its ratio to the control."""
    q = "time" if what == "time" else "mem"
    df = cost[cost[f"{q}_mean"].notna()]
    if df.empty:
        return None
    models = list(df["model"])
    if q == "time":
        scale, unit = _time_unit(float(df["time_mean"].max()))
        col = "train_seconds"
        ylabel = f"training time ({unit})"
        title = "Training time per model"
    else:
        scale, unit = _bytes_unit(float(df["mem_mean"].max()))
        gpu = df["memory_kind"].iloc[0] == "gpu"
        col = "peak_gpu_mem_bytes" if gpu else "peak_rss_bytes"
        ylabel = f"{'peak GPU memory allocated' if gpu else 'peak process RSS'} ({unit})"
        title = "Peak GPU memory per model" if gpu else "Peak memory per model (process RSS, no GPU)"
    with _style():
        fig = _figure(_bar_width(len(models)), 4.6)
        ax = fig.add_subplot()
        for i, row in enumerate(df.itertuples()):
            m = row.model
            mean = getattr(row, f"{q}_mean") / scale
            ax.bar(i, mean, width=0.65, color=ctx.colours[m], edgecolor="black", linewidth=0.6, zorder=2)
            seeds = _vals(ctx.done[ctx.done["model"] == m], col)
            if len(seeds) > 1:
                offs = np.linspace(-0.18, 0.18, len(seeds))
                ax.scatter(i + offs, np.array(seeds) / scale, s=18, color="white", edgecolor="black",
                           linewidth=0.8, zorder=4)
            ratio = getattr(row, f"{q}_ratio")
            top = max([mean] + [v / scale for v in seeds])
            label = f"{mean:.{1 if mean < 100 else 0}f} {unit}"
            if not _missing(ratio) and m != CONTROL:
                label += f"\n{ratio:.2f}× control"
            ax.annotate(label, (i, top), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                        fontsize=9)
        _x_labels(ax, models)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("model")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.18)
        _title(ax, title, [_hardware_line(ctx), f"preset {ctx.preset} · {_seed_line(df)}"])
        ax.grid(axis="x", visible=False)
    return fig


def _title(ax: Any, main: str, lines: list[str]) -> None:
    """A bold figure title and smaller explanatory lines above the axes, wrapped to the axes' width."""
    import textwrap

    width_in = ax.figure.get_size_inches()[0]
    chars = max(40, int(width_in * 14))
    ax.figure.suptitle(main, fontsize=12.5, fontweight="bold")
    ax.set_title("\n".join(textwrap.fill(line, chars) for line in lines if line), fontsize=9.5, color="#333333",
                 fontweight="normal")


def _seed_line(df: pd.DataFrame) -> str:
    n = sorted({int(v) for v in df["seeds"]})
    s = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    return f"{s} seed{'s' if n[-1] != 1 else ''} per model, bar = mean" + (", dots = seeds" if n[-1] > 1 else "")


def _hardware_line(ctx: Context) -> str:
    d = ctx.done
    if d.empty:
        return "hardware unknown"
    pairs = sorted({(str(a or "?"), str(b or "?")) for a, b in zip(d["device"], d["device_name"])})
    return "; ".join(f"{name} ({dev})" for dev, name in pairs)


def fig_loss_curves(ctx: Context, curves: pd.DataFrame) -> Any:
    """Figure 3 of the study: validation loss against tokens; mean over seeds, band = min–max over seeds;
    right panel zooms into the second half of training, where the models differ."""
    if curves.empty:
        return None
    models = [m for m in ctx.models if m in set(curves["model"])]
    xmax = float(curves["tokens"].max())
    scale, unit = (1e9, "B") if xmax >= 1e9 else (1e6, "M") if xmax >= 1e6 else (1e3, "k")
    with _style():
        fig = _figure(11.0, 5.2)
        axes = fig.subplots(1, 2)
        half = xmax / 2
        for ax, zoom in zip(axes, (False, True)):
            ymin, ymax = math.inf, -math.inf
            for m in models:
                c = curves[curves["model"] == m]
                if zoom:
                    c = c[c["tokens"] >= half]
                if c.empty:
                    continue
                x = c["tokens"].to_numpy(float) / scale
                ax.plot(x, c["mean"], color=ctx.colours[m], linewidth=1.8, label=m, marker="o" if len(c) < 12 else None,
                        markersize=3.5)
                if (c["n"] > 1).any():
                    ax.fill_between(x, c["min"], c["max"], color=ctx.colours[m], alpha=0.2, linewidth=0)
                ymin, ymax = min(ymin, float(c["min"].min())), max(ymax, float(c["max"].max()))
            ax.set_xlabel(f"tokens seen ({unit})")
            ax.set_ylabel("validation loss (nats/token)")
            if zoom and math.isfinite(ymin):
                pad = max((ymax - ymin) * 0.08, 1e-3)
                ax.set_ylim(ymin - pad, ymax + pad)
            ax.set_title("second half of training" if zoom else "whole run", fontsize=11)
        handles, labels = axes[0].get_legend_handles_labels()
        n = int(curves["n"].max())
        band = "band = min–max over seeds" if n > 1 else "one seed per model: no band"
        fig.legend(handles, [_tick(lab) for lab in labels], title=f"model (line = mean over seeds, {band})",
                   frameon=True, fontsize=9, title_fontsize=9.5, loc="outside lower center",
                   ncols=min(len(labels), 6))  # outside the axes: never covers a curve
        fig.suptitle(f"Validation loss during training · preset {ctx.preset}", fontsize=12.5, fontweight="bold")
    return fig


def fig_final_loss(ctx: Context, loss: pd.DataFrame) -> Any:
    """Final validation loss per model: one dot per seed, mean with 95% CI."""
    df = loss[loss["final_mean"].notna()]
    if df.empty:
        return None
    models = list(df["model"])
    with _style():
        fig = _figure(_bar_width(len(models)), 4.6)
        ax = fig.add_subplot()
        for i, row in enumerate(df.itertuples()):
            seeds = _vals(ctx.done[ctx.done["model"] == row.model], "final_val_loss")
            offs = np.linspace(-0.12, 0.12, len(seeds)) if len(seeds) > 1 else np.zeros(1)
            ax.scatter(i + offs, seeds, s=22, color=ctx.colours[row.model], edgecolor="black", linewidth=0.6,
                       alpha=0.8, zorder=3, label="seed" if i == 0 else None)
            if not _missing(row.final_lo):
                ax.errorbar(i + 0.28, row.final_mean, yerr=[[row.final_mean - row.final_lo],
                                                            [row.final_hi - row.final_mean]],
                            fmt="D", color="black", markersize=5, capsize=5, zorder=4,
                            label="mean ± 95% CI" if i == 0 else None)
            else:
                ax.plot(i + 0.28, row.final_mean, "D", color="black", markersize=5, zorder=4,
                        label="mean (no CI)" if i == 0 else None)
            if ctx.is_paper and row.study_final is not None:
                ax.plot(i - 0.3, row.study_final, marker="*", color="#C00000", markersize=11, linestyle="none",
                        zorder=4, label="study" if i == 0 else None)
        _x_labels(ax, models)
        ax.set_xlim(-0.6, len(models) - 0.4)
        ax.margins(y=0.15)  # room above the highest point for the legend
        ax.set_xlabel("model")
        ax.set_ylabel("final validation loss (nats/token)")
        ax.legend(fontsize=9, frameon=True, loc="best")
        _title(ax, "Final validation loss per model",
               [f"preset {ctx.preset} · {_tokens(df['tokens'].max())} tokens per run · dots = seeds, "
                + ("diamond = mean ± 95% CI" if df["final_n"].max() > 1 else "diamond = mean (one seed: no CI)")])
        ax.grid(axis="x", visible=False)
    return fig


def fig_judge(ctx: Context, jg: JudgeGroup) -> Any:
    """Table 4 of the study as a figure: mean grade per criterion and model, 95% CI over graded samples."""
    t = jg.table[jg.table["average_n"] > 0]
    if t.empty:
        return None
    models = list(t["model"])
    k = len(models)
    width = 0.8 / k
    with _style():
        fig = _figure(max(8.5, 0.9 * len(JUDGE_COLUMNS) + 0.45 * k + 3.0), 4.6)
        ax = fig.add_subplot()
        for j, row in enumerate(t.itertuples()):
            x = np.arange(len(JUDGE_COLUMNS)) + (j - (k - 1) / 2) * width
            means = np.array([getattr(row, f"{c}_mean") for c in JUDGE_COLUMNS], dtype=float)
            los = np.array([_nan(getattr(row, f"{c}_lo")) for c in JUDGE_COLUMNS])
            his = np.array([_nan(getattr(row, f"{c}_hi")) for c in JUDGE_COLUMNS])
            ax.bar(x, means, width=width * 0.95, color=ctx.colours[row.model], edgecolor="black", linewidth=0.5,
                   label=f"{row.model} ({row.average_n})", zorder=2)
            ok = ~np.isnan(los)
            if ok.any():
                ax.errorbar(x[ok], means[ok], yerr=[means[ok] - los[ok], his[ok] - means[ok]], fmt="none",
                            color="black", capsize=3, linewidth=1, zorder=3)
        ax.set_xticks(range(len(JUDGE_COLUMNS)))
        ax.set_xticklabels([c if c != "average" else "average" for c in JUDGE_COLUMNS])
        ax.set_ylabel("judge grade (1–10)")
        ax.set_xlabel("criterion")
        top = max(float(v) for r in t.itertuples() for c in JUDGE_COLUMNS
                  for v in (getattr(r, f"{c}_hi"), getattr(r, f"{c}_mean")) if not _missing(v))
        ax.set_ylim(0, min(10.0, math.ceil(top) + 1.0))  # bars start at 0; the top follows the data (scale 1–10)
        ax.legend(fontsize=9, frameon=True, title="model (n = graded samples)", title_fontsize=9,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0))
        _title(ax, "Judge grades per criterion",
               [f"judge {jg.judge_model} · preset {ctx.preset} · bar = mean over graded samples, error bar = 95% CI"])
        ax.grid(axis="x", visible=False)
    return fig


def _nan(x: Any) -> float:
    return math.nan if _missing(x) else float(x)


# ======================================================================================================================
# Markdown sections


@dataclass
class Rendered:
    markdown: str
    figures: dict[str, Any]  # file name -> matplotlib Figure
    preset: str | None
    other_presets: list[tuple[str, int, int]]


def _need(what: str) -> list[str]:
    return [what, ""]


def _sec_header(ctx: Context, data: Data) -> list[str]:
    title = f"# benchctl report: preset `{ctx.preset}`" if ctx.preset else "# benchctl report"
    out = [title, ""]
    out.append("Every number below is computed from results.db by `benchctl report`; only runs with status `done` "
               "enter the statistics. 95% CIs are t-intervals over seeds unless a table says otherwise.")
    out.append("")
    if ctx.preset is None:
        out += _need("The database has no runs yet: `benchctl train-all --preset tiny` (or `benchctl study`) "
                     "produces them.")
        return out
    st = ctx.runs["status"].value_counts()
    counts = ", ".join(f"{int(st[s])} {s}" for s in sorted(st.index, key=_status_rank))
    out.append(f"Runs of preset `{ctx.preset}`: {counts or 'none'}.")
    if ctx.other_presets:
        others = "; ".join(f"`{p}` ({d} done of {n})" for p, d, n in ctx.other_presets)
        out.append(f"Other presets in the database: {others}. Report one with `benchctl report --preset NAME`.")
    out.append("")
    return out


def _status_rank(s: str) -> tuple[int, str]:
    order = ["done", "running", "pending", "failed"]
    return (order.index(s), s) if s in order else (len(order), s)


def _sec_runs(ctx: Context) -> list[str]:
    out = ["## Runs", ""]
    if ctx.runs.empty:
        return out + _need("No runs for this preset: `benchctl train-all` produces them.")
    sf = status_frame(ctx)
    show_other = bool(sf["other"].sum())
    headers = ["model", "done", "running", "pending", "failed"] + (["other"] if show_other else []) + ["seeds done"]
    rows = [[r.model, r.done, r.running, r.pending, r.failed] + ([r.other] if show_other else [])
            + [", ".join(map(str, r.seeds_done)) or "-"] for r in sf.itertuples()]
    out += md_table(headers, rows, right=range(1, len(headers) - 1)) + [""]
    variants = [m for m in ctx.models if ctx.overrides.get(m)]
    if variants:
        out.append("Config overrides against the preset's defaults (runs with different configs are different "
                   "models, never pooled as seeds):")
        out.append("")
        out += [f"- {m}: `{ctx.overrides[m]}`" for m in variants] + [""]
    bad = ctx.runs[ctx.runs["status"] != "done"]
    if not bad.empty:
        out.append("Runs not in the statistics:")
        out.append("")
        rows = []
        for r in bad.sort_values(["status", "model", "seed", "id"]).itertuples():
            err = "" if _missing(r.error) else str(r.error)
            rows.append([r.id, r.model, r.seed, r.status, fint(r.step) + " / " + fint(r.max_steps),
                         (err[:160] + "…") if len(err) > 160 else (err or "-")])
        out += md_table(["run", "model", "seed", "status", "step", "error"], rows, right=[2]) + [""]
    return out


def _sec_models(ctx: Context) -> list[str]:
    from benchctl.accounting import component_names

    out = ["## Models", ""]
    if ctx.runs.empty:
        out += _need("No runs for this preset: `benchctl train-all` produces them "
                     "(`benchctl params` shows the accounting without training).")
    else:
        acc = accounting_frame(ctx)
        names = {"embedding": "embedding", "blocks": "blocks", "depth_encoding": "depth enc.", "adapter": "adapter",
                 "recurrent_norm": "rec. norm", "lora": "LoRA", "final_norm": "final norm"}
        comps = [c for c in component_names(acc.to_dict("records")) if acc[c].fillna(0).astype(float).any()]
        headers = ["model"] + [names.get(c, c) for c in comps] + ["unique total", "effective", "depth", "MFLOP/token"]
        if ctx.is_paper:
            headers += ["study total", "match"]
        rows = []
        for r in acc.to_dict("records"):
            row = [r["model"]] + [fint(r[c]) for c in comps]
            row += [fint(r["total_params"]), fint(r["effective_params"]), fint(r["effective_depth"]),
                    fnum(None if _missing(r["flops_per_token"]) else r["flops_per_token"] / 1e6, 2)]
            if ctx.is_paper:
                study = paper.TOTAL_PARAMS.get(r["arch"]) if r["model"] == r["arch"] else None
                row += [fint(study), "-" if study is None else ("yes" if study == r["total_params"] else "NO")]
            rows.append(row)
        out += md_table(headers, rows, right=range(1, len(headers) - (2 if ctx.is_paper else 0))) + [""]
        out.append("unique total = trainable parameters, the tied embedding counted once; effective = parameters "
                   "applied per token with the recurrence unrolled; depth = block applications per token; "
                   "MFLOP/token = training FLOPs per token (forward + backward, attention and recurrence included).")
        out.append("")
        mism = [(r["model"], r["recorded_n_params"], r["total_params"]) for r in acc.to_dict("records")
                if r["recorded_n_params"] and r["recorded_n_params"] != [r["total_params"]]]
        for m, rec, tot in mism:
            out.append(f"Warning: the runs table records {', '.join(f'{v:,}' for v in rec)} parameters for {m}, "
                       f"the accounting gives {fint(tot)}.")
        if mism:
            out.append("")
        if any(r["source"] != "config" for r in acc.to_dict("records")):
            out.append("Rows without components come from the runs table (their config could not be rebuilt by "
                       "this benchctl version).")
            out.append("")
    if not ctx.is_paper:
        pa = paper_accounting_frame()
        out.append("The study's published totals, at the paper preset (benchctl's accounting of the same configs "
                   "beside them; `benchctl params --preset paper`):")
        out.append("")
        rows = [[r["arch"], fint(r["total_params"]), fint(r["paper_total_params"]),
                 "yes" if r["matches_paper"] else "NO"] for r in pa.to_dict("records")]
        out += md_table(["model", "ours (paper preset)", "study", "match"], rows, right=[1, 2]) + [""]
    out.append("Rows of the study that are inconsistent with its own totals or tables (shown, never silently "
               "corrected):")
    out.append("")
    out += md_table(["study row", "study", "ours", "why"],
                    [[f["what"], f["study"], f["ours"], f["why"]] for f in paper.FLAGS]) + [""]
    return out


def _sec_cost(ctx: Context, figs: dict[str, Any]) -> list[str]:
    out = ["## Training cost", ""]
    cost = cost_frame(ctx)
    if cost.empty:
        return out + _need("No finished runs: `benchctl train-all` records training time and peak memory.")
    devices = sorted({str(x) for x in ctx.done["device_name"].dropna()})
    out.append(f"Hardware: {_hardware_line(ctx)}; torch "
               f"{', '.join(sorted({str(x) for x in ctx.done['torch_version'].dropna()})) or 'unknown'}.")
    if len(devices) > 1:
        out.append("Warning: these runs were made on different devices, so time and memory ratios mix hardware.")
    out.append("")
    tmax = cost["time_mean"].dropna()
    tscale, tunit = _time_unit(float(tmax.max()) if not tmax.empty else 0.0)
    mmax = cost["mem_mean"].dropna()
    mscale, munit = _bytes_unit(float(mmax.max()) if not mmax.empty else 0.0)
    gpu = cost["memory_kind"].iloc[0] == "gpu"
    mem_name = "peak GPU memory (torch allocated)" if gpu else "peak RSS"
    headers = ["model", "seeds", f"training time ({tunit})", "range over seeds", "× control", "tokens/s",
               "step (ms)", f"{mem_name} ({munit})", "× control"]
    if gpu:
        headers += [f"torch reserved ({munit})", f"NVML device ({munit})"]
    rows = []
    for r in cost.to_dict("records"):
        row = [r["model"], r["seeds"], fnum(_scaled(r["time_mean"], tscale), 2),
               _range(r["time_min"], r["time_max"], r["time_n"], tscale),
               fnum(r["time_ratio"], 2), fnum(r["tokens_per_s"], 0), fnum(_scaled(r["step_seconds"], 1e-3), 1),
               fnum(_scaled(r["mem_mean"], mscale), 2), fnum(r["mem_ratio"], 2)]
        if gpu:
            row += [fnum(_scaled(r["reserved"], mscale), 2), fnum(_scaled(r["nvml"], mscale), 2)]
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    out.append("Training time counts optimizer steps only (no warm-up/compile, evaluation or checkpoints); "
               "mean and range (fastest to slowest) over seeds; step = median optimizer-step time; "
               "× control = ratio of means to the control"
               + ("" if (cost["model"] == CONTROL).any() else " (no control runs, so no ratios)") + ". "
               + ("Memory is torch's peak allocated GPU memory." if gpu else
                  "No GPU memory was recorded (CPU runs), so memory is the process's peak resident set size, "
                  "which includes the Python interpreter and libraries."))
    out.append("")
    out.append(f"The study ({paper.HARDWARE}, paper preset): {paper.COST_NOTES}")
    out.append("")
    for name, what, alt in (("training_time.png", "time", "Training time per model"),
                            ("peak_memory.png", "memory", "Peak memory per model")):
        f = fig_cost_bars(ctx, cost, what)
        if f is not None:
            figs[name] = f
            out += [f"![{alt}](figures/{name})", ""]
    return out


def _range(lo: Any, hi: Any, n: Any, scale: float) -> str:
    if _missing(n) or int(n) == 0:
        return "-"
    if int(n) == 1:
        return "one seed"
    return f"{fnum(float(lo) / scale, 2)} to {fnum(float(hi) / scale, 2)}"


def _scaled(x: Any, scale: float) -> float | None:
    return None if _missing(x) else float(x) / scale


def _sec_loss(ctx: Context, data: Data, figs: dict[str, Any]) -> list[str]:
    out = ["## Loss", ""]
    loss = loss_frame(ctx)
    if loss.empty:
        return out + _need("No finished runs: `benchctl train-all` records initial and final validation loss.")
    headers = ["model", "seeds", "tokens/run", "initial val loss", "95% CI", "final val loss", "95% CI"]
    if ctx.is_paper:
        headers += ["study initial", "study final"]
    rows = []
    for r in loss.to_dict("records"):
        row = [r["model"], r["seeds"], _tokens(r["tokens"]), fnum(r["initial_mean"]),
               fci(r["initial_lo"], r["initial_hi"], r["initial_n"]), fnum(r["final_mean"]),
               fci(r["final_lo"], r["final_hi"], r["final_n"])]
        if ctx.is_paper:
            flag = " (Table 5: 1.492)" if r["model"] == CONTROL and r["study_final"] is not None else ""
            row += [fnum(r["study_initial"]), fnum(r["study_final"]) + flag]
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    vocab = sorted({_model_keys(c).get("model.vocab_size") for c in ctx.done["config_json"]} - {None})
    if len(vocab) == 1:
        out.append(f"A uniform guess over the {vocab[0]:,}-token vocabulary scores ln {vocab[0]:,} = "
                   f"{math.log(vocab[0]):.3f}.")
    if any(r["seeds"] == 1 for r in loss.to_dict("records")):
        out.append("A model with one seed has no confidence interval: its run-to-run spread is unknown.")
    if ctx.is_paper:
        out.append("The study's control final loss is 1.429 in its Table 3 and 1.492 in its Table 5; Table 3's "
                   "value is shown.")
    else:
        ref = ", ".join(f"{a} {paper.FINAL_LOSS[a]:.3f}" for a in _study_order(paper.FINAL_LOSS))
        out.append(f"The study (paper preset, {paper.TOKENS_PER_MODEL / 1e6:.1f} M tokens per model) reported final "
                   f"validation losses {ref}; they are not comparable with this preset.")
    out.append("")
    curves = curve_frame(ctx, data.metrics)
    for name, f, alt in (("final_val_loss.png", fig_final_loss(ctx, loss), "Final validation loss per model"),
                         ("val_loss_curves.png", fig_loss_curves(ctx, curves), "Validation loss against tokens")):
        if f is not None:
            figs[name] = f
            out += [f"![{alt}](figures/{name})", ""]
    if curves.empty:
        out += _need("No validation-loss curves in the metrics table: `benchctl train` writes them.")
    return out


def _sec_judge(ctx: Context, groups: list[JudgeGroup], figs: dict[str, Any]) -> list[str]:
    out = ["## Judge", ""]
    if not groups:
        return out + _need("No judge grades: `benchctl sample` then `benchctl judge --model gemini-2.5-flash` "
                           "(needs GEMINI_API_KEY) produce them.")
    for gi, jg in enumerate(groups):
        settings = ", ".join(f"{k}={'-' if v is None else v}" for k, v in jg.settings.items())
        primary = " (primary: used in Comparisons)" if gi == 0 and len(groups) > 1 else ""
        out.append(f"### {jg.judge_model} · prompt {jg.prompt_hash[:12]}{primary}")
        out.append("")
        out.append(f"Judge model `{jg.judge_model}`, grading prompt hash `{jg.prompt_hash}`, sampling {settings}.")
        out.append("")
        headers = ["model", "samples", "graded", "failed"] + list(JUDGE_COLUMNS)
        rows = [[r["model"], r["samples"], r["graded"], r["failed"]]
                + [fpm(r[f"{c}_mean"], r[f"{c}_lo"], r[f"{c}_hi"]) for c in JUDGE_COLUMNS]
                for r in jg.table.to_dict("records")]
        out += md_table(headers, rows, right=range(1, len(headers))) + [""]
        out.append("Grades 1–10; mean ± 95% CI half-width (t-interval over graded samples, i.e. prompts × seeds, "
                   "each sample's repeats averaged first). failed = grade requests stored as failures "
                   "(unparseable, truncated, blocked or out of range), never counted as scores.")
        out.append("")
        if gi == 0:
            f = fig_judge(ctx, jg)
            if f is not None:
                figs["judge_grades.png"] = f
                out += ["![Judge grades per criterion](figures/judge_grades.png)", ""]
    out.append(f"The study's grades ({paper.JUDGE_MODEL}, paper preset, one run per model, no CI):")
    out.append("")
    rows = [[a] + [fnum(paper.JUDGE[a][c], 2) for c in JUDGE_COLUMNS] for a in _study_order(paper.JUDGE)]
    out += md_table(["model"] + list(JUDGE_COLUMNS), rows, right=range(1, 6)) + [""]
    return out


def _study_order(d: dict[str, Any]) -> list[str]:
    """The study's architectures in the report's fixed order."""
    return sorted(d, key=_arch_rank)


def _sec_eval(ctx: Context, data: Data) -> list[str]:
    out = ["## lm-eval", ""]
    ev = eval_frame(ctx, data.evals)
    if ev.empty:
        return out + _need("No lm-eval results: `benchctl eval` produces them.")
    metrics = sorted({(t, m) for t, m in zip(ev["task"], ev["metric"])})
    keys = []
    for r in ev.itertuples():
        k = (r.model, r.n_recur, r.limit_n)
        if k not in keys:
            keys.append(k)
    headers = ["model", "n_recur", "limit", "seeds"] + [f"{t} {m}" for t, m in metrics]
    rows = []
    for m, r, lim in keys:
        g = ev[(ev["model"] == m) & (ev["n_recur"] == r) & (ev["limit_n"] == lim)]
        trained = g["trained_n_recur"].iloc[0]
        row = [m, f"{r}" + ("" if _missing(trained) or int(trained) == r else f" (trained {int(trained)})"),
               "all" if lim == 0 else f"{lim:,}", int(g["seeds"].max())]
        for t, met in metrics:
            c = g[(g["task"] == t) & (g["metric"] == met)]
            if c.empty:
                row.append("-")
            else:
                v, se = c["value"].iloc[0], c["stderr"].iloc[0]
                row.append(fnum(v, 4) + ("" if _missing(se) else f" ± {fnum(se, 4)}"))
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    out.append("value = mean over seeds; ± = lm-eval's standard error of one run (averaged over seeds when there "
               "are several); limit = documents per task (all = the full task).")
    out.append("")
    return out


def _sec_comparisons(ctx: Context, primary: JudgeGroup | None) -> list[str]:
    out = ["## Comparisons", ""]
    if len(ctx.done_models) < 2:
        return out + _need("Needs finished runs of at least two models: `benchctl train-all` produces them.")
    cmp = comparison_frame(ctx, primary)
    headers = ["a", "b", "quantity", "test", "n (a, b)", "a − b", "95% CI", "p", "p (Holm)"]
    rows = []
    for r in cmp.to_dict("records"):
        digits = 3 if r["quantity"] == "final validation loss" else 2
        test = "Welch t over seeds" if r["method"] == "welch" else f"paired bootstrap over prompts (B={N_BOOT:,})"
        n = f"{r['n_a']}, {r['n_b']}" if r["method"] == "welch" else f"{r['n_a']} shared"
        ci = "-" if _missing(r["lo"]) else f"{fnum(r['lo'], digits)} to {fnum(r['hi'], digits)}"
        rows.append([r["a"], r["b"], r["quantity"], test, n, fnum(r["diff"], digits), ci, fp(r["p"]),
                     fp(r["p_holm"])])
    out += md_table(headers, rows, right=range(4, len(headers))) + [""]
    out += [f"- {v}" for v in cmp["verdict"]] + [""]
    out.append("a − b: negative means a has the lower value (lower loss is better; a higher judge grade is better). "
               "Loss: Welch's t-test over seeds (final validation loss of each done run). Judge: paired bootstrap "
               "over the prompts both models were graded on, each prompt's score averaged over seeds and repeats; "
               "percentile CI; p from the bootstrap distribution shifted to no difference. The judge bootstrap "
               "resamples prompts, not seeds: it says whether these trained models differ, and with few seeds it cannot "
               "separate the architecture from the initialization. p (Holm) adjusts each quantity's family of "
               "comparisons for multiple testing.")
    out.append("")
    if primary is None:
        out += _need("Judge comparisons need grades: `benchctl sample` then `benchctl judge`.")
    return out


def _sec_bench(ctx: Context, data: Data) -> list[str]:
    out = ["## Benchmark", ""]
    b, earlier = bench_frame(ctx, data.bench)
    if b.empty:
        return out + _need("No benchmark rows for this preset: `benchctl bench` produces them.")
    out.append(f"`benchctl bench` invocation `{b['bench_id'].iloc[0]}` ({_date(b['created_at'].max())}"
               + (f"; {earlier} earlier invocation{'s' if earlier != 1 else ''} not shown" if earlier else "") + ").")
    out.append("")
    headers = ["arch", "impl", "compiled", "device", "tokens/s", "range", "step (ms)", "MFLOP/token", "MFU",
               "peak FLOP/s source", "peak memory (MiB)", "cost ratio"]
    ref = b[(b["arch"] == CONTROL) & (b["impl"] == "reference")]
    ours = b[(b["arch"] == CONTROL) & (b["impl"] == "benchctl")]
    ctrl = ours.to_dict("records")[0] if not ours.empty else None
    rows = []
    for r in b.to_dict("records"):
        cost = "-"
        if ctrl is not None and r["impl"] == "benchctl" and r["compiled"] == ctrl["compiled"]:
            # time per token over the control's, divided by FLOPs per token over the control's (1 = pure arithmetic)
            cost = fnum((float(ctrl["tokens_per_s"]) / float(r["tokens_per_s"]))
                        / (float(r["flops_per_token"]) / float(ctrl["flops_per_token"])), 2)
        rows.append([r["arch"], r["impl"], "yes" if _py(r["compiled"]) else "no", r["device_name"] or r["device"],
                     fnum(r["tokens_per_s"], 0), f"{fnum(r['tokens_per_s_min'], 0)}–{fnum(r['tokens_per_s_max'], 0)}",
                     fnum(_scaled(r["step_seconds"], 1e-3), 1), fnum(_scaled(r["flops_per_token"], 1e6), 2),
                     "-" if _missing(r["mfu"]) else f"{100 * float(r['mfu']):.1f}%",
                     r["peak_flops_source"] if not _missing(r["peak_flops_source"]) else "-",
                     fnum(_scaled(r["peak_mem_bytes"], 2**20), 1), cost])
    out += md_table(headers, rows, right=[4, 5, 6, 7, 8, 10, 11]) + [""]
    if not ref.empty and ctrl is not None:
        ref_row = ref.to_dict("records")[0]
        ratio = float(ctrl["tokens_per_s"]) / float(ref_row["tokens_per_s"])
        out.append(f"benchctl's control step runs at {ratio:.2f}× the eager reference's tokens/s, measured side by "
                   "side in the same invocation.")
        kernel = ctrl.get("kernel_seconds")
        if not _missing(kernel) and float(kernel) > 0:
            out.append(f"Its step spends {fnum(kernel, 2)} s in matmul and attention kernels (best profiled step), so "
                       f"even with everything else free it could run at most "
                       f"{float(ref_row['step_seconds']) / float(kernel):.2f}× the reference on this machine.")
        out.append("")
    out.append("Cost ratio: an architecture's time per token over the control's, divided by its FLOPs per token over "
               "the control's (1.00 = its recurrence costs exactly its arithmetic). "
               "MFU is empty when the device's peak FLOP/s is unknown (never a guessed peak).")
    out.append("")
    return out


def _date(x: Any) -> str:
    return "-" if _missing(x) else str(x)


def _counts(values: Iterable[Any], missing: str = "not recorded") -> str:
    c: dict[str, int] = {}
    for v in values:
        k = missing if _missing(v) or v == "" else str(v)
        c[k] = c.get(k, 0) + 1
    return ", ".join(f"{k} ({n} run{'s' if n != 1 else ''})" for k, n in sorted(c.items())) or "-"


def _sec_provenance(ctx: Context, data: Data, groups: list[JudgeGroup]) -> list[str]:
    out = ["## Provenance", ""]
    if ctx.runs.empty:
        return out + _need("No runs: `benchctl train-all` records versions, commits, data and devices.")
    r = ctx.runs
    items = [
        ("benchctl version", _counts(r["benchctl_version"])),
        ("git commit", _counts(r["git_commit"])),
        ("preset", f"{ctx.preset}" + (f" (others in the database: {', '.join(p for p, _, _ in ctx.other_presets)})"
                                       if ctx.other_presets else "")),
        ("data source", _counts(r["data_source"])),
        ("data fingerprint", _counts(r["data_fingerprint"])),
        ("device", _counts(f"{a} / {b}" if not _missing(b) else a for a, b in zip(r["device"], r["device_name"]))),
        ("torch", _counts(r["torch_version"])),
        ("CUDA", _counts(r["cuda_version"], missing="none")),
        ("driver", _counts(r["driver_version"], missing="none")),
        ("python", _counts(r["python_version"])),
        ("first run created", _date(_min_str(r["created_at"]))),
        ("last run finished", _date(_max_str(r["finished_at"]))),
    ]
    if groups:
        items.append(("judge", "; ".join(f"{g.judge_model} / prompt {g.prompt_hash} ({g.n_ok} ok grades)"
                                         for g in groups)))
    ev = data.evals[data.evals["run_id"].isin(ctx.done["id"])]
    if not ev.empty:
        items.append(("lm-eval", _counts(ev.drop_duplicates(["run_id", "lm_eval_version"])["lm_eval_version"])))
    out += md_table(["what", "value"], items) + [""]
    return out


def _min_str(s: pd.Series) -> Any:
    v = sorted(str(x) for x in s.dropna())
    return v[0] if v else None


def _max_str(s: pd.Series) -> Any:
    v = sorted(str(x) for x in s.dropna())
    return v[-1] if v else None


def render(data: Data, preset: str | None = None) -> Rendered:
    """The whole report as markdown plus figures, from loaded tables. Pure: the same data gives the same output."""
    ctx = build_context(data.runs, preset)
    figs: dict[str, Any] = {}
    groups = judge_groups(ctx, data.samples, data.grades)
    primary = groups[0] if groups else None
    lines: list[str] = []
    lines += _sec_header(ctx, data)
    lines += _sec_runs(ctx)
    lines += _sec_models(ctx)
    lines += _sec_cost(ctx, figs)
    lines += _sec_loss(ctx, data, figs)
    lines += _sec_judge(ctx, groups, figs)
    lines += _sec_eval(ctx, data)
    lines += _sec_comparisons(ctx, primary)
    lines += _sec_bench(ctx, data)
    lines += _sec_provenance(ctx, data, groups)
    while lines and lines[-1] == "":
        lines.pop()
    return Rendered("\n".join(lines) + "\n", figs, ctx.preset, ctx.other_presets)


FIGURE_NAMES = ("training_time.png", "peak_memory.png", "final_val_loss.png", "val_loss_curves.png",
                "judge_grades.png")


def save_figure(fig: Any, path: Path) -> None:
    """PNG without a timestamp or software tag, so the same data gives the same file."""
    fig.savefig(path, dpi=FIG_DPI, metadata={"Software": None})


def build(db: str | os.PathLike | sqlite3.Connection | Any, preset: str | None = None) -> Rendered:
    """Read results.db (a path, opened read-only, or an open connection) and render the report in memory."""
    conn = getattr(db, "conn", db)  # a sqlite_utils.Database wraps its sqlite3 connection
    if isinstance(conn, sqlite3.Connection):
        return render(load(conn), preset)
    conn = open_db(db)
    try:
        data = load(conn)
    finally:
        conn.close()
    return render(data, preset)


def save(rendered: Rendered, out_dir: str | os.PathLike) -> Path:
    """Write out_dir/report.md and out_dir/figures/*.png; figures of sections without data any more are removed."""
    out = Path(out_dir)
    figdir = out / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    for name in FIGURE_NAMES:
        if name not in rendered.figures and (figdir / name).exists():
            (figdir / name).unlink()  # a stale figure from an earlier report would contradict this one
    for name, fig in sorted(rendered.figures.items()):
        save_figure(fig, figdir / name)
    path = out / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(rendered.markdown, encoding="utf-8")
    tmp.replace(path)
    return path


def write_report(db: str | os.PathLike | sqlite3.Connection | Any, out_dir: str | os.PathLike,
                 preset: str | None = None) -> Path:
    """results.db -> out_dir/report.md (+ out_dir/figures/*.png); returns the path of report.md.

    preset=None reports the preset with most finished runs (the report names it and lists the others)."""
    return save(build(db, preset), out_dir)
