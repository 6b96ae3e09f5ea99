"""What the study's export stage can be asked for: the formats (`benchctl study --export hf,llama2c`) and the
folder the exports go to.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchctl.core.errors import ConfigError
from benchctl.export import FORMATS, check_installed
from benchctl.stages import RunSelection

EXPORT_SUBDIR = "export"  # beside report.md in the report folder, unless --export-dir says otherwise


def parse_formats(text: str | None) -> tuple[str, ...]:
    """ "hf,llama2c" -> ("hf", "llama2c"); None or "" -> () (no export); a ConfigError naming --export otherwise."""
    found = tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))
    bad = [f for f in found if f not in FORMATS]
    if bad:
        raise ConfigError(f"--export accepts {', '.join(FORMATS)} (a comma list); got {', '.join(bad)}")
    for fmt in found:
        check_installed(fmt, "--export")
    return found


@dataclass(frozen=True)
class ExportAllOptions:
    """Export every run of `select` in each of `formats` to `out_dir/<format>/<run id>/`."""

    select: RunSelection
    formats: tuple[str, ...]
    out_dir: Path

    def __post_init__(self) -> None:
        parse_formats(",".join(self.formats))
