"""Stage `export`: every finished run written for other tools (`benchctl study --export hf`), after the report.

Off unless `--export` names formats. The exports go to `export/<format>/<run id>/` in the report folder (or under
`--export-dir`); a complete export is kept on a rerun, and an architecture that declares no export format is skipped
with one line.
"""

from __future__ import annotations

from benchctl.stages import RunSelection, Stage, StudyRun, story_only
from benchctl.stages.export import engine
from benchctl.stages.export.options import EXPORT_SUBDIR, ExportAllOptions


def run(study: StudyRun) -> None:
    formats = study.opts.export
    ids = study.run_ids
    if story_only(study):
        return
    if not formats:
        study.say("off (--export hf writes every finished run as a Hugging Face folder)")
        return
    if not ids:
        study.say("no finished runs")
        return
    out_dir = study.opts.export_dir or study.opts.out_dir / EXPORT_SUBDIR
    study.say(f"{', '.join(formats)} -> {out_dir}")
    opts = ExportAllOptions(select=RunSelection(run_ids=ids), formats=tuple(formats), out_dir=out_dir)
    s = engine.export_all(study.db, study.opts.db_path, opts, log=study.log)
    study.log(f"   {len(s.written)} written, {len(s.skipped)} already complete")


STAGE = Stage(name="export", order=110, run=run, reads_weights=lambda study: bool(study.opts.export))
