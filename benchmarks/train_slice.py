"""How fast do small models train? A fixed slice of the IsoFLOP grid, trained by two checkouts in turn.

    python benchmarks/train_slice.py --data DIR [--before REF] [--after PATH] [--jobs 2]
                                     [--budgets 2.2e11,4.4e11] [--widths 8,16] [--seeds 0]

The IsoFLOP plan trains 270 small models; at these widths a step is bound by per-op overhead, not FLOPs, so the
plan's wall time is what any speed-up of small-model training has to move. This script writes the built-in
`isoflop` plan with its variants (every architecture, `batch_size=4`) on fewer budgets and widths, then, for each
checkout, runs `benchctl study --plan SLICE --preset small --jobs N --no-bench` with every skippable stage skipped,
in a fresh folder with a fresh cache (a compile cache warm from an earlier run would flatter whichever ran second),
and times the whole command. `--before` is a git ref checked out into a temporary worktree (default `HEAD`); `--after`
is a checkout's path (default this one, uncommitted changes included).

Prints a markdown table: per checkout the wall and CPU time of the command, the train stage's own wall time (from
the study's summary; the command also prepares the data and writes the report), the runs done, and the sum of the
runs' own training seconds; then, per run id both trained, whether the final validation loss is the same (a
speed-up that keeps the run ids must keep the numbers). Run it on an idle machine; the default slice takes tens of
minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = "sample,judge,eval,accuracy,depth,infer"  # what study lets one skip; prepare and report still run


def slice_plan(budgets: list[float], widths: list[int], seeds: list[int]) -> str:
    """The built-in isoflop plan's text with its grid replaced (its variants and settings kept)."""
    plan = tomllib.loads((REPO / "benchctl" / "plans" / "isoflop.toml").read_text())
    lines = [
        'name = "isoflop-slice"',
        'description = "a slice of the isoflop plan: every architecture, fewer widths and budgets"',
        'kind = "isoflop"',
        'preset = "small"',
        f"seeds = {seeds}",
        f"budgets = [{', '.join(repr(float(b)) for b in budgets)}]",
        f"widths = {widths}",
        f"head_dim = {plan['head_dim']}",
        f"max_epochs = {plan['max_epochs']}",
    ]
    for v in plan["variant"]:
        sets = ", ".join(f'"{s}"' for s in v.get("set", []))
        lines += ["", "[[variant]]", f'name = "{v["name"]}"', f'arch = "{v["arch"]}"', f"set = [{sets}]"]
    return "\n".join(lines) + "\n"


def run_checkout(tree: Path, plan: Path, data: str, jobs: int, work: Path) -> dict:
    """`benchctl study` of the slice with `tree`'s code, in `work`: wall and CPU seconds, and the runs it stored."""
    work.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "BENCHCTL_CACHE": str(work / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
    }
    env.pop("BENCHCTL_DB", None)
    argv = [sys.executable, "-m", "benchctl.cli", "study", "--plan", str(plan), "--preset", "small"]
    argv += ["--jobs", str(jobs), "--skip", SKIP, "--no-bench", "--data", data, "--no-progress", "-y"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (work / "study.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
        sys.exit(f"{tree}: benchctl study exited {res.returncode}:\n{tail}")
    con = sqlite3.connect(work / "results" / "results.db")
    runs = {r[0]: r[1:] for r in con.execute("select id, status, final_val_loss, train_seconds from runs")}
    con.close()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    stage = re.search(r"stages \(wall, CPU\):.*?\btrain (\d+) s", res.stdout)
    return {"wall": wall, "cpu": cpu, "train": float(stage.group(1)) if stage else float("nan"), "runs": runs}


def commit_of(tree: Path) -> str:
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return rev.stdout.strip() + (" + changes" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="TinyStories text: a directory with train.txt and valid.txt")
    ap.add_argument("--before", default="HEAD", help="git ref of the code to compare against (default HEAD)")
    ap.add_argument("--after", default=str(REPO), help="path of the checkout to measure (default this one)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--budgets", default="2.2e11,4.4e11")
    ap.add_argument("--widths", default="8,16")
    ap.add_argument("--seeds", default="0")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    data = str(Path(args.data).resolve())

    with tempfile.TemporaryDirectory(prefix="train-slice-") as tmp:
        root = Path(tmp)
        plan = root / "slice.toml"
        plan.write_text(slice_plan(budgets, widths, seeds))
        before_tree = root / "before"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(before_tree), args.before], check=True
        )
        try:
            trees = {"before": before_tree, "after": Path(args.after).resolve()}
            commits = {name: commit_of(tree) for name, tree in trees.items()}
            results = {
                name: run_checkout(tree, plan, data, args.jobs, root / f"work-{name}") for name, tree in trees.items()
            }
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before_tree)], check=False)

    print(f"slice: budgets {budgets}, widths {widths}, seeds {seeds}, --jobs {args.jobs}, preset small\n")
    print("| code | commit | wall (s) | CPU (s) | train stage wall (s) | runs done | sum of runs' train_seconds |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        done = [v for v in r["runs"].values() if v[0] == "done"]
        train = sum(v[2] or 0.0 for v in done)
        cells = [name, f"`{commits[name]}`", f"{r['wall']:.0f}", f"{r['cpu']:.0f}", f"{r['train']:.0f}"]
        cells += [f"{len(done)} of {len(r['runs'])}", f"{train:.0f}"]
        print("| " + " | ".join(cells) + " |")
    b, a = results["before"], results["after"]
    print(
        f"\nspeed-up, before / after: command {b['wall'] / a['wall']:.2f}x, train stage {b['train'] / a['train']:.2f}x"
    )
    common = sorted(set(b["runs"]) & set(a["runs"]))
    same = [rid for rid in common if b["runs"][rid][1] == a["runs"][rid][1]]
    print(f"run ids in both: {len(common)} of {len(b['runs'])} and {len(a['runs'])}; same final val loss: {len(same)}")
    for rid in common:
        if rid not in same:
            print(f"  {rid}: {b['runs'][rid][1]!r} before, {a['runs'][rid][1]!r} after")


if __name__ == "__main__":
    main()
