"""Runs as tasks on a Ray cluster (`--executor ray`): each run a task with its CPU (or GPU) resources.

Workers never open results.db: a SQLite file shared by several machines over a network filesystem is not safe
to write. A worker trains with the ordinary engine (benchctl.stages.train.engine.train_run) into a per-run SQLite file,
`<runs dir>/<run id>/rows.db` (the same schema), next to the run's checkpoint; when the task ends, the driver copies
that run's rows into results.db in one transaction (benchctl.core.db.copy_run_rows). The driver alone writes results.db.

The runs dir must be one directory every machine sees at the same path (a shared filesystem). The driver writes a
marker file with a fresh token into it; a worker that cannot read that token is on a machine without the share,
and its run fails with that message instead of training into a directory nobody else sees.

Failures: a worker process that dies (killed, out of memory, its node lost) is retried by Ray (`MAX_RETRIES`), on
any node; the new attempt finds the run's rows.db and checkpoint in the runs dir and resumes from the checkpoint.
A rerun of the whole command skips runs results.db has as done and resumes the others the same way.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchctl import stages
from benchctl.core import checkpoint as ckpt
from benchctl.core import data
from benchctl.core import db as dbm
from benchctl.core.errors import BenchctlError, ConfigError, DataError
from benchctl.stages.train import engine
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.executors import (
    ENV_JOBS,
    ENV_THREADS,
    Execution,
    OnOutcome,
    Outcome,
    RunSpec,
    already_done,
    link_run_dir,
    parse_jobs,
)

ROWS_DB = "rows.db"
MARKER = ".benchctl-runs-dir"
MAX_RETRIES = 3  # attempts after a worker dies (system failures only: a run's own error is its outcome)
WAIT_SECONDS = 5.0


def import_ray() -> Any:
    """Ray, imported only when asked for (it is an optional extra)."""
    try:
        import ray  # optional: pip install 'benchctl[ray]'
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'benchctl[ray]'") from None
    return ray


def rows_path(runs_dir: Path, run_id: str) -> Path:
    return Path(runs_dir) / run_id / ROWS_DB


def open_rows(path: Path) -> dbm.Database:
    """A run's own rows file, in rollback-journal mode: WAL needs shared memory between its users, which processes
    on different machines (the worker that writes it, the driver that reads it) do not have."""
    return stages.connect(path, wal=False)


class RayExecutor:
    """Submits every run not yet done as a Ray task and copies each finished run's rows into results.db."""

    def __init__(
        self, execution: Execution, *, prepared: Any, db_path: Path, db: dbm.Database, log: Callable[[str], None]
    ):
        self.execution, self.prepared, self.db_path, self.db, self.log = execution, prepared, Path(db_path), db, log
        self.runs_dir = Path(execution.runs_dir or ckpt.default_runs_dir(db_path)).resolve()

    def run(self, specs: list[RunSpec], on_outcome: OnOutcome) -> None:
        ray = import_ray()
        todo = []
        for spec in specs:
            if already_done(self.db, self.db_path, self.runs_dir, spec.run_id, self.execution.weights_needed):
                on_outcome(spec, Outcome("skipped"))
            else:
                todo.append(spec)
        if not todo:
            return
        token = self._write_marker()
        started = self._connect(ray)
        try:
            self._run(ray, todo, token, on_outcome)
        finally:
            if started:
                ray.shutdown()

    def _write_marker(self) -> str:
        token = uuid.uuid4().hex
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        (self.runs_dir / MARKER).write_text(token)
        return token

    def _connect(self, ray: Any) -> bool:
        """Join the cluster (or start a local one); True when this call started Ray here (so it shuts it down)."""
        if ray.is_initialized():
            return False
        try:
            ray.init(
                address=self.execution.ray_address, include_dashboard=False, log_to_driver=True, configure_logging=False
            )
        except (ConnectionError, ValueError, RuntimeError) as e:
            where = self.execution.ray_address or os.environ.get("RAY_ADDRESS") or "a new local instance"
            raise BenchctlError(f"cannot start or join the Ray cluster at {where}: {e}") from None
        return True

    def _resources(self, ray: Any, n_runs: int, cfg: Any) -> tuple[int, int, float]:
        """(runs at once, CPUs per run, GPUs per run): a GPU each when the cluster has GPUs (and the config may use
        them); otherwise the cluster's CPUs shared out, never more than the smallest node has."""
        total = ray.cluster_resources()
        if total.get("GPU", 0) >= 1 and cfg.train.device in ("auto", "cuda"):
            gpus = int(total["GPU"])
            return min(n_runs, gpus), 1, 1.0
        cpus = int(total.get("CPU", 1))
        nodes = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        smallest = int(min(nodes)) if nodes else cpus
        jobs = parse_jobs(self.execution.jobs)
        at_once = min(n_runs, cpus if jobs in ("auto", 1) else int(jobs))
        threads = max(1, min(cpus // max(1, at_once), smallest))
        return max(1, min(at_once, cpus // threads)), threads, 0.0

    def _run(self, ray: Any, todo: list[RunSpec], token: str, on_outcome: OnOutcome) -> None:
        at_once, threads, gpus = self._resources(ray, len(todo), todo[0].cfg)
        self.log(
            f"{len(todo)} run(s) on Ray: {threads} CPU(s){' and 1 GPU' if gpus else ''} each, "
            f"up to {at_once} at a time; runs dir {self.runs_dir}"
        )
        task = ray.remote(train_in_worker).options(
            num_cpus=threads, num_gpus=gpus, max_retries=MAX_RETRIES, retry_exceptions=False
        )
        refs: dict[Any, RunSpec] = {}
        for spec in todo:
            self._seed_rows(spec)
            c, n = spec.cfg, spec.of or len(todo)
            self.log(f"[{spec.index}/{n}] {spec.variant} seed {c.seed} (preset {c.preset}) submitted")
            refs[task.remote(spec, self.prepared, str(self.runs_dir), token, threads, at_once)] = spec
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=WAIT_SECONDS)
                for ref in ready:
                    spec = refs.pop(ref)
                    self._finish(spec, self._result(ray, ref), on_outcome)
        finally:
            for ref, spec in refs.items():  # interrupted: stop the tasks, keep what they wrote (resumable)
                ray.cancel(ref, force=True)
                self._take_rows(spec)

    def _result(self, ray: Any, ref: Any) -> Outcome:
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:  # retries exhausted, or the task could not run at all
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return Outcome("failed", f"Ray task failed ({type(e).__name__}: {first}); rerun to resume it")

    def _finish(self, spec: RunSpec, outcome: Outcome, on_outcome: OnOutcome) -> None:
        self._take_rows(spec)
        link_run_dir(self.db_path, self.runs_dir, spec.run_id)
        on_outcome(spec, outcome)

    def _seed_rows(self, spec: RunSpec) -> None:
        """A run results.db already knows (trained, or interrupted, here or by an earlier driver) but without a rows
        file gets one from results.db, so its worker resumes with the run's full history."""
        path = rows_path(self.runs_dir, spec.run_id)
        if path.exists() or train_tables.get_run(self.db, spec.run_id) is None:
            return
        rows = open_rows(path)
        try:
            train_tables.copy_run_rows(self.db, rows, spec.run_id)
        finally:
            rows.close()

    def _take_rows(self, spec: RunSpec) -> None:
        path = rows_path(self.runs_dir, spec.run_id)
        if not path.exists():
            return
        rows = open_rows(path)
        try:
            train_tables.copy_run_rows(rows, self.db, spec.run_id)
        finally:
            rows.close()


def train_in_worker(spec: RunSpec, prepared: Any, runs_dir: str, token: str, threads: int, at_once: int) -> Outcome:
    """A Ray task: train one run into its rows file under the shared runs dir, and report how it ended."""
    runs = Path(runs_dir)
    host = socket.gethostname()
    try:
        seen = (runs / MARKER).read_text().strip()
    except OSError:
        seen = None
    if seen != token:
        return Outcome(
            "failed",
            f"worker on {host} cannot see the runs dir {runs} the driver prepared; mount the "
            "same shared directory at that path on every machine (or pass --runs-dir)",
        )
    os.environ.update(
        {
            ENV_JOBS: str(at_once),
            ENV_THREADS: str(threads),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
        }
    )
    torch.set_num_threads(threads)
    path = rows_path(runs, spec.run_id)
    try:
        here = _prepared_here(spec, prepared)
        db = open_rows(path)
        try:
            r = engine.train_run(
                spec.cfg, here, db, path, progress=False, log=print, variant=spec.variant, runs_dir=runs
            )
        finally:
            db.close()
    except BenchctlError as e:
        return Outcome("failed", str(e))
    return Outcome("skipped" if r.skipped else "done", resumed_from=r.resumed_from)


def _prepared_here(spec: RunSpec, prepared: Any) -> Any:
    """The driver's prepared data when this machine sees its directory; else prepared here from the same settings,
    which must give the same data (its fingerprint is part of the run id)."""
    if Path(prepared.dir).is_dir():
        return prepared
    here = data.prepare(spec.cfg.data, spec.cfg.model.vocab_size, progress=False)
    if here.fingerprint != prepared.fingerprint:
        raise DataError(
            f"the data prepared on {socket.gethostname()} ({here.fingerprint[:12]}) differs from the "
            f"driver's ({prepared.fingerprint[:12]}); give every machine the same data source"
        )
    return here
