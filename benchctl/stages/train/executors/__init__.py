"""How a list of training runs is executed: in this process one after another (the default), in N processes at once
on this machine (`--jobs N`, benchctl.stages.train.executors.local), or as tasks on a Ray cluster (`--executor ray`,
benchctl.stages.train.executors.ray).

Every executor gets the same list of `RunSpec`s and reports one `Outcome` per run, in the driver process, through a
callback; the driver (benchctl.stages.train.sweep.train_all, which also picks the executor) records plan membership
and the summary. Training itself is always `benchctl.stages.train.engine.train_run`, so skipping finished runs and
resuming interrupted ones from their last checkpoint work the same way everywhere.

Threads: a training process uses `threads` intra-op threads (torch, OpenMP, MKL), so N processes on C cores get
C // N each. A small model gains little from a second thread, which is why `--jobs auto` on a CPU runs one job per
core (capped by the number of runs) rather than fewer, wider jobs; on a GPU machine it runs one job per visible GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError

EXECUTORS = ("local", "ray")
AUTO = "auto"
# intra-op threads per run that `--jobs auto` plans for on a CPU (see the module docstring)
AUTO_THREADS_PER_RUN = 1
# environment of every training process started by an executor: how many runs share the machine and with how many
# threads each (recorded with the run, so its speed can be read in context)
ENV_JOBS = "BENCHCTL_CONCURRENT_JOBS"
ENV_THREADS = "BENCHCTL_THREADS"


@dataclass(frozen=True)
class RunSpec:
    """One run to train: its position in the sweep (1-based), config, variant name and run id, and the sweep's size
    (what the messages number against: a resumed sweep hands out only the runs not done, under their own numbers)."""

    index: int
    cfg: RunConfig
    variant: str
    run_id: str
    of: int = 0  # runs in the sweep (0: unknown, the executor's own count)


@dataclass(frozen=True)
class Outcome:
    """How a run ended: done (trained now), skipped (already done) or failed (with the error)."""

    status: str
    error: str | None = None
    resumed_from: int | None = None  # the checkpoint step it resumed from, when it did


OnOutcome = Callable[[RunSpec, Outcome], None]


class Executor(Protocol):
    def run(self, specs: list[RunSpec], on_outcome: OnOutcome) -> None:
        """Train every spec, calling `on_outcome` in this process as each ends. A BenchctlError of one run is its
        outcome; Ctrl-C stops every run (each left resumable) and propagates."""


@dataclass(frozen=True)
class Execution:
    """How `train_all` executes its runs (the command line's --executor, --jobs, --ray-address, --runs-dir)."""

    executor: str = "local"
    jobs: int | str = 1  # a positive number, or "auto"
    ray_address: str | None = None  # None: $RAY_ADDRESS, else a new local Ray instance
    runs_dir: Path | None = None  # None: `<db dir>/runs`
    # whether a run results.db has as done must also have its checkpoint here to count as done: False when nothing
    # after training reads the weights, so a results.db carried to another machine (or kept after its run
    # directories were cleared) goes on from its done runs instead of training them again
    weights_needed: bool = True

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"--executor must be one of {', '.join(EXECUTORS)}; got {self.executor!r}")
        parse_jobs(self.jobs)
        if self.ray_address is not None and self.executor != "ray":
            raise ConfigError("--ray-address needs --executor ray")

    @property
    def in_process(self) -> bool:
        """Today's behaviour: every run in this process, one after another."""
        return self.executor == "local" and parse_jobs(self.jobs) == 1


def parse_jobs(value: int | str) -> int | str:
    """--jobs: a positive number or 'auto'."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--jobs must be a positive number or 'auto'; got {value!r}") from None
    if n < 1:
        raise ConfigError(f"--jobs must be a positive number or 'auto'; got {value!r}")
    return n


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask: a container or `taskset` limit counts, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Slots:
    """N concurrent training processes: the intra-op threads of each, and the GPU each is pinned to (None: CPU)."""

    jobs: int
    threads: int
    gpus: tuple[str, ...] | None = None

    def env(self, slot: int) -> dict[str, str]:
        """The environment of slot `slot`'s process (set before it starts, so torch and OpenMP read it)."""
        env = {
            ENV_JOBS: str(self.jobs),
            ENV_THREADS: str(self.threads),
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
        }
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot % len(self.gpus)]
        return env


