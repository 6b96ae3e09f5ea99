"""The comparisons between models the report closes with: final validation loss (training) and the primary judge
group's average (judge), each pair of models with 95% CIs and Holm-adjusted p-values per quantity."""

from __future__ import annotations

import pandas as pd

from benchctl.core import stats
from benchctl.report.context import CONTROL, Context
from benchctl.stages.judge.frames import JudgeGroup


def _pairs(models: list[str]) -> list[tuple[str, str]]:
    """Each other model against the control, then every pair of the other models (display order)."""
    others = [m for m in models if m != CONTROL]
    pairs = [(m, CONTROL) for m in others] if CONTROL in models else []
    pairs += [(a, b) for i, a in enumerate(others) for b in others[i + 1 :]]
    return pairs


LOSS = "final validation loss"
JUDGE_AVERAGE = "judge average"


def comparison_frame(ctx: Context, judge: JudgeGroup | None = None) -> pd.DataFrame:
    """Differences a − b in final validation loss (benchctl.core.stats.compare_seeds: paired t over shared seeds, Welch
    when the seeds differ) and judge average (stats.compare_judge: t over per-seed mean differences, or over prompts
    with one seed), with 95% CI, p, the exact sign-flip p beside a t over few pairs, Holm-adjusted p per quantity
    and the family it was adjusted over (in words), and a verdict sentence decided on the adjusted p."""
    cols = [
        "a",
        "b",
        "quantity",
        "method",
        "n_a",
        "n_b",
        "n_prompts",
        "scope",
        "diff",
        "lo",
        "hi",
        "p",
        "p_sign_flip",
        "p_wilcoxon",
        "p_holm",
        "family",
        "verdict",
    ]
    found: list[tuple[str, str, str, stats.Comparison]] = []
    pairs = _pairs(ctx.done_models)
    for a, b in pairs:
        found.append((a, b, LOSS, stats.compare_seeds(_per_seed(ctx, a), _per_seed(ctx, b))))
    if judge is not None:
        for a, b in pairs:
            if a in judge.per_seed_prompt and b in judge.per_seed_prompt:
                found.append(
                    (a, b, JUDGE_AVERAGE, stats.compare_judge(judge.per_seed_prompt[a], judge.per_seed_prompt[b]))
                )
    adjusted: list[float | None] = [None] * len(found)
    for q in (LOSS, JUDGE_AVERAGE):
        idx = [i for i, f in enumerate(found) if f[2] == q]
        for i, p in zip(idx, stats.holm([found[i][3].p for i in idx])):
            adjusted[i] = p
    rows = []
    for (a, b, q, c), p_adj in zip(found, adjusted):
        family = f"the {sum(1 for f in found if f[2] == q and f[3].testable)} pairwise comparisons of {q}"
        rows.append(
            {
                "a": a,
                "b": b,
                "quantity": q,
                "method": c.method,
                "n_a": c.n_a,
                "n_b": c.n_b,
                "n_prompts": c.n_prompts,
                "scope": c.scope,
                "diff": c.diff,
                "lo": c.lo,
                "hi": c.hi,
                "p": c.p,
                "p_sign_flip": c.p_sign_flip,
                "p_wilcoxon": c.p_wilcoxon,
                "p_holm": p_adj,
                "family": family,
                "verdict": stats.verdict(a, b, q, c, p_adj=p_adj, family=family, digits=3 if q == LOSS else 2),
            }
        )
    return pd.DataFrame(rows, columns=cols)


def _per_seed(ctx: Context, model: str) -> dict[int, float | None]:
    """seed -> final validation loss of the model's done run at that seed (the mean if a seed ran twice)."""
    g = ctx.done_of(model)
    v = pd.to_numeric(g["final_val_loss"], errors="coerce")
    return {int(k): (None if pd.isna(x) else float(x)) for k, x in v.groupby(g["seed"].astype(int)).mean().items()}
