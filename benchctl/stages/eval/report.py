"""Report section of the eval stage: lm-eval results per model, evaluation depth and document limit, with every
accuracy marked against its task's chance level (see `benchctl.stages.eval.chance` for the test)."""

from __future__ import annotations

import pandas as pd

from benchctl.report.context import Context, model_keys
from benchctl.report.fmt import fnum, fp, md_table, missing, need, py
from benchctl.report.frames import Frames
from benchctl.stages.eval.chance import ALPHA, chance_frame, chance_levels, fraction, task_verdicts

ABOVE = "✓"  # the mark of an accuracy above chance
AT_CHANCE = "(chance)"  # the mark of one not distinguishable from chance


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
        rows.append(
            {
                "model": m,
                "n_recur": int(r),
                "trained_n_recur": py(g["trained_n_recur"].iloc[0]),
                "limit_n": int(lim),
                "task": str(task),
                "metric": str(metric),
                "value": float(g["value"].mean()),
                "stderr": float(se.mean()) if not se.empty else None,
                "seeds": int(g["run_id"].nunique()),
            }
        )
    out = pd.DataFrame(rows, columns=cols)
    order = {m: i for i, m in enumerate(ctx.models)}
    out["_o"] = out["model"].map(order)
    return out.sort_values(["_o", "n_recur", "limit_n", "task", "metric"]).drop(columns="_o").reset_index(drop=True)


def _keys(ev: pd.DataFrame) -> list[tuple[str, int, int]]:
    keys = []
    for r in ev.itertuples():
        k = (r.model, r.n_recur, r.limit_n)
        if k not in keys:
            keys.append(k)
    return keys


def _lead(m: str, r: int, lim: int, g: pd.DataFrame) -> list:
    trained = g["trained_n_recur"].iloc[0]
    return [
        m,
        f"{r}" + ("" if missing(trained) or int(trained) == r else f" (trained {int(trained)})"),
        "all" if lim == 0 else f"{lim:,}",
        int(g["seeds"].max()),
    ]


def _mark(tested: pd.DataFrame) -> str:
    if tested.empty or missing(tested["p_holm"].iloc[0]):
        return ""
    return f" {ABOVE}" if bool(tested["above"].iloc[0]) else f" {AT_CHANCE}"


def _results_table(ev: pd.DataFrame, chance: pd.DataFrame) -> list[str]:
    metrics = sorted({(t, m) for t, m in zip(ev["task"], ev["metric"])})
    headers = ["model", "n_recur", "limit", "seeds"] + [f"{t} {m}" for t, m in metrics]
    rows = []
    for m, r, lim in _keys(ev):
        g = ev[(ev["model"] == m) & (ev["n_recur"] == r) & (ev["limit_n"] == lim)]
        row = _lead(m, r, lim, g)
        cg = chance[(chance["model"] == m) & (chance["n_recur"] == r) & (chance["limit_n"] == lim)]
        for t, met in metrics:
            c = g[(g["task"] == t) & (g["metric"] == met)]
            if c.empty:
                row.append("-")
                continue
            v, se = c["value"].iloc[0], c["stderr"].iloc[0]
            row.append(
                fnum(v, 4)
                + ("" if missing(se) else f" ± {fnum(se, 4)}")
                + _mark(cg[(cg["task"] == t) & (cg["metric"] == met)])
            )
        rows.append(row)
    return md_table(headers, rows, right=range(1, len(headers)))


def chance_family(chance: pd.DataFrame) -> str:
    """The family the cells' p-values are Holm-adjusted over, in words: the tested cells only (a cell without a
    document count has no p and is no member)."""
    n = int(chance["p"].notna().sum())
    return f"the {n} tested accuracy cell{'s' if n != 1 else ''} of the table"


def _chance_table(ev: pd.DataFrame, chance: pd.DataFrame) -> list[str]:
    """Correct answers / documents over all seeds, the binomial p-value and its Holm adjustment, per tested cell."""
    cells = sorted({(t, m) for t, m in zip(chance["task"], chance["metric"])})
    headers = ["model", "n_recur", "limit", "seeds"] + [f"{t} {m}" for t, m in cells]
    rows = []
    for m, r, lim in _keys(ev):
        cg = chance[(chance["model"] == m) & (chance["n_recur"] == r) & (chance["limit_n"] == lim)]
        if cg.empty:
            continue
        row = _lead(m, r, lim, ev[(ev["model"] == m) & (ev["n_recur"] == r) & (ev["limit_n"] == lim)])
        for t, met in cells:
            c = cg[(cg["task"] == t) & (cg["metric"] == met)]
            if c.empty:
                row.append("-")
            elif missing(c["p"].iloc[0]):
                row.append("not tested")
            else:
                x = c.iloc[0]
                row.append(f"{int(x['correct'])}/{int(x['n'])}, p {fp(x['p'])}, Holm {fp(x['p_holm'])}")
        rows.append(row)
    return md_table(headers, rows, right=range(1, len(headers)))


def eval_section(frames: Frames) -> list[str]:
    ctx, data = frames.ctx, frames.data
    out = ["## lm-eval", ""]
    ev = eval_frame(ctx, data.eval_results)
    if ev.empty:
        return out + need("No lm-eval results: `benchctl eval` produces them.")
    chance = chance_frame(ctx, data.eval_results)
    out += _results_table(ev, chance) + [""]
    out.append(
        "value = mean over seeds; ± = lm-eval's standard error of one run (averaged over seeds when there "
        "are several); limit = documents per task (all = the full task)."
    )
    out.append("")
    if chance.empty:
        return out
    levels = ", ".join(f"{t} {fraction(c)}" for t, c in sorted(chance_levels().items()))
    out.append(
        f"{ABOVE} = above chance, {AT_CHANCE} = not distinguishable from chance: one-sided exact binomial "
        "test of the correct answers of all seeds against the task's chance level (a model that ignores what "
        f"the task tests scores exactly that: {levels}), Holm-adjusted over {chance_family(chance)}, "
        f"α = {ALPHA}."
    )
    out.append("")
    out += task_verdicts(chance, ctx.preset) + [""]
    out.append(
        "Against chance (correct answers / documents over all seeds, one-sided binomial p, Holm-adjusted p over "
        f"{chance_family(chance)}):"
    )
    out.append("")
    out += _chance_table(ev, chance) + [""]
    return out
