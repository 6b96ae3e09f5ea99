"""How long `benchctl runs` takes on a 50-run results database, from the shell's point of view.

    python benchmarks/cli_runs_speed.py [--repeats 9] [--repo PATH ...]

Builds a results.db of 50 runs in a temporary folder (tests/fixtures_db.py: 8 architectures x 6 seeds done, one
failed, one running), then runs `python -m benchctl runs --db DB` in a fresh process `--repeats` times for each
checkout given with `--repo` (default: this one), one checkout after the other in turns, so that a change in the
machine's load falls on all of them alike. Each process gets an 80-column terminal (COLUMNS=80), writes its output to
a pipe, and reads bytecode caches kept in a temporary folder (written by one untimed run first), as an installed
benchctl would, even where PYTHONDONTWRITEBYTECODE is set. Wall time is what a user waits; CPU time (user + system,
of the process and its children) is what the command costs, and depends far less on other load on a shared machine.
`python -c pass` is timed the same way, as the floor any command pays. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ARCHS = ("control", "frailt", "three-part", "relaxed", "ut-act", "mor", "shared-cycle", "huginn")
SEEDS = range(6)


def build_db(path: Path) -> int:
    """The 50-run database; returns its number of runs."""
    sys.path[:0] = [str(HERE), str(HERE / "tests")]  # this checkout's code writes it, whichever benchctl is installed
    from fixtures_db import build_fixture_db  # the tests' realistic results.db

    build_fixture_db(path, preset="small", archs=ARCHS, seeds=SEEDS, judge=False, evals=False, curves=False)
    conn = sqlite3.connect(path)
    n = conn.execute("select count(*) from runs").fetchone()[0]
    conn.close()
    return int(n)


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, capture_output=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def commit_of(repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    return (out.stdout.strip() or "?") + (" (uncommitted changes)" if dirty.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--repo", type=Path, action="append", help="a benchctl checkout whose code to time (repeatable; default: this)"
    )
    args = ap.parse_args()
    repos = [r.resolve() for r in (args.repo or [HERE])]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "results.db"
        n = build_db(db)
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "BENCHCTL_DB")}
        base.update(COLUMNS="80", OMP_NUM_THREADS="1")
        cases = [("`python -c pass`", [sys.executable, "-c", "pass"], dict(base))]
        for i, repo in enumerate(repos):
            env = {**base, "PYTHONPATH": str(repo), "PYTHONPYCACHEPREFIX": str(Path(tmp) / f"pycache{i}")}
            cases.append((f"`benchctl runs` at {commit_of(repo)}", [sys.executable, "-m", "benchctl", "runs"], env))
        # run from the temporary folder: `python -m` puts the working directory first on the path, and a checkout
        # there would be imported whatever PYTHONPATH says
        for _, argv, env in cases:  # writes the bytecode caches
            full = [*argv, "--db", str(db)] if "benchctl" in argv else argv
            subprocess.run(full, env=env, cwd=tmp, capture_output=True, check=True)
        times: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in cases}
        for _ in range(args.repeats):
            for label, argv, env in cases:
                times[label].append(timed([*argv, "--db", str(db)] if "benchctl" in argv else argv, env, tmp))
    print(f"{n} runs in results.db; {args.repeats} repeats each, in turns; load average {os.getloadavg()[0]:.2f}\n")
    print("| command | wall median (s) | wall min (s) | wall max (s) | CPU median (s) |")
    print("|---|---:|---:|---:|---:|")
    for label, samples in times.items():
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        print(
            f"| {label} | {statistics.median(walls):.2f} | {min(walls):.2f} | {max(walls):.2f} "
            f"| {statistics.median(cpus):.2f} |"
        )


if __name__ == "__main__":
    main()
