"""Fair comparisons: each recurrent model against the control-family model closest to it in unique parameters, in
FLOPs per token and in training FLOPs; and the provenance of the plan the report names its models by.

A recurrent model beating the 4-block control at equal tokens mixes architecture with compute (it spends ~3.4x the
FLOPs per token). Matching it with a control of the same parameters, the same FLOPs per token and the same training
FLOPs separates those. One test (`fair_test`) decides every comparison here, and every sentence is only as strong
as its Holm-adjusted p over this family of comparisons.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from benchctl.core import stats
from benchctl.report.fmt import fnum, fp, fseeds, md_table, missing
from benchctl.report.frames import Frames
from benchctl.stages.train.report_compute import is_control_family, model_frame, run_frame, spans_sizes
from benchctl.stages.train.report_scaling import only_isoflop

ALPHA = 0.05
# (column of the model frame, column that breaks a near-tie, how the report says it). A near-tie is common by
# design: a 16-block control has the recurrent models' FLOPs per token, hence, at equal tokens, their training
# FLOPs too, as has a 4-block control trained longer; the training-FLOPs match is the one closest in parameters
# (compute spent on more tokens, not more weights), the other two the ones closest in tokens (the same data).
CRITERIA = (
    ("params", "tokens", "unique parameters"),
    ("fpt", "tokens", "FLOPs per token"),
    ("train_flops", "params", "training FLOPs"),
)
NEAR_TIE = 0.05  # within 5% (on a log scale) of the closest match counts as equally close


def fair_test(a: pd.DataFrame, b: pd.DataFrame) -> stats.Comparison:
    """The test behind every fair comparison: final validation loss of model a's runs against model b's, paired by
    seed when both have the same seeds (at a seed both saw the same data stream), Welch otherwise."""
    return stats.compare_seeds(dict(zip(a["seed"], a["final"])), dict(zip(b["seed"], b["final"])))


def fair_test_name() -> str:
    return "paired t over the shared seeds (Welch t when the seeds differ)"


def _log_distance(per: pd.DataFrame, a: str, b: str, col: str) -> float:
    x, y = per.loc[per["model"] == a, col].iloc[0], per.loc[per["model"] == b, col].iloc[0]
    if missing(x) or missing(y) or x <= 0 or y <= 0:
        return math.inf
    return abs(math.log(float(y) / float(x)))


def closest(per: pd.DataFrame, model: str, col: str, family: list[str], tie: str | None = None) -> str | None:
    """The control-family model whose `col` is closest to `model`'s on a log scale; among those within NEAR_TIE of
    the closest, the one closest in `tie` (then the first listed)."""
    dist = {c: _log_distance(per, model, c, col) for c in family}
    finite = [d for d in dist.values() if math.isfinite(d)]
    if not finite:
        return None
    near = [c for c in family if dist[c] <= min(finite) + NEAR_TIE]
    if tie is None or len(near) == 1:
        return near[0]
    return min(near, key=lambda c: (_log_distance(per, model, c, tie), near.index(c)))


def fair_frame(frames: Frames) -> pd.DataFrame:
    """One row per (recurrent model, matched control-family model): the criteria it is matched on, the ratio of
    each quantity, the difference in final loss with its CI, p, the exact sign-flip p beside a t over few seeds,
    Holm-adjusted p over the rows and that family in words, and the test's result itself (`test`)."""
    cols = [
        "a",
        "b",
        "matched",
        "params_ratio",
        "fpt_ratio",
        "train_flops_ratio",
        "n_a",
        "n_b",
        "diff",
        "lo",
        "hi",
        "p",
        "p_sign_flip",
        "p_holm",
        "family",
        "test",
    ]
    ctx = frames.ctx
    runs = run_frame(frames)
    per = model_frame(runs, ctx)
    if per.empty:
        return pd.DataFrame(columns=cols)
    family = [m for m in per["model"] if is_control_family(ctx, m)]
    rows: list[dict[str, Any]] = []
    for m in per["model"]:
        if m in family or not family:
            continue
        matches: dict[str, list[str]] = {}
        for col, tie, words in CRITERIA:
            c = closest(per, m, col, family, tie)
            if c is not None:
                matches.setdefault(c, []).append(words)
        for c, words in matches.items():
            d = fair_test(runs[runs["model"] == m], runs[runs["model"] == c])
            ra, rb = per[per["model"] == m].iloc[0], per[per["model"] == c].iloc[0]
            rows.append(
                {
                    "a": m,
                    "b": c,
                    "matched": ", ".join(words),
                    **{f"{col}_ratio": _ratio(ra[col], rb[col]) for col, _, _ in CRITERIA},
                    "n_a": d.n_a,
                    "n_b": d.n_b,
                    "diff": d.diff,
                    "lo": d.lo,
                    "hi": d.hi,
                    "p": d.p,
                    "p_sign_flip": d.p_sign_flip,
                    "p_holm": None,
                    "family": None,
                    "test": d,
                }
            )
    df = pd.DataFrame(rows, columns=cols)
    if not df.empty:
        df["p_holm"] = pd.Series(stats.holm([None if missing(p) else float(p) for p in df["p"]]), dtype=object)
        df["family"] = family_words(int(df["p"].map(lambda p: not missing(p)).sum()))
    return df


def family_words(n: int) -> str:
    """The family every adjusted p of the fair table is adjusted over, as its sentences name it. The same pairs also
    appear in the Comparisons section, adjusted there over every pair of models: two families, two adjusted p."""
    return f"the {n} fair comparison{'s' if n != 1 else ''} of this table"


def _ratio(a: Any, b: Any) -> float | None:
    return None if missing(a) or missing(b) or not b else float(a) / float(b)


