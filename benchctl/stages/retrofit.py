"""Stage `retrofit`: its report section only. Retrofitted runs are made on request (`benchctl retrofit`, or a plan
that lists them), never by the study's default sweep, so the stage has nothing to run; its section appears once
such runs exist: loss after conversion per init method, and compute (parent included) against training the same
architecture from scratch."""

from __future__ import annotations

from benchctl.report.sections.retrofit import FIGURE, retrofit_section
from benchctl.stages import Stage

STAGE = Stage(name="retrofit", order=25, run=None, sections=(retrofit_section,), figures=(FIGURE,))
