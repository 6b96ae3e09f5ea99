"""How fast the tasks make training data: problems and tokens per second on one core.

    python benchmarks/task_generation.py [--seconds 2] [--tasks addition,maze]

Times what a training batch needs per row: `problem("train", "id", seed, i)`, the tokenizer's `encode` and
`masked_targets` at the task's `max_len()` (the sequence length a model for the task is built with), in one
process, one row after another. Prints a markdown table: problems/s, real tokens/s (<bos> prompt answer <eos>),
and tokens/s counted at the padded length, the figure to compare with a training step's tokens per second
(batch x sequence length / step time). Generation should run at ten times a step's rate or more, so that drawing
problems on the fly costs a training run under a tenth of its time.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's `tasks`

import tasks  # noqa: E402
from tasks import masked_targets  # noqa: E402


def measure(name: str, seconds: float, seed: int = 0) -> dict[str, float]:
    task = tasks.build(name)
    tok = task.tokenizer()
    seq_len = task.max_len()
    problem, encode = task.problem, tok.encode
    for i in range(200):  # warm the caches (the hash prefix, the maze layouts)
        masked_targets(*encode(problem("train", "id", seed, i)), seq_len)
    n = tokens = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(100):
            ids, answer_start = encode(problem("train", "id", seed, n))
            masked_targets(ids, answer_start, seq_len)
            tokens += len(ids)
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    elapsed = now - start
    return {
        "problems": n / elapsed,
        "tokens": tokens / elapsed,
        "padded": n * seq_len / elapsed,
        "seq_len": seq_len,
        "mean_len": tokens / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="time per task (default 2)")
    ap.add_argument("--tasks", default=",".join(tasks.names()), help="comma-separated task names (default: all)")
    args = ap.parse_args()
    print(f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}, one process\n")
    print("| task | seq_len | mean tokens | problems/s | tokens/s | padded tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.tasks.split(","):
        r = measure(name, args.seconds)
        print(
            f"| {name} | {r['seq_len']:.0f} | {r['mean_len']:.1f} | {r['problems']:,.0f} | {r['tokens']:,.0f} "
            f"| {r['padded']:,.0f} |"
        )


if __name__ == "__main__":
    main()
