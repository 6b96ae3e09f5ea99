"""The judge's grades as the report reads them: grouped by judge model, prompt and sampling settings, one row per
model with its 95% intervals, and the per-prompt and per-seed means the comparisons and the reliability checks pair
on. Pure computations from the loaded tables (no I/O, no formatting)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from benchctl.core import stats
from benchctl.report.context import Context
from benchctl.report.fmt import py
from benchctl.report.frames import Frames, ci_cols

CRITERIA = ("grammar", "creativity", "consistency", "plot")
JUDGE_COLUMNS = CRITERIA + ("average",)
N_BOOT = 2_000  # bootstrap resamples behind the judge's agreement intervals (Krippendorff's alpha)


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
    # who graded, named fully: backend, the model as sent, the base URL's host (and path), and every revision the
    # service reported for its answers (OpenAI's system_fingerprint, Gemini's modelVersion); None: not recorded
    backend: str | None = None
    model: str | None = None
    endpoint: str | None = None
    revisions: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """judge / protocol / prompt hash: how the report names one set of grades."""
        return f"{self.judge_model} / {self.protocol} / {self.prompt_hash[:12]}"

    def identity(self) -> str:
        """The judge named fully, in words: backend, model, endpoint and the revision(s) that answered."""
        parts = [f"backend `{self.backend or 'gemini'}`", f"model `{self.model or self.judge_model}`"]
        parts.append(f"endpoint `{self.endpoint}`" if self.endpoint else "endpoint not recorded")
        term = "system_fingerprint" if self.backend == "openai" else "modelVersion"
        if self.revisions:
            shown = ", ".join(f"`{r}`" for r in self.revisions[:5])
            more = f" and {len(self.revisions) - 5} more" if len(self.revisions) > 5 else ""
            parts.append(f"{term} {shown}{more}")
        else:
            parts.append(f"{term} not reported")
        return ", ".join(parts)


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
    # judge_grades.model is the judge's model as sent; `model` here is the graded model (the runs' variant)
    g = grades.rename(columns={"model": "judge_sent_model"}).merge(
        s[["sample_id", "run_id", "prompt_id", "model", "run_seed", "n_tokens", "settings_key"]],
        on="sample_id",
        how="inner",
    )
    if g.empty:
        return []
    for c in CRITERIA + ("average",):
        g[c] = pd.to_numeric(g[c], errors="coerce")
    g["average"] = g["average"].fillna(g[list(CRITERIA)].mean(axis=1, skipna=False))
    out = [
        _judge_group(ctx, s[s["settings_key"] == sk], gg, str(jm), str(ph))
        for (jm, ph, sk), gg in g.groupby(["judge_model", "prompt_hash", "settings_key"], sort=True)
    ]
    return sorted(out, key=lambda j: (-j.n_ok, j.judge_model, j.prompt_hash, json.dumps(j.settings, sort_keys=True)))


def _judge_group(ctx: Context, ss: pd.DataFrame, gg: pd.DataFrame, jm: str, ph: str) -> JudgeGroup:
    ok = gg[gg["status"] == "ok"]
    per_sample = (
        ok.groupby(["model", "run_seed", "sample_id", "prompt_id"], sort=True)[list(JUDGE_COLUMNS)].mean().reset_index()
    )
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
            row.update(ci_cols(c, stats.mean_ci(values)))
        rows.append(row)
        per_prompt[m] = {str(k): float(v) for k, v in mps.groupby("prompt_id", sort=True)["average"].mean().items()}
        per_seed_prompt[m] = {
            (int(r.run_seed), str(r.prompt_id)): float(r.average)
            for r in mps.groupby(["run_seed", "prompt_id"], sort=True)["average"].mean().reset_index().itertuples()
        }
    first = ss.sort_values("sample_id").iloc[0] if not ss.empty else None
    settings = {} if first is None else {c: py(first[c]) for c in ("temperature", "top_k", "top_p", "max_new_tokens")}
    protocols = sorted({str(p) for p in gg["protocol"].dropna()}) if "protocol" in gg else []
    return JudgeGroup(
        jm,
        ph,
        settings,
        pd.DataFrame(rows),
        per_prompt,
        len(ok),
        protocol="/".join(protocols) or "json",
        per_seed_prompt=per_seed_prompt,
        grades=gg.reset_index(drop=True),
        backend=_one(gg, "backend"),
        model=_one(gg, "judge_sent_model"),
        endpoint=_one(gg, "endpoint"),
        revisions=_values(gg[gg["status"] == "ok"], "model_revision"),
    )


def _values(gg: pd.DataFrame, col: str) -> list[str]:
    """The distinct values of a column, sorted; [] when it is absent or empty."""
    return sorted({str(v) for v in gg[col].dropna()}) if col in gg else []


def _one(gg: pd.DataFrame, col: str) -> str | None:
    """The value a group shares in `col` (its most frequent one, should a group ever mix), or None."""
    if col not in gg or gg[col].dropna().empty:
        return None
    return str(gg[col].dropna().astype(str).value_counts().index[0])


def judge_groups_of(frames: Frames) -> list[JudgeGroup]:
    """The report's judge groups (`judge_groups`), computed once per report: several sections read them."""
    return frames.once("judge_groups", lambda: judge_groups(frames.ctx, frames.data.samples, frames.data.judge_grades))


def primary_judge(frames: Frames) -> JudgeGroup | None:
    """The group with most grades: the one the judge section leads with and the comparisons use."""
    groups = judge_groups_of(frames)
    return groups[0] if groups else None
