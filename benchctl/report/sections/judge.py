"""Report section of the judge stage: grades per criterion and model for each (judge model, grading prompt,
sampling settings) group, with the primary group's figure and the study's published grades."""

from __future__ import annotations

from benchctl import paper
from benchctl.report.context import study_order
from benchctl.report.figures import fig_judge
from benchctl.report.fmt import fnum, fpm, md_table, need
from benchctl.report.frames import JUDGE_COLUMNS, Frames


def judge_section(frames: Frames) -> list[str]:
    ctx, groups = frames.ctx, frames.judge_groups
    out = ["## Judge", ""]
    if not groups:
        return out + need("No judge grades: `benchctl sample` then `benchctl judge --model gemini-2.5-flash` "
                          "(needs GEMINI_API_KEY) produce them.")
    for gi, jg in enumerate(groups):
        settings = ", ".join(f"{k}={'-' if v is None else v}" for k, v in jg.settings.items())
        primary = " (primary: used in Comparisons)" if gi == 0 and len(groups) > 1 else ""
        out.append(f"### {jg.judge_model} · prompt {jg.prompt_hash[:12]}{primary}")
        out.append("")
        out.append(f"Judge model `{jg.judge_model}`, grading prompt hash `{jg.prompt_hash}`, sampling {settings}.")
        out.append("")
        headers = ["model", "samples", "graded", "failed"] + list(JUDGE_COLUMNS)
        rows = [[r["model"], r["samples"], r["graded"], r["failed"]]
                + [fpm(r[f"{c}_mean"], r[f"{c}_lo"], r[f"{c}_hi"]) for c in JUDGE_COLUMNS]
                for r in jg.table.to_dict("records")]
        out += md_table(headers, rows, right=range(1, len(headers))) + [""]
        out.append("Grades 1–10; mean ± 95% CI half-width (t-interval over graded samples, i.e. prompts × seeds, "
                   "each sample's repeats averaged first). failed = grade requests stored as failures "
                   "(unparseable, truncated, blocked or out of range), never counted as scores.")
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
