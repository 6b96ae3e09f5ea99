"""Stage `depth`: validation loss of every finished run against inference depth, and with the adaptive exit.

Runs after eval. It measures the default depth sweep (1, 2, 4, 8, 16, 32) and the kl exit at the default thresholds
(at the tiny preset, a smoke run, the short sweep `for_study` declares; rows already stored are skipped, so a rerun
costs nothing). On the paper preset this takes long on a CPU, so the
stage only prints the estimated time (from one timed batch) and the command that measures it; the report section
shows whatever rows exist.
"""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only, unless_skipped
from benchctl.stages.depth import engine as depth
from benchctl.stages.depth.options import for_study
from benchctl.stages.depth.report import FIGURES, depth_section
from benchctl.stages.depth.tables import TABLES, browse_queries


def run(study: StudyRun) -> None:
    ids = study.run_ids
    if study.skips("depth") or not ids:
        study.say("skipped" + ("" if ids else " (no finished runs)"))
        return
    if story_only(study):
        return
    if study.opts.preset == "paper":
        secs = depth.estimate_seconds(study.db, study.opts.db_path, ids)
        study.say(
            f"off by default on the paper preset (estimated {secs / 60:.0f} min for the fixed-depth sweep on "
            f"this machine); run 'benchctl depth --preset paper' and 'benchctl depth --preset paper --exit kl'"
        )
        return
    study.say("validation loss against inference depth, and with the adaptive exit")
    for exit_rule in (None, "kl"):
        opts = for_study(study.opts.preset, RunSelection(run_ids=ids), exit_rule)
        s = depth.depth_all(study.db, study.opts.db_path, opts, progress=study.opts.progress)
        study.log(
            f"   {'exit kl' if exit_rule else 'fixed depths'}: {len(s.rows)} row(s) measured, "
            f"{s.skipped} already stored"
        )


STAGE = Stage(
    name="depth",
    order=55,
    run=run,
    tables=TABLES,
    queries=browse_queries,
    sections=(depth_section,),
    figures=FIGURES,
    skippable=True,
    reads_weights=unless_skipped("depth"),
)
