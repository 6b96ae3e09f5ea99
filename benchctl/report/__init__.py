"""The study's report from results.db: tables and figures with seeds and statistics, beside the published numbers.

A report is a pure function of the database: load (the only SQL, read-only) -> frames (pure DataFrame
computations) -> sections (markdown) and figures (PNG), with a fixed colour and order per model. The stages' report
sections are built from this package; the report stage (benchctl.stages.report.engine) assembles the sections the
registered stages contribute and writes them.

Rules the output keeps:
- only runs with status `done` enter the statistics; other runs are listed with their status and error;
- runs of one preset whose configs differ (a `--set` override) are different models, never pooled as seeds;
- a missing stage leaves its section with one line naming the command that produces it;
- the same database gives byte-identical markdown: everything sorted, fixed float formats, no "now" timestamps.
"""

from benchctl.report.context import Context, build_context, choose_preset, colours_for
from benchctl.report.figures import FIG_DPI, save_figure
from benchctl.report.frames import Frames
from benchctl.report.load import Data, load, open_db, read

__all__ = [
    "FIG_DPI",
    "Context",
    "Data",
    "Frames",
    "build_context",
    "choose_preset",
    "colours_for",
    "load",
    "open_db",
    "read",
    "save_figure",
]
