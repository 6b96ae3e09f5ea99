"""Does problem generation keep up with training? The data side's token rate against a training step's, per task.

    python benchmarks/task_data_rate.py [--preset small] [--archs control] [--tasks addition,sum] [--steps 5]

For each task and architecture, in one process on this machine: the time `TaskSampler.next_batch` takes to make one
micro-batch of the preset (draw the problems, encode them, mask the targets, build the tensors: exactly what a
training run does between steps), and the time of one training step of that model on such a batch
(`benchctl.stages.train.engine.step_seconds`: forward and backward of every micro-batch, eager, as `train` runs at
the preset). Both are turned into tokens per second at the training sequence length; the ratio says how many times
faster the data side is. The control is the fastest model per step, so it is the hardest case. Prints a markdown
table; one thread, like a training job beside another on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tasks
from benchctl.core import taskdata
from benchctl.core.config import make_config
from benchctl.core.telemetry import device_name
from benchctl.stages.train.engine import step_seconds


def data_seconds(cfg, repeats: int) -> float:
    """Median wall seconds of one micro-batch of problems, as the run's sampler makes it."""
    task = taskdata.build_task(cfg.task)
    sampler = taskdata.TaskSampler(task, cfg.train_seq_len, cfg.train.batch_size, seed=0, loss=cfg.task.loss)
    sampler.next_batch()  # the hash prefix and any per-level cache
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler.next_batch()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * cfg.train.grad_accum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--archs", default="control")
    ap.add_argument("--tasks", default=",".join(tasks.names()))
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (median of 3 inside) per row")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"device: {device_name(torch.device('cpu'))}, torch {torch.__version__}, 1 thread, preset {args.preset}\n")
    print("| task | arch | batch x length | data ms/batch | step ms | data tokens/s | step tokens/s | data / step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.tasks.split(","):
        for arch in args.archs.split(","):
            cfg = make_config(args.preset, arch, overrides={"task.name": name})
            tokens = cfg.tokens_per_step
            data = data_seconds(cfg, 20)
            step = statistics.median(step_seconds(cfg) for _ in range(args.steps))
            print(
                f"| {name} | {arch} | {cfg.train.batch_size * cfg.train.grad_accum} x {cfg.train_seq_len} "
                f"| {1000 * data:.1f} | {1000 * step:.1f} | {tokens / data:,.0f} | {tokens / step:,.0f} "
                f"| {step / data:.1f}x |"
            )


if __name__ == "__main__":
    main()
