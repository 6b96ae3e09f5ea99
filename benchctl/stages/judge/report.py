"""Report section of the judge stage: grades per criterion and model for each (judge model, protocol and grading
prompt, sampling settings) group, with the primary group's figure and the study's published grades. Groups are
never pooled: a different protocol or prompt version is a different set of grades."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchctl.core import paper
from benchctl.report.context import Context, study_order
from benchctl.report.figures import _figure, _style, _title
from benchctl.report.fmt import fnum, fpm, md_table, missing, nan, need
from benchctl.report.frames import Frames
from benchctl.stages.judge.frames import JUDGE_COLUMNS, JudgeGroup, judge_groups_of


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
            los = np.array([nan(getattr(row, f"{c}_lo")) for c in JUDGE_COLUMNS])
            his = np.array([nan(getattr(row, f"{c}_hi")) for c in JUDGE_COLUMNS])
            ax.bar(
                x,
                means,
                width=width * 0.95,
                color=ctx.colours[row.model],
                edgecolor="black",
                linewidth=0.5,
                label=f"{row.model} ({row.average_n})",
                zorder=2,
            )
            ok = ~np.isnan(los)
            if ok.any():
                ax.errorbar(
                    x[ok],
                    means[ok],
                    yerr=[means[ok] - los[ok], his[ok] - means[ok]],
                    fmt="none",
                    color="black",
                    capsize=3,
                    linewidth=1,
                    zorder=3,
                )
        ax.set_xticks(range(len(JUDGE_COLUMNS)))
        ax.set_xticklabels([c if c != "average" else "average" for c in JUDGE_COLUMNS])
        ax.set_ylabel("judge grade (1–10)")
        ax.set_xlabel("criterion")
        top = max(
            float(v)
            for r in t.itertuples()
            for c in JUDGE_COLUMNS
            for v in (getattr(r, f"{c}_hi"), getattr(r, f"{c}_mean"))
            if not missing(v)
        )
        ax.set_ylim(0, min(10.0, math.ceil(top) + 1.0))  # bars start at 0; the top follows the data (scale 1–10)
        ax.legend(
            fontsize=9,
            frameon=True,
            title="model (n = graded samples)",
            title_fontsize=9,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
        _title(
            ax,
            "Judge grades per criterion",
            [f"judge {jg.judge_model} · preset {ctx.preset} · bar = mean over graded samples, error bar = 95% CI"],
        )
        ax.grid(axis="x", visible=False)
    return fig


def _ci_words(jg: JudgeGroup) -> str:
    """What the table's intervals are over: seeds (the unit for architectures) or one seed's samples."""
    seeds = sorted({int(n) for n in jg.table["seeds"]}) if not jg.table.empty else []
    if seeds and seeds[0] >= 2:
        n = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
        return (
            f"t-interval over the {n} seeds' means (each seed's mean over its graded samples): seeds, not "
            "prompts, are the independent units behind a claim about an architecture."
        )
    if seeds and seeds[-1] < 2:
        return (
            "t-interval over the graded samples of one seed: it describes these trained models only, since one "
            "seed cannot separate the architecture from the initialization."
        )
    return (
        "t-interval over the seeds' means for models with two or more seeds, over the graded samples for a "
        "model with one seed (about that trained model only)."
    )


def judge_section(frames: Frames) -> list[str]:
    ctx, groups = frames.ctx, judge_groups_of(frames)
    out = ["## Judge", ""]
    if not groups:
        return out + need(
            "No judge grades: `benchctl sample` then `benchctl judge --model gemini-2.5-flash` "
            "(needs GEMINI_API_KEY), or `--model openai:<name>` for an OpenAI-compatible server, produce them."
        )
    for gi, jg in enumerate(groups):
        settings = ", ".join(f"{k}={'-' if v is None else v}" for k, v in jg.settings.items())
        primary = " (primary: used in Comparisons)" if gi == 0 and len(groups) > 1 else ""
        out.append(f"### {jg.judge_model} · {jg.protocol} · prompt {jg.prompt_hash[:12]}{primary}")
        out.append("")
        out.append(
            f"Judge model `{jg.judge_model}`, protocol `{jg.protocol}`, grading prompt hash `{jg.prompt_hash}`, "
            f"sampling {settings}. Judge: {jg.identity()}."
        )
        out.append("")
        headers = ["model", "samples", "graded", "failed"] + list(JUDGE_COLUMNS)
        rows = [
            [r["model"], r["samples"], r["graded"], r["failed"]]
            + [fpm(r[f"{c}_mean"], r[f"{c}_lo"], r[f"{c}_hi"]) for c in JUDGE_COLUMNS]
            for r in jg.table.to_dict("records")
        ]
        out += md_table(headers, rows, right=range(1, len(headers))) + [""]
        out.append(
            f"Grades 1–10; mean ± 95% CI half-width, {_ci_words(jg)} Each sample's repeats are averaged "
            "first. failed = grade requests stored as failures (unparseable, truncated, blocked, out of "
            "range or without the assessment the protocol asks for), never counted as scores."
        )
        out.append("")
        if gi == 0:
            f = fig_judge(ctx, jg)
            if f is not None:
                frames.figures["judge_grades.png"] = f
                out += ["![Judge grades per criterion](figures/judge_grades.png)", ""]
    out.append(f"The study's grades ({paper.JUDGE_MODEL}, paper preset, one run per model, no CI):")
    out.append("")
    rows = [[a] + [fnum(paper.JUDGE[a][c], 2) for c in JUDGE_COLUMNS] for a in study_order(paper.JUDGE)]
    out += md_table(["model"] + list(JUDGE_COLUMNS), rows, right=range(1, 6)) + [""]
    return out
