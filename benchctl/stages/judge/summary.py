"""The judge job's summary: what was sent and stored, tokens and cost, and per architecture the mean of each
criterion with a 95% t-interval over samples.

A sample's repeats are averaged first, so the unit of the interval is the sample, not the request; fewer than two
samples give a mean and no interval. Failures are counted, never scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from benchctl.core import paper
from benchctl.core import stats as st
from benchctl.stages.judge.client import CRITERIA, Settings, Usage
from benchctl.stages.judge.storage import Database, grades_in_scope, requests_in_scope


@dataclass
class CriterionStat:
    mean: float | None  # None without any value
    ci_low: float | None  # None when n < 2
    ci_high: float | None


def criterion_stat(values: list[float]) -> CriterionStat:
    """Mean and two-sided 95% t-interval of `values`; no interval (None) with fewer than two values."""
    m = st.mean_ci(values, level=0.95)
    return CriterionStat(m.mean, m.lo, m.hi)


@dataclass
class ArchSummary:
    arch: str
    preset: str
    label: str  # the model's name (its runs' variant, e.g. control-16), with the preset when the scope mixes presets
    n_samples: int  # samples with at least one ok grade
    n_grades: int  # ok grades (samples x repeats)
    n_failed: int  # keys whose current grade is 'failed'
    n_pending: int  # keys never answered (e.g. the job was stopped)
    stats: dict[str, CriterionStat]  # criterion or "average" -> mean and 95% CI over samples


@dataclass
class JudgeSummary:
    judge_model: str
    prompt_hash: str
    prompt_path: str
    dry_run: bool
    temperature: float
    thinking_budget: int | None
    repeats: int
    n_samples: int  # samples in scope
    n_keys: int  # samples x repeats
    n_cached: int  # keys skipped because they already have an ok grade (or a failed one with retry_failed=False)
    n_todo: int  # keys this invocation graded (or, with dry_run, would grade)
    n_requests: int = 0  # HTTP calls made by this invocation (retries included); 0 for a dry run
    n_ok: int = 0  # keys graded ok by this invocation
    n_failed: int = 0  # keys that failed in this invocation
    failures: list[dict[str, Any]] = field(default_factory=list)  # this invocation's: sample_id, repeat, arch, error
    usage: Usage = field(default_factory=Usage)  # tokens billed by this invocation
    cost_usd: float | None = None
    usage_total: Usage = field(default_factory=Usage)  # tokens billed for every key in scope, over all invocations
    cost_total_usd: float | None = None
    estimated_prompt_tokens: int = 0  # dry run only: chars/4 of each filled prompt
    estimated_output_tokens: int = 0  # dry run only: OUTPUT_TOKENS_ESTIMATE (+ thinking budget) per request
    estimated_cost_usd: float | None = None
    per_arch: list[ArchSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    protocol: str = "json"  # json: grades only; assess: a general assessment first, then the grades
    backend: str = "gemini"  # gemini or openai (an OpenAI-compatible server)
    model: str = ""  # the model name sent (judge_model is the name grades are stored under)
    endpoint: str | None = None  # host (and path) of the base URL
    stopped_unanswered: int = 0  # calls without any answer after which the job stopped (0: it did not stop)
    seed: int | None = None  # the judge's sampling seed (repeat k: seed + k); None: none sent

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def nothing_graded(self) -> str | None:
        """Why this invocation obtained no grade at all although it tried (one line), or None when it obtained one
        or had nothing to send. Its failures are stored like any other; this only says the run as a whole failed,
        which a command must not report as success: a judge server that is down fails every grade."""
        if self.dry_run or self.n_ok or not self.n_failed:
            return None
        errors = [" ".join(str(f["error"]).split()) for f in self.failures]
        last = errors[-1] if errors else "no error recorded"
        last = last if len(last) <= 300 else last[:300] + "..."
        where = f"the judge service at {self.endpoint}" if self.endpoint else "the judge service"
        stored = f"{self.n_failed} grade(s) failed and were stored as failures; rerun to retry"
        if self.stopped_unanswered:
            stored += (
                f" (the job stopped after {self.stopped_unanswered} calls had no answer at all: the other samples "
                "were not sent)"
            )
        if errors and all("connection error" in e for e in errors):
            return (
                f"{where} could not be reached: no grade obtained, {stored} (last error: {last}); check that it is "
                "running and its --base-url, or raise --connect-timeout / --read-timeout"
            )
        return f"no grade obtained from {where}: {stored} (last error: {last})"


def summarize(db: Database, samples: list[dict[str, Any]], s: Settings, repeats: int, summary: JudgeSummary) -> None:
    """Fill in token totals, costs, notes and the per-architecture table for the samples in scope."""
    ids = [r["sample_id"] for r in samples]
    _add_totals(db, s, ids, repeats, summary)
    grades = [g for g in grades_in_scope(db, s, ids) if g["repeat"] < repeats]  # more repeats: another job's
    summary.per_arch = per_arch(samples, grades, repeats)


def _add_totals(db: Database, s: Settings, ids: list[str], repeats: int, summary: JudgeSummary) -> None:
    """Tokens and cost of this run and of every grade in scope; notes on settings and prices."""
    usage_total = Usage()
    mismatched = 0
    for r in requests_in_scope(db, s, ids):
        if r["repeat"] >= repeats:
            continue
        usage_total += Usage(
            r["prompt_tokens"] or 0, r["output_tokens"] or 0, r["thinking_tokens"] or 0, r["total_tokens"] or 0
        )
        if r["status"] == "ok" and (
            r["temperature"] != s.temperature
            or r["thinking_budget"] != s.thinking_budget
            or r.get("seed") != s.seed_for_repeat(r["repeat"])
        ):
            mismatched += 1
    summary.usage_total = usage_total
    summary.cost_total_usd = usage_total.cost(s.judge_model)
    summary.cost_usd = summary.usage.cost(s.judge_model)
    if mismatched:
        summary.notes.append(
            f"{mismatched} cached grade(s) were made with another temperature, thinking budget or seed than "
            f"temperature={s.temperature}, thinking_budget={s.thinking_budget}, seed={s.seed}; see judge_requests"
        )
    if summary.cost_usd is None and not summary.dry_run:
        summary.notes.append(f"no price known for '{s.judge_model}': cost not estimated")


def per_arch(samples: list[dict[str, Any]], grades: list[dict[str, Any]], repeats: int) -> list[ArchSummary]:
    """One row per (preset, model): criterion means with CIs over samples, failures, keys never answered. A model is
    its runs' variant name (a plan's control-16 and control are different models of one architecture)."""
    group_of = {r["sample_id"]: (r["preset"], r["arch"], r.get("variant") or r["arch"]) for r in samples}
    status = {(g["sample_id"], g["repeat"]): g["status"] for g in grades}
    ok: dict[str, list[dict[str, Any]]] = {}
    for g in grades:
        if g["status"] == "ok":
            ok.setdefault(g["sample_id"], []).append(g)
    presets = {p for p, _, _ in group_of.values()}
    rows = []
    for preset, arch, variant in sorted(set(group_of.values()), key=_arch_order):
        arch_ids = [i for i in group_of if group_of[i] == (preset, arch, variant)]
        keys = [(i, r) for i in arch_ids for r in range(repeats)]
        per_sample = {i: ok[i] for i in arch_ids if i in ok}
        rows.append(
            ArchSummary(
                arch=arch,
                preset=preset,
                label=variant if len(presets) == 1 else f"{variant} ({preset})",
                n_samples=len(per_sample),
                n_grades=sum(len(gs) for gs in per_sample.values()),
                n_failed=sum(1 for k in keys if status.get(k) == "failed"),
                n_pending=sum(1 for k in keys if k not in status),
                # A sample's repeats are averaged first: the unit of the interval is the sample, not the request.
                stats={
                    c: criterion_stat([sum(g[c] for g in gs) / len(gs) for gs in per_sample.values()])
                    for c in (*CRITERIA, "average")
                },
            )
        )
    return rows


def _arch_order(group: tuple[str, str, str]) -> tuple[str, int, str, bool, str]:
    """Presets alphabetically; within one, the study's architectures in its order, then any others by name; within
    an architecture, the model named after it first, then its variants by name."""
    preset, arch, variant = group
    study = list(paper.TOTAL_PARAMS)
    return preset, study.index(arch) if arch in study else len(study), arch, variant != arch, variant