def plan_slots(
    jobs: int | str, n_runs: int, device_spec: str = "auto", *, cores: int | None = None, gpus: int | None = None
) -> Slots:
    """How many runs to train at once and with what: `jobs` as given (or 'auto'), never more than the runs.

    On a machine with GPUs (and a config that may use them) every process is pinned to one visible GPU; 'auto' runs
    one per GPU. On a CPU, 'auto' runs one per AUTO_THREADS_PER_RUN cores. Either way the cores are shared evenly."""
    cores = cpu_cores() if cores is None else cores
    if gpus is None:
        import torch  # kept out of 'benchctl --help', which imports this module (the options it checks)

        gpus = torch.cuda.device_count() if device_spec in ("auto", "cuda") and torch.cuda.is_available() else 0
    jobs = parse_jobs(jobs)
    if jobs == AUTO:
        jobs = gpus if gpus else max(1, cores // AUTO_THREADS_PER_RUN)
    n = max(1, min(int(jobs), n_runs))
    visible = _visible_gpus(gpus) if gpus else None
    return Slots(jobs=n, threads=max(1, cores // n), gpus=visible)


def split_evenly(items: list[Any], weights: list[float], n: int) -> list[list[Any]]:
    """`items` in `n` groups of nearly equal total weight (each item, heaviest first, joins the lightest group; the
    groups keep the items' order), for parallel jobs that should end at about the same time. No empty groups."""
    loads = [0.0] * min(n, len(items))
    members: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        g = min(range(len(loads)), key=loads.__getitem__)
        loads[g] += weights[i]
        members[g].append(i)
    return [[items[i] for i in sorted(m)] for m in members]


def _visible_gpus(count: int) -> tuple[str, ...]:
    """The ids to pin processes to: the entries of an existing CUDA_VISIBLE_DEVICES (it may name GPUs by UUID or
    a subset), else 0..count-1."""
    given = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return tuple(given[:count]) if len(given) >= count else tuple(str(i) for i in range(count))


def already_done(db: Any, db_path: Path, runs_dir: Path | None, run_id: str, weights_needed: bool = True) -> bool:
    """results.db has the run as done and, when its weights are needed, its checkpoint is there: no process needs to
    start for it (train_run would skip it the same way)."""
    # torch (checkpoint), sqlite_utils with pandas: kept out of 'benchctl --help', which imports this module
    from benchctl.core import checkpoint as ckpt
    from benchctl.stages.train import tables as train_tables

    row = train_tables.get_run(db, run_id) if db is not None else None
    return (
        row is not None
        and row["status"] == "done"
        and (not weights_needed or (ckpt.run_dir(db_path, run_id, runs_dir) / ckpt.CKPT_NAME).exists())
    )


def link_run_dir(db_path: Path, runs_dir: Path | None, run_id: str) -> None:
    """A run trained under another runs dir is linked at `<db dir>/runs/<run id>`, where sample, eval and depth
    look for checkpoints, so the later stages find it without knowing where it was trained."""
    from benchctl.core import checkpoint as ckpt  # torch: kept out of 'benchctl --help', which imports this module

    if runs_dir is None:
        return
    actual, usual = ckpt.run_dir(db_path, run_id, runs_dir), ckpt.run_dir(db_path, run_id)
    if actual == usual or not actual.is_dir():
        return
    if usual.is_symlink() and usual.resolve() == actual.resolve():
        return
    if usual.is_symlink():
        usual.unlink()
    elif usual.exists():
        return  # a real directory from an earlier local run: left alone (the checkpoint in runs_dir is the newer)
    usual.parent.mkdir(parents=True, exist_ok=True)
    usual.symlink_to(actual, target_is_directory=True)
