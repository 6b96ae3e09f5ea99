"""`benchctl bench --record DIR`: the measurement as a dated markdown file, `<preset>_<hardware>_<date>.md`.

A speed figure is only worth quoting with what produced it, so the file carries the machine, the exact code (commit,
and whether the tree had uncommitted changes), the command line, the load during the repeats and the bench id of
its rows in results.db, beside the same table and notes the terminal shows. Files are never overwritten: a second
measurement on the same day gets its own name.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import benchctl
from benchctl.core.errors import ConfigError

REPO = Path(benchctl.__file__).resolve().parents[1]


def code_version(repo: Path = REPO) -> str:
    """The commit the measured code came from, marked when the tree differed from it; the package version when
    benchctl does not run from a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"benchctl {benchctl.__version__} (not a git checkout)"
    return f"`{head}`" + (" with uncommitted changes" if dirty else "") + f" (benchctl {benchctl.__version__})"


def hardware_slug(device_name: str) -> str:
    """A file-name-safe name of the device: 'Intel(R) Xeon(R) Processor (2 cores, 2 threads)' -> 'intel-xeon-2core',
    'NVIDIA A100-SXM4-80GB' -> 'nvidia-a100-sxm4-80gb'."""
    cores = re.search(r"\((\d+) cores?", device_name)
    name = re.sub(r"\(.*?\)|\b(processor|cpu|with radeon graphics)\b|@.*", " ", device_name, flags=re.I)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"
    return f"{slug}-{cores.group(1)}core" if cores else slug


def target(directory: Path, preset: str, device_name: str, today: dt.date) -> Path:
    """The file a measurement goes to: a new name, never one that exists."""
    stem = f"{preset}_{hardware_slug(device_name)}_{today.isoformat()}"
    path = directory / f"{stem}.md"
    n = 2
    while path.exists():
        path = directory / f"{stem}_{n}.md"
        n += 1
    return path


def render(
    objs: list[dict],
    preset: str,
    heads: Sequence[str],
    rows: Sequence[Sequence[str]],
    notes: Sequence[str],
    command: str,
    version: str,
    when: dt.datetime,
    decode: bool = False,
) -> str:
    o0 = objs[0]
    what = "Generation (decode)" if decode else "Training step"
    lines = [
        f"# {what}, preset `{preset}`: {', '.join(dict.fromkeys(o['arch'] for o in objs))}",
        "",
        f"- Date: {when:%Y-%m-%d %H:%M} UTC. Device: {o0['device_name']}; torch threads {o0['threads']}.",
        f"- Code: {version}.",
        f"- Command: `{command}`",
        f"- Bench id `{o0['bench_id']}` (its rows are in the `bench` table of the results database).",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "|".join("---" if h in ("arch", "dtype", "impl") else "---:" for h in heads) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def write(
    directory: Path,
    objs: list[dict],
    preset: str,
    heads: Sequence[str],
    rows: Sequence[Sequence[str]],
    notes: Sequence[str],
    argv: list[str] | None = None,
    decode: bool = False,
) -> Path:
    """Write the measurement under `directory` (created if missing) and return the file's path."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--record {directory}: not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--record {directory}: cannot create it ({e.strerror})") from None
    when = dt.datetime.now(dt.timezone.utc)
    command = "benchctl " + shlex.join(sys.argv[1:] if argv is None else argv)
    name = f"{preset}-decode" if decode else preset
    path = target(directory, name, objs[0]["device_name"], when.date())
    path.write_text(render(objs, preset, heads, rows, notes, command, code_version(), when, decode))
    return path
