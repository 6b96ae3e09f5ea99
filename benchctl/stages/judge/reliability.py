"""Report section of the judge stage: how far the judge itself can be trusted, from results.db only.

For the primary set of grades (the one the comparisons use): agreement between repeated grades of the same sample
(Krippendorff's alpha, interval metric, with a bootstrap CI over samples), agreement with every other judge model or
protocol that graded the same samples; between every pair of judges present (Gemini and an OpenAI-compatible one,
two local models, two protocols), alpha and the rank agreement of the models (Kendall's tau) on the samples both
graded, and a table of each judge's ranking that says where they disagree; the primary judge's length bias
(Spearman correlation of completion length with the grade per model, and whether the ranking of models survives
removing a pooled linear effect of length), and the failure rate per model with a test that the rates are equal.
A closing paragraph states these numbers plainly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any

import pandas as pd
from scipy import stats as sps

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


@dataclass
class PairAgreement:
    """Two judges on the samples both graded: alpha of the average grade, and how alike they rank the models."""

    a: JudgeGroup
    b: JudgeGroup
    n: int  # shared samples
    alpha: stats.Agreement
    tau: float | None  # Kendall's tau-b between the two rankings; None with fewer than two models or no spread
    ranks: dict[str, tuple[int, int]]  # model -> (rank by a, rank by b), 1 = highest mean grade
    means: dict[str, tuple[float, float]]  # model -> (a's, b's) mean average grade over the shared samples

    @property
    def differ(self) -> list[str]:
        return [m for m, (ra, rb) in self.ranks.items() if ra != rb]


def _ranks(means: pd.Series) -> dict[str, int]:
    """Rank 1 = the highest mean grade; ties share the better rank."""
    return {str(m): int(r) for m, r in means.rank(ascending=False, method="min").items()}


def pair_agreement(a: JudgeGroup, b: JudgeGroup) -> PairAgreement | None:
    """Agreement of two judges on the samples both graded (repeats averaged), None if they share none."""
    both = _ok_per_sample(a).merge(_ok_per_sample(b), on="sample_id", suffixes=("_a", "_b"))
    if both.empty:
        return None
    # the bootstrap seed cross_agreement gives the average: the same pair gets the same interval in both tables
    seed = JUDGE_COLUMNS.index("average")
    alpha = stats.alpha_ci(both[["average_a", "average_b"]].values.tolist(), n_boot=N_BOOT, seed=seed)
    order = [m for m in a.table["model"] if m in set(both["model_a"])] if not a.table.empty else []
    ma = both.groupby("model_a")["average_a"].mean().reindex(order)
    mb = both.groupby("model_a")["average_b"].mean().reindex(order)
    tau = None
    if len(order) >= 2:
        t = sps.kendalltau(ma.values, mb.values).statistic
        tau = None if pd.isna(t) else float(t)
    ra, rb = _ranks(ma), _ranks(mb)
    return PairAgreement(
        a,
        b,
        len(both),
        alpha,
        tau,
        {m: (ra[m], rb[m]) for m in order},
        {m: (float(ma[m]), float(mb[m])) for m in order},
    )


def pair_agreements(frames: Frames) -> list[PairAgreement]:
    """Every pair of judges present that graded common samples, in the report's order of the judges."""

    def compute() -> list[PairAgreement]:
        groups = judge_groups_of(frames)
        found = (pair_agreement(a, b) for a, b in combinations(groups, 2))
        return [p for p in found if p is not None]

    return list(frames.once("judge_pair_agreements", compute))


def judge_rankings(frames: Frames) -> tuple[list[JudgeGroup], int, dict[str, list[tuple[int, float]]]]:
    """Each judge's ranking of the models on the samples that the primary judge and every other judge that shares
    samples with it all graded: (judges, number of those samples, model -> [(rank, mean) per judge])."""
    primary = primary_judge(frames)
    if primary is None:
        return [], 0, {}
    groups = [primary] + [p.b for p in pair_agreements(frames) if p.a is primary]
    groups += [p.a for p in pair_agreements(frames) if p.b is primary]
    if len(groups) < 2:
        return groups, 0, {}
    per_sample = [_ok_per_sample(g) for g in groups]
    common = set(per_sample[0]["sample_id"])
    for ps in per_sample[1:]:
        common &= set(ps["sample_id"])
    if not common:
        return groups, 0, {}
    order = list(primary.table["model"])
    cols = []
    for ps in per_sample:
        means = ps[ps["sample_id"].isin(common)].groupby("model")["average"].mean()
        means = means.reindex([m for m in order if m in means.index])
        ranks = _ranks(means)
        cols.append({m: (ranks[m], float(means[m])) for m in means.index})
    models = [m for m in order if all(m in c for c in cols)]
    return groups, len(common), {m: [c[m] for c in cols] for m in models}


