"""Stage `infer`: what each finished run costs and keeps when it generates, per inference setting (full depth, the
adaptive exit under each KV strategy, speculative drafts), beside the teacher-forced loss and the agreement with
full depth; and the latent view of its recurrent state. Its report section, "Inference cost".

Runs after depth, with the default settings and sizes of `InferOptions` (at the tiny preset, a smoke run, the short
set the options declare; rows already stored are skipped, so a rerun costs nothing). On the paper preset generation
over every setting takes long on a CPU, so the stage only prints the command that measures it; the report section
shows whatever rows exist.
"""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only, unless_skipped
from benchctl.stages.infer.options import for_study
from benchctl.stages.infer.report import FIGURES, inference_section
from benchctl.stages.infer.tables import TABLES, browse_queries


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("infer") or not ids:
        study.say("skipped" + ("" if ids else " (no finished runs)"))
        return
    if story_only(study):
        return
    if study.opts.preset == "paper":
        study.say("off by default on the paper preset; run 'benchctl infer --preset paper'")
        return
    from benchctl.stages.infer import engine  # torch: loaded only when the stage runs

    study.say("inference cost per setting, and the latent view")
    opts = for_study(study.opts.preset, RunSelection(run_ids=ids))
    s = engine.infer_all(study.db, study.opts.db_path, opts, progress=study.opts.progress)
    study.log(f"   {len(s.rows)} row(s) measured, {s.skipped} already stored, {s.latents} run(s) traced")
    for run_id, setting, reason in s.unsupported:
        study.log(f"   skipped {setting} for {run_id}: {reason}")


STAGE = Stage(
    name="infer",
    order=58,
    run=run,
    tables=TABLES,
    queries=browse_queries,
    sections=(inference_section,),
    figures=FIGURES,
    skippable=True,
    reads_weights=unless_skipped("infer"),
)
