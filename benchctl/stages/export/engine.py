"""Export many finished runs at once (the study's export stage), resumably.

Each export is written into `<run id>.partial` beside its final folder and renamed once complete, so a folder under
its final name is a complete export: a rerun leaves it alone, and one interrupted half-way is redone from scratch.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchctl.stages.export.options import ExportAllOptions


@dataclass
class ExportAllSummary:
    written: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # complete from an earlier run
    # (architecture, format) -> its runs, for a format the architecture does not declare
    undeclared: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (run id, why): a run its format cannot hold


def export_dir(out_dir: Path, fmt: str, run_id: str) -> Path:
    return Path(out_dir) / fmt / run_id


def export_all(db: Any, db_path: Path, opts: ExportAllOptions, log: Callable[[str], None] = print) -> ExportAllSummary:
    """Export every selected finished run in every format its architecture declares; one log line per export."""
    import architectures
    from benchctl.core.errors import ConfigError
    from benchctl.export import export_run
    from benchctl.export.llama import export_formats
    from benchctl.stages.train import tables as train_tables

    sel = opts.select
    rows = train_tables.finished_runs(
        db, run_ids=sel.run_ids, archs=sel.archs, preset=sel.preset, purpose="to export", kind="stories"
    )
    summary = ExportAllSummary()
    for row in rows:
        declared = export_formats(architectures.get(row["arch"]))
        for fmt in opts.formats:
            if fmt not in declared:
                summary.undeclared.setdefault((row["arch"], fmt), []).append(row["id"])
                continue
            final = export_dir(opts.out_dir, fmt, row["id"])
            if final.is_dir():
                summary.skipped.append(final)
                continue
            partial = final.with_name(final.name + ".partial")
            if partial.exists():  # left by an interrupted export: its files may be half-written
                shutil.rmtree(partial)
            partial.parent.mkdir(parents=True, exist_ok=True)
            try:
                export_run(db, db_path, row["id"], fmt, partial)
            except ConfigError as e:  # e.g. a run llama2.c's run.c cannot reproduce
                shutil.rmtree(partial, ignore_errors=True)
                summary.refused.append((row["id"], str(e)))
                log(f"   {row['id']}: not exported as {fmt}: {e}")
                continue
            os.replace(partial, final)
            summary.written.append(final)
            log(f"   {row['id']} -> {final}")
    said: set[str] = set()
    for (arch, fmt), ids in summary.undeclared.items():
        declared = export_formats(architectures.get(arch))
        if not declared and arch not in said:  # one line per architecture, whatever the formats asked
            log(f"   {arch}: declares no export format; its {len(ids)} run(s) skipped")
        elif declared:
            log(f"   {arch}: exports to {', '.join(declared)} only; its {len(ids)} run(s) not written as {fmt}")
        said.add(arch)
    return summary
