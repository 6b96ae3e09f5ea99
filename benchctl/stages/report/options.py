"""What `benchctl report` (and the study's report stage) can be asked for: one frozen `ReportOptions`, checked when
built.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchctl.core.errors import ConfigError

FORMATS = ("md",)  # markdown with PNG figures


@dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """Everything one `benchctl report` decides: where report.md and its figures go, which preset it reports (None:
    the one with most finished runs), and the plan whose variant names name the models (with `only_plan`, the plan's
    runs alone)."""

    out_dir: Path = Path("reports")
    preset: str | None = None
    plan: str | None = None
    only_plan: bool = False
    format: str = "md"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(
                f"--format {self.format!r} is not supported; the only format is 'md' (markdown with PNG figures)"
            )
        object.__setattr__(self, "out_dir", Path(self.out_dir))
