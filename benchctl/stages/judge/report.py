"""Report section of the judge stage: grades per criterion and model for each (judge model, protocol and grading
prompt, sampling settings) group, with the primary group's figure and the study's published grades. Groups are
never pooled: a different protocol or prompt version is a different set of grades."""

from __future__ import annotations

from benchctl.core import paper
from benchctl.report.context import study_order
from benchctl.report.figures import fig_judge
from benchctl.report.fmt import fnum, fpm, md_table, need
from benchctl.report.frames import JUDGE_COLUMNS, Frames, JudgeGroup


def _ci_words(jg: JudgeGroup) -> str:
    """What the table's intervals are over: seeds (the unit for architectures) or one seed's samples."""
    seeds = sorted({int(n) for n in jg.table["seeds"]}) if not jg.table.empty else []
    if seeds and seeds[0] >= 2:
        n = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
        return (f"t-interval over the {n} seeds' means (each seed's mean over its graded samples): seeds, not "
                "prompts, are the independent units behind a claim about an architecture.")
    if seeds and seeds[-1] < 2:
        return ("t-interval over the graded samples of one seed: it describes these trained models only, since one "
                "seed cannot separate the architecture from the initialization.")
    return ("t-interval over the seeds' means for models with two or more seeds, over the graded samples for a "
            "model with one seed (about that trained model only).")


def judge_section(frames: Frames) -> list[str]:
    ctx, groups = frames.ctx, frames.judge_groups
    out = ["## Judge", ""]
    if not groups:
        return out + need("No judge grades: `benchctl sample` then `benchctl judge --model gemini-2.5-flash` "
                          "(needs GEMINI_API_KEY) produce them.")
    for gi, jg in enumerate(groups):
        settings = ", ".join(f"{k}={'-' if v is None else v}" for k, v in jg.settings.items())
        primary = " (primary: used in Comparisons)" if gi == 0 and len(groups) > 1 else ""
        out.append(f"### {jg.judge_model} · {jg.protocol} · prompt {jg.prompt_hash[:12]}{primary}")
        out.append("")
        out.append(f"Judge model `{jg.judge_model}`, protocol `{jg.protocol}`, grading prompt hash `{jg.prompt_hash}`, "
                   f"sampling {settings}.")
        out.append("")
        headers = ["model", "samples", "graded", "failed"] + list(JUDGE_COLUMNS)
        rows = [[r["model"], r["samples"], r["graded"], r["failed"]]
                + [fpm(r[f"{c}_mean"], r[f"{c}_lo"], r[f"{c}_hi"]) for c in JUDGE_COLUMNS]
                for r in jg.table.to_dict("records")]
        out += md_table(headers, rows, right=range(1, len(headers))) + [""]
        out.append(f"Grades 1–10; mean ± 95% CI half-width, {_ci_words(jg)} Each sample's repeats are averaged "
                   "first. failed = grade requests stored as failures (unparseable, truncated, blocked, out of "
                   "range or without the assessment the protocol asks for), never counted as scores.")
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
