"""lm-eval accuracies against chance: which cells of the report's lm-eval table show a model doing better than a
scorer that ignores what the task tests.

Each bundled multiple-choice task states its chance level in its template (`benchctl/tasks/<task>.yaml`,
`metadata.chance`): 1/4 for tinystories_ending and tinystories_names (balanced groups of four), 1/2 for
tinystories_order (two orderings of the same words); tinystories_ppl has none. The templates are read here rather
than imported from `benchctl.stages.eval.api`, whose import pulls in lm-eval (seconds, and nothing the report needs).

The test, per cell (model, recurrence, document limit, task, accuracy metric): the exact one-sided binomial test of
the correct answers against the chance level, with the counts of all the model's seeds pooled (sum of correct
answers over sum of documents). Pooling treats the seeds as further samples of documents, which is what "above
chance" asks about (a seed is not a source of chance-level answers of its own); a run's correct count is its
accuracy times its document count (lm-eval's `acc` is the mean of 0/1 over the documents, so this is exact). The
p-values of all the table's tested cells are one family, Holm-adjusted; a cell is above chance when its adjusted
p-value is below ALPHA.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from pathlib import Path

import pandas as pd
import yaml

from benchctl.core import stats
from benchctl.report.context import Context, model_keys

TEMPLATES = Path(__file__).resolve().parent / "task_yaml"
ACC_METRICS = ("acc", "acc_norm")  # proportions of documents answered correctly: what a binomial test applies to
ALPHA = 0.05
COLUMNS = ["model", "n_recur", "limit_n", "task", "metric", "chance", "correct", "n", "p", "p_holm", "above"]


@functools.lru_cache(maxsize=1)
def chance_levels() -> dict[str, float]:
    """task -> chance accuracy, for every bundled task whose template states one."""
    out: dict[str, float] = {}
    for path in sorted(TEMPLATES.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        chance = (cfg.get("metadata") or {}).get("chance")
        if chance is not None:
            out[str(cfg["task"])] = float(chance)
    return out


def fraction(chance: float) -> str:
    """0.25 -> '1/4' (chance levels are simple fractions; anything else is shown as a decimal)."""
    f = Fraction(chance).limit_denominator(100)
    return f"{f.numerator}/{f.denominator}" if abs(float(f) - chance) < 1e-9 else f"{chance:g}"


def _per_run(ctx: Context, evals: pd.DataFrame, levels: dict[str, float]) -> pd.DataFrame:
    """The accuracy rows of tasks with a chance level, one per run, keyed like the report's lm-eval table."""
    rows = evals[evals["task"].isin(list(levels)) & evals["metric"].isin(ACC_METRICS)]
    runs = ctx.done[["id", "model", "config_json"]].rename(columns={"id": "run_id"})
    df = rows.merge(runs, on="run_id", how="inner")
    if df.empty:
        return df
    trained = df["config_json"].map(lambda c: model_keys(c).get("model.n_recur"))
    df["n_recur"] = pd.to_numeric(df["n_recur"], errors="coerce").fillna(pd.to_numeric(trained, errors="coerce"))
    df["limit_n"] = pd.to_numeric(df["limit_n"], errors="coerce").fillna(0)
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    df["n_samples"] = pd.to_numeric(df["n_samples"], errors="coerce")
    return df


def chance_frame(ctx: Context, evals: pd.DataFrame) -> pd.DataFrame:
    """One row per tested cell: pooled correct answers and documents, the chance level, the binomial p-value, its
    Holm adjustment over all cells, and whether the cell is above chance. A cell whose runs did not record their
    document count gets no p-value (and is never called above chance)."""
    levels = chance_levels()
    if ctx.done.empty or evals.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = _per_run(ctx, evals, levels)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    rows = []
    for (m, r, lim, task, metric), g in df.groupby(["model", "n_recur", "limit_n", "task", "metric"], sort=True):
        chance = levels[str(task)]
        if g["n_samples"].isna().any() or g["value"].isna().any():
            correct, n, p = None, None, None
        else:
            correct = int(sum(round(v * k) for v, k in zip(g["value"], g["n_samples"])))
            n = int(g["n_samples"].sum())
            p = stats.binom_above_chance(correct, n, chance)
        rows.append(
            {
                "model": m,
                "n_recur": int(r),
                "limit_n": int(lim),
                "task": str(task),
                "metric": str(metric),
                "chance": chance,
                "correct": correct,
                "n": n,
                "p": p,
            }
        )
    order = {m: i for i, m in enumerate(ctx.models)}
    out = pd.DataFrame(rows, columns=COLUMNS[:-2])
    out = out.sort_values(["task", "metric"], kind="stable")
    out = out.sort_values("model", key=lambda s: s.map(order), kind="stable").reset_index(drop=True)
    out["p_holm"] = stats.holm([None if pd.isna(p) else float(p) for p in out["p"]])
    out["above"] = [p is not None and not pd.isna(p) and p < ALPHA for p in out["p_holm"]]
    return out


def task_verdicts(chance: pd.DataFrame, preset: str | None) -> list[str]:
    """One line per tested task: which models are above chance, or — when none is — that the task cannot separate
    the models at this preset, so its accuracies are not to be compared."""
    lines = []
    where = f"the `{preset}` preset" if preset else "this preset"
    for task, g in chance.groupby("task", sort=True):
        level = fraction(float(g["chance"].iloc[0]))
        tested = g[g["p_holm"].notna()]
        if tested.empty:
            lines.append(f"- **{task}** (chance {level}): not tested (the runs did not record their document count).")
            continue
        above = list(dict.fromkeys(tested.loc[tested["above"], "model"]))
        if not above:
            lines.append(
                f"- **{task}** (chance {level}): no model is above chance at {where}, so this task cannot "
                "separate the models here; its differences are noise, not a comparison."
            )
            continue
        below = [m for m in dict.fromkeys(tested["model"]) if m not in above]
        text = f"- **{task}** (chance {level}): above chance for {', '.join(above)}"
        lines.append(text + (f"; not for {', '.join(below)}." if below else "."))
    return lines