def sentence(r: dict[str, Any]) -> str:
    """What one fair comparison shows, no stronger than its Holm-adjusted p."""
    a, b = r["a"], r["b"]
    ratios = ", ".join(f"{words} {_x(r[f'{col}_ratio'])}" for col, _, words in CRITERIA if words in r["matched"])
    match = f"{b} is the control closest in {r['matched']} ({a}/{b}: {ratios})"
    if missing(r["p_holm"]) or missing(r["diff"]):
        return f"{a} against {b}: cannot be tested (needs at least two finished seeds of each); {match}."
    ci = f"95% CI {fnum(r['lo'])} to {fnum(r['hi'])}"
    significant = r["p_holm"] < ALPHA and (r["lo"] > 0 or r["hi"] < 0)
    detail = (
        f"a − b = {fnum(r['diff'])}, {ci}, {stats.method_phrase(r['test'])}, {stats.fmt_p(r['p'])}, "
        f"Holm-adjusted {stats.fmt_p(r['p_holm'])} over {r['family']}"
    )
    note = stats.normality_note(r["test"], significant=significant, alpha=ALPHA)
    if note:
        detail += f"; {note}"
    if significant:
        word = "lower" if r["diff"] < 0 else "higher"
        return f"{a}'s final validation loss is {word} than {b}'s ({detail}); {match}."
    return f"No significant difference in final validation loss between {a} and {b} ({detail}); {match}."


def fair_section(frames: Frames) -> list[str]:
    if not spans_sizes(frames) or only_isoflop(frames):  # an IsoFLOP grid is compared in the Scaling section
        return []
    out = ["## Fair comparisons", ""]
    df = fair_frame(frames)
    if df.empty:
        return out + [
            "Needs finished runs of a recurrent model and of at least one control-family model "
            "(`benchctl study --plan controls` trains controls matched in parameters and compute).",
            "",
        ]
    n_tested = int(df["p"].map(lambda p: not missing(p)).sum())
    headers = [
        "a (recurrent)",
        "b (control family)",
        "closest in",
        "params a/b",
        "FLOPs/token a/b",
        "train FLOPs a/b",
        "n (a, b)",
        "a − b",
        "95% CI",
        "p",
        "p (sign-flip)",
        f"p (Holm over these {n_tested})",
    ]
    rows = [
        [
            r["a"],
            r["b"],
            r["matched"],
            _x(r["params_ratio"]),
            _x(r["fpt_ratio"]),
            _x(r["train_flops_ratio"]),
            f"{r['n_a']}, {r['n_b']}",
            fnum(r["diff"]),
            "-" if missing(r["lo"]) else f"{fnum(r['lo'])} to {fnum(r['hi'])}",
            fp(r["p"]),
            fp(r["p_sign_flip"]),
            fp(r["p_holm"]),
        ]
        for r in df.to_dict("records")
    ]
    out += md_table(headers, rows, right=range(3, len(headers))) + [""]
    out += [f"- {sentence(r)}" for r in df.to_dict("records")] + [""]
    out.append(
        f"Each recurrent model is set against the control-family model (any model of the control "
        f"architecture) closest to it, on a log scale, in unique parameters, in FLOPs per token and in "
        f"training FLOPs (within {NEAR_TIE:.0%} counts as a tie: for training FLOPs the tie goes to the "
        f"control closest in parameters, otherwise to the one closest in tokens); a control closest on "
        f"several criteria is one row. a − b is the difference in final "
        f"validation loss (negative: the recurrent model is better). Test: {fair_test_name()}, with the exact "
        f"sign-flip p beside a t over at most {stats.MAX_SIGN_FLIP_PAIRS} seeds (see Comparisons). The Holm "
        f"adjustment here is over {family_words(n_tested)} only; Comparisons adjusts the same pairs again over "
        f"every pair of models, a larger family, so a pair's two adjusted p differ and each holds for its own "
        f"family. Ratios a/b near 1 mean a close match; a plan such as `controls` trains controls that match each "
        f"criterion."
    )
    out.append("")
    return out


def _x(v: Any) -> str:
    return "-" if missing(v) else f"{float(v):.2f}×"


def _plan_file(path: object) -> str:
    """A built-in plan by its place in the package (where the package is installed says nothing about the plan, and
    the report should not carry a local directory); a user's plan file by the path it was given as."""
    p = Path(str(path))
    if p.parent.name == "plans" and p.parent.parent.name == "benchctl":
        return f"built in: `benchctl/plans/{p.name}`"
    return f"`{path}`"


def plan_section(frames: Frames) -> list[str]:
    """Which plan the model names come from, and the file version each plan in this preset ran with."""
    ctx, pr = frames.ctx, frames.data.plan_runs
    if pr is None or pr.empty or ctx.preset is None:
        return []
    pr = pr[pr["preset"] == ctx.preset]
    if pr.empty:
        return []
    out = ["## Plans", ""]
    if ctx.plan:
        out.append(
            f"Models are named by plan `{ctx.plan}`'s variants, else by the name each run was first trained under."
        )
        out.append("")
    headers = ["plan", "file", "sha256", "variants", "seeds", "runs"]
    rows = []
    for (plan, path, sha), g in pr.groupby(["plan", "plan_path", "plan_sha256"], sort=True, dropna=False):
        rows.append(
            [
                plan,
                _plan_file(path),
                f"`{str(sha)[:12]}`",
                g["variant"].nunique(),
                fseeds(g["seed"]),
                g["run_id"].nunique(),
            ]
        )
    out += md_table(headers, rows, right=range(3, len(headers))) + [""]
    return out
