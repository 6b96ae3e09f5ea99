"""`benchctl ARGS` in a fresh interpreter, and which heavy libraries it imported: how tests check that a command
stays light (a listing, an early error) without timing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "matplotlib", "seaborn", "pandas", "scipy", "sqlite_utils", "architectures", "lm_eval", "datasets")


@dataclass(frozen=True)
class Ran:
    code: int  # the exit code
    out: str
    err: str
    heavy: list[str]  # the modules of HEAVY the command imported


def run_main(argv: list[str], env: dict[str, str] | None = None, columns: int = 80) -> Ran:
    """benchctl.cli.main(argv) in its own process, on a terminal `columns` wide."""
    script = f"""
import json, sys
from benchctl.cli import main
try:
    main({argv!r})
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
sys.stdout.flush()
print("\\nLOADED=" + json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]), file=sys.stderr)
"""
    full = {
        **os.environ,
        "COLUMNS": str(columns),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    for name in ("BENCHCTL_DB", "BENCHCTL_DATA"):
        if name not in (env or {}):
            full.pop(name, None)
    argv_ = [sys.executable, "-c", script]
    res = subprocess.run(argv_, cwd=REPO, env=full, capture_output=True, text=True, timeout=300)
    err, _, tail = res.stderr.rpartition("\nLOADED=")
    assert tail, res.stderr
    code, heavy = json.loads(tail)
    return Ran(code, res.stdout, err, heavy)
