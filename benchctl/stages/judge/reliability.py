"""Report section of the judge stage: how far the judge itself can be trusted, from results.db only.

For the primary set of grades (the one the comparisons use): agreement between repeated grades of the same sample
(Krippendorff's alpha, interval metric, with a bootstrap CI over samples), agreement with every other judge model or
protocol that graded the same samples, the judge's length bias (Spearman correlation of completion length with the
grade per model, and whether the ranking of models survives removing a pooled linear effect of length), and the
failure rate per model with a test that the rates are equal. A closing paragraph states these numbers plainly.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from benchctl.core import stats
from benchctl.report.fmt import fnum, fp, md_table, need
from benchctl.report.frames import Frames
from benchctl.stages.judge.frames import JUDGE_COLUMNS, N_BOOT, JudgeGroup, judge_groups_of, primary_judge

# Conventional reading of alpha (Krippendorff 2004): >= 0.8 reliable, >= 0.667 enough for tentative conclusions.
ALPHA_RELIABLE, ALPHA_TENTATIVE = 0.8, 0.667


def _ok_per_sample(jg: JudgeGroup) -> pd.DataFrame:
    """One row per graded sample: its ok repeats averaged, with model, seed and completion length."""
    ok = jg.grades[jg.grades["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame(columns=["sample_id", "model", "n_tokens", *JUDGE_COLUMNS])
    keys = ["sample_id", "model", "run_seed"]
    means = ok.groupby(keys, sort=True)[list(JUDGE_COLUMNS)].mean().reset_index()
    tokens = ok.groupby("sample_id", sort=True)["n_tokens"].first()
    means["n_tokens"] = pd.to_numeric(means["sample_id"].map(tokens), errors="coerce")
    return means


def repeat_agreement(jg: JudgeGroup) -> dict[str, stats.Agreement]:
    """Per criterion: alpha between the ok repeats of each sample (units = samples, values = repeats)."""
    ok = jg.grades[jg.grades["status"] == "ok"]
    out = {}
    for i, c in enumerate(JUDGE_COLUMNS):
        units = [g[c].tolist() for _, g in ok.groupby("sample_id", sort=True)]
        out[c] = stats.alpha_ci(units, n_boot=N_BOOT, seed=i)
    return out


def cross_agreement(primary: JudgeGroup, other: JudgeGroup) -> tuple[int, dict[str, stats.Agreement], float | None]:
    """(shared samples, alpha per criterion between the two sets, mean of other − primary judge average)."""
    a, b = _ok_per_sample(primary), _ok_per_sample(other)
    both = a.merge(b, on="sample_id", suffixes=("_a", "_b"))
    if both.empty:
        return 0, {}, None
    out = {
        c: stats.alpha_ci(both[[f"{c}_a", f"{c}_b"]].values.tolist(), n_boot=N_BOOT, seed=i)
        for i, c in enumerate(JUDGE_COLUMNS)
    }
    return len(both), out, float((both["average_b"] - both["average_a"]).mean())


def failure_test(jg: JudgeGroup) -> stats.FailureTest:
    counts = {str(m): (int((g["status"] != "ok").sum()), len(g)) for m, g in jg.grades.groupby("model", sort=False)}
    order = [m for m in jg.table["model"] if m in counts] if not jg.table.empty else list(counts)
    return stats.failure_rates({m: counts[m] for m in order})


def _alpha_cell(ag: stats.Agreement | None) -> str:
    if ag is None or ag.alpha is None:
        return "-"
    ci = "" if ag.lo is None else f" [{fnum(ag.lo, 2)}, {fnum(ag.hi, 2)}]"
    return f"{fnum(ag.alpha, 2)}{ci}"


def _repeats_lines(jg: JudgeGroup, rep: dict[str, stats.Agreement] | None) -> list[str]:
    out = ["### Agreement between repeats", ""]
    if rep is None:
        return out + need(
            "One grade per sample: `benchctl judge --repeats 2` grades every sample twice and "
            "measures how well the judge agrees with itself."
        )
    n = rep["average"]
    out += md_table(
        ["criterion", "alpha [95% CI]", "samples", "grades"],
        [[c, _alpha_cell(rep[c]), rep[c].n_units, rep[c].n_values] for c in JUDGE_COLUMNS],
        right=range(1, 4),
    ) + [""]
    out.append(
        f"Krippendorff's alpha (interval metric) between the repeated grades of each sample ({n.n_units} "
        "samples with two or more ok grades): 1 = the judge always repeats itself, 0 = agreement no better "
        f"than chance. CI: percentile bootstrap over samples (B = {N_BOOT:,})."
    )
    return out + [""]


def _cross_lines(
    primary: JudgeGroup,
    others: list[JudgeGroup],
    cross: list[tuple[JudgeGroup, int, dict[str, stats.Agreement], float | None]],
) -> list[str]:
    out = ["### Agreement with other judges and protocols", ""]
    if not cross:
        what = (
            "The other grade sets share no samples with it."
            if others
            else "Only one judge model and protocol graded these samples."
        )
        return out + need(
            f"{what} Grading the same samples with a second `benchctl judge --model ...` or "
            "`--protocol ...` measures how much the verdicts depend on the judge."
        )
    rows = [
        [f"{g.judge_model} / {g.protocol} / {g.prompt_hash[:12]}", n]
        + [_alpha_cell(ag.get(c)) for c in JUDGE_COLUMNS]
        + [fnum(shift, 2)]
        for g, n, ag, shift in cross
    ]
    out += md_table(
        ["other grade set", "shared samples", *(f"alpha {c}" for c in JUDGE_COLUMNS), "mean shift (average)"],
        rows,
        right=range(1, len(JUDGE_COLUMNS) + 3),
    ) + [""]
    out.append(
        f"Each sample's grades from `{primary.judge_model}` / `{primary.protocol}` (the primary set) and from "
        "the other set, repeats averaged, as two coders; alpha as above. Mean shift: the other set's "
        "average grade minus the primary's over the shared samples."
    )
    return out + [""]


def _length_lines(lb: stats.LengthBias | None) -> list[str]:
    out = ["### Length bias", ""]
    if lb is None or lb.slope is None:
        return out + need("Not measurable: the graded samples' lengths (samples.n_tokens) are missing or all equal.")
    rows = [
        [m, fnum(r, 2) if r is not None else "-", fp(p), n, fnum(lb.raw_mean[m], 2), fnum(lb.adjusted_mean[m], 2)]
        for m, (r, p, n) in lb.rho.items()
    ]
    out += md_table(
        ["model", "Spearman rho", "p", "samples", "mean grade", "length-adjusted"], rows, right=range(1, 6)
    ) + [""]
    slope = "-" if lb.slope is None else f"{fnum(100 * lb.slope, 2)} grade points per 100 tokens"
    out.append(
        f"Length bias: Spearman correlation of completion length (tokens) with the average grade, per "
        f"model. Length-adjusted: the mean residual of one linear fit grade ~ length over every model's "
        f"samples (slope {slope}), plus the overall mean. Ranking by mean grade: "
        f"{' > '.join(lb.raw_rank)}; after adjusting for length: {' > '.join(lb.adjusted_rank)} "
        f"({'changed' if lb.rank_changes else 'unchanged'})."
    )
    return out + [""]


def _failure_lines(ft: stats.FailureTest) -> list[str]:
    out = ["### Failure rate", ""]
    rates = ", ".join(f"{m} {f}/{t} ({fnum(100 * f / t, 1)}%)" for m, (f, t) in ft.counts.items())
    test = (
        f"{ft.test} test that the rates are equal: {stats.fmt_p(ft.p)}."
        if ft.p is not None
        else f"No test of equal rates: {ft.reason}."
    )
    out.append(f"Failure rate per model (grade requests stored as failures / all stored): {rates}. {test}")
    return out + [""]


def _trust_lines(
    rep: dict[str, stats.Agreement] | None, cross: list[Any], lb: stats.LengthBias | None, ft: stats.FailureTest
) -> list[str]:
    """The plain paragraph: each measured number, and what it does and does not allow."""
    parts = []
    if rep is None or rep["average"].alpha is None:
        parts.append("The judge's agreement with itself is not measured (one grade per sample).")
    else:
        a = rep["average"]
        level = (
            "reliable"
            if a.alpha >= ALPHA_RELIABLE
            else "enough for tentative conclusions only"
            if a.alpha >= ALPHA_TENTATIVE
            else "too low to rest conclusions on"
        )
        parts.append(
            f"Repeated grades of the same sample agree with alpha = {fnum(a.alpha, 2)} on the average grade ({level})."
        )
    if cross:
        g, n, ag, shift = cross[0]
        alpha = ag.get("average")
        parts.append(
            f"Against `{g.judge_model}` / `{g.protocol}` on {n} shared samples the average grade agrees with "
            f"alpha = {_alpha_cell(alpha)} and shifts by {fnum(shift, 2)} points."
        )
    else:
        parts.append(
            "No second judge or protocol graded the same samples, so how much the verdicts depend on this "
            "judge is not measured."
        )
    if lb is not None and lb.slope is not None:
        rhos = [r for r, _, _ in lb.rho.values() if r is not None]
        lo, hi = (fnum(min(rhos), 2), fnum(max(rhos), 2)) if rhos else ("", "")
        span = "" if not rhos else f"Spearman rho {lo}; " if lo == hi else f"Spearman rho per model {lo} to {hi}; "
        parts.append(
            f"Each 100 tokens of completion move the grade by {fnum(100 * lb.slope, 2)} points "
            f"({span}pooled linear fit); the ranking of models "
            f"{'changes' if lb.rank_changes else 'does not change'} once length is adjusted for."
        )
    else:
        parts.append("Length bias is not measured (completion lengths missing or all equal).")
    if ft.p is not None:
        parts.append(
            f"Failure rates {'differ' if ft.p < 0.05 else 'do not differ detectably'} between models "
            f"({ft.test}, {stats.fmt_p(ft.p)}), so failures "
            f"{'may bias' if ft.p < 0.05 else 'are unlikely to bias'} the comparison."
        )
    else:
        parts.append(f"Failures: {ft.reason}.")
    return ["### How far to trust the judge", "", " ".join(parts), ""]


def reliability_section(frames: Frames) -> list[str]:
    primary, groups = primary_judge(frames), judge_groups_of(frames)
    out = ["## Judge reliability", ""]
    if primary is None:
        return out + need(
            "No judge grades: `benchctl judge --repeats 2` grades every sample twice and measures "
            "the judge's agreement with itself."
        )
    out.append(
        f"Of the grade set the comparisons use: judge `{primary.judge_model}`, protocol `{primary.protocol}`, "
        f"prompt `{primary.prompt_hash}`."
    )
    if "assessment" in primary.grades:
        n_assess = int(primary.grades["assessment"].notna().sum())
        if n_assess:
            out.append(f"{n_assess} grades carry the judge's written assessment (judge_grades.assessment).")
    out.append("")
    repeats = primary.grades[primary.grades["status"] == "ok"].groupby("sample_id")["repeat"].nunique()
    rep = repeat_agreement(primary) if not repeats.empty and int(repeats.max()) >= 2 else None
    others = [g for g in groups if g is not primary]
    cross = [(g, *cross_agreement(primary, g)) for g in others]
    cross = [c for c in cross if c[1] > 0]
    per_sample = _ok_per_sample(primary)
    lb = stats.length_bias(zip(per_sample["model"], per_sample["n_tokens"], per_sample["average"]))
    ft = failure_test(primary)
    out += _repeats_lines(primary, rep) + _cross_lines(primary, others, cross) + _length_lines(lb)
    out += _failure_lines(ft) + _trust_lines(rep, cross, lb, ft)
    return out