def rank_disagreements(frames: Frames) -> list[str]:
    """One phrase per model the judges rank differently ("frailt: 1st by A, 2nd by B"); [] when they agree."""
    groups, _, table = judge_rankings(frames)
    out = []
    for m, cells in table.items():
        if len({r for r, _ in cells}) > 1:
            by = ", ".join(f"{_ordinal(r)} by `{g.judge_model}` / `{g.protocol}`" for g, (r, _) in zip(groups, cells))
            out.append(f"{m}: {by}")
    return out


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


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


def _pairs_lines(frames: Frames) -> list[str]:
    out = ["### Agreement and ranking between every pair of judges", ""]
    pairs = pair_agreements(frames)
    if not pairs:
        return out + need(
            "Only one judge graded these samples. A second judge on the same samples — another Gemini model, "
            "`benchctl judge --model openai:<name> --base-url ...` for a local or hosted OpenAI-compatible server, or "
            "the other `--protocol` — measures how far the models' ranking depends on the judge."
        )
    rows = []
    for p in pairs:
        differ = ", ".join(p.differ) if p.differ else "none"
        tau = "-" if p.tau is None else fnum(p.tau, 2)
        rows.append([p.a.label, p.b.label, p.n, _alpha_cell(p.alpha), tau, len(p.ranks), differ])
    out += md_table(
        ["judge a", "judge b", "shared samples", "alpha (average)", "Kendall tau", "models", "ranked differently"],
        rows,
        right=range(2, 6),
    ) + [""]
    out.append(
        "Every pair of judges (judge / protocol / prompt) that graded the same samples. alpha: Krippendorff's alpha "
        f"(interval) between the two judges' average grade of each shared sample, repeats averaged, with a "
        f"bootstrap CI over samples (B = {N_BOOT:,}). Kendall tau: rank agreement of the models, each ranked by "
        "its mean average grade over the shared samples (1 = the same order, -1 = reversed; with two models it "
        "can only be 1 or -1). Ranked differently: the models the two judges place at different ranks."
    )
    out.append("")
    groups, n_common, table = judge_rankings(frames)
    if n_common and table:
        heads = ["model"] + [f"{g.judge_model} / {g.protocol}" for g in groups] + ["judges agree"]
        body = [
            [m] + [f"{r} ({fnum(mean, 2)})" for r, mean in cells] + ["yes" if len({r for r, _ in cells}) == 1 else "no"]
            for m, cells in table.items()
        ]
        out += md_table(heads, body, right=range(1, len(groups) + 1)) + [""]
        disagree = rank_disagreements(frames)
        verdict = (
            "The judges disagree about the rank of " + "; ".join(disagree) + ". A claim that rests on these "
            "models' order depends on the judge."
            if disagree
            else "Every judge ranks the models in the same order."
        )
        out.append(
            f"Rank (mean average grade) of each model by each judge that shares samples with the primary one, on "
            f"the {n_common} samples all of them graded. {verdict}"
        )
        out.append("")
    return out


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
    rep: dict[str, stats.Agreement] | None,
    cross: list[Any],
    lb: stats.LengthBias | None,
    ft: stats.FailureTest,
    pairs: list[PairAgreement],
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
    pairs = [p for p in pairs if p.tau is not None or p.ranks]
    if pairs:
        differ = sorted({m for p in pairs for m in p.differ})
        parts.append(
            f"Across the {len(pairs)} pair(s) of judges that graded common samples, "
            + (
                f"the models' ranking changes with the judge for {', '.join(differ)}."
                if differ
                else "every pair ranks the models in the same order."
            )
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
        f"prompt `{primary.prompt_hash}` ({primary.identity()})."
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
    out += _repeats_lines(primary, rep) + _cross_lines(primary, others, cross) + _pairs_lines(frames)
    out += _length_lines(lb) + _failure_lines(ft) + _trust_lines(rep, cross, lb, ft, pair_agreements(frames))
    return out
