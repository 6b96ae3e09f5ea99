"""--executor ray on a real local Ray cluster (2 CPUs, shared by the tests of this module): the same runs as local
training, the driver alone writing results.db, a rerun skipping done runs, and a worker killed mid-run retried by Ray
and resumed from its checkpoint. Plus the errors that need no cluster."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from benchctl.core import checkpoint as ckpt
from benchctl.core.errors import ConfigError
from benchctl.stages.train import sweep
from benchctl.stages.train.executors import RunSpec
from benchctl.stages.train.executors import ray as ray_exec
from benchctl.stages.train.options import TrainOptions

ray = pytest.importorskip("ray")


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (starting one takes several seconds on two cores)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


def _setup(tmp_path, monkeypatch, tinystories_dir, archs, seeds, overrides=None):
    from benchctl.core import data

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    cfgs = sweep.sweep("tiny", archs, seeds, {**(overrides or {}), "data.source": str(tinystories_dir)})
    return cfgs, data.prepare(cfgs[0].data, cfgs[0].model.vocab_size, progress=False)


def _runs(db_path: Path) -> dict[str, tuple]:
    con = sqlite3.connect(db_path)
    rows = con.execute("select id, status, final_val_loss, initial_val_loss, step from runs").fetchall()
    con.close()
    return {r[0]: r[1:] for r in rows}


def _metrics(db_path: Path) -> list[tuple]:
    con = sqlite3.connect(db_path)
    # the model's numbers; the machine's own (memory, speed) differ between any two processes
    rows = con.execute(
        "select run_id, step, name, value from metrics where name not in "
        "('peak_rss_bytes', 'tokens_per_s') order by run_id, step, name"
    ).fetchall()
    con.close()
    return rows


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'benchctl\[ray\]'"):
        ray_exec.import_ray()


def test_a_worker_that_cannot_see_the_runs_dir_fails_clearly(tmp_path, monkeypatch, tinystories_dir):
    cfgs, prepared = _setup(tmp_path, monkeypatch, tinystories_dir, ["control"], [0])
    spec = RunSpec(1, cfgs[0], "control", "control-x")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ray_exec.MARKER).write_text("another driver's token")
    out = ray_exec.train_in_worker(spec, prepared, str(tmp_path / "runs"), "mine", 1, 1)
    assert out.status == "failed" and "cannot see the runs dir" in out.error
    out = ray_exec.train_in_worker(spec, prepared, str(tmp_path / "elsewhere"), "mine", 1, 1)
    assert out.status == "failed" and str(tmp_path / "elsewhere") in out.error
    assert not (tmp_path / "elsewhere").exists()  # nothing trained into a directory nobody else sees


@pytest.mark.slow
def test_ray_trains_the_same_runs_as_local(cluster, tmp_path, monkeypatch, tinystories_dir):
    """train-all --preset tiny --archs control,frailt --seeds 0,1 --executor ray: 4 done runs in results.db, the
    same ids, losses and metric rows as the runs trained locally (one thread each in both)."""
    cfgs, prepared = _setup(tmp_path, monkeypatch, tinystories_dir, ["control", "frailt"], [0, 1])
    local_db, ray_db = tmp_path / "local" / "results.db", tmp_path / "ray" / "results.db"
    sweep.train_all(cfgs, prepared, local_db, progress=False, log=_quiet)
    lines: list[str] = []
    res = sweep.train_all(cfgs, prepared, ray_db, progress=False, log=lines.append, opts=TrainOptions(executor="ray"))
    assert len(res.done) == 4 and not res.failed
    assert _runs(ray_db) == _runs(local_db)
    assert all(status == "done" for status, *_ in _runs(ray_db).values())
    assert _metrics(ray_db) == _metrics(local_db)
    for rid in res.done:  # the worker's files in the runs dir; the checkpoint where later stages look
        assert (ray_db.parent / "runs" / rid / ray_exec.ROWS_DB).is_file()
        assert (ckpt.run_dir(ray_db, rid) / ckpt.CKPT_NAME).is_file()
    assert any("on Ray: 1 CPU(s) each, up to 2 at a time" in ln for ln in lines)

    again = sweep.train_all(cfgs, prepared, ray_db, progress=False, log=_quiet, opts=TrainOptions(executor="ray"))
    assert sorted(again.skipped) == sorted(res.done) and not again.done


@pytest.mark.slow
def test_a_killed_worker_is_retried_and_resumes(cluster, tmp_path, monkeypatch, tinystories_dir):
    """SIGKILL to the worker process after its first checkpoint: Ray retries the task, the run resumes from that
    checkpoint and ends as the uninterrupted local run does, bit for bit."""
    overrides = {"train.max_steps": 60, "train.ckpt_interval": 5, "train.eval_interval": 20}
    cfgs, prepared = _setup(tmp_path, monkeypatch, tinystories_dir, ["control"], [0], overrides)
    local_db, ray_db = tmp_path / "local" / "results.db", tmp_path / "ray" / "results.db"
    sweep.train_all(cfgs, prepared, local_db, progress=False, log=_quiet)
    rid = next(iter(_runs(local_db)))
    killed: list[int] = []
    threading.Thread(
        target=_kill_after_checkpoint, args=(ray_db.parent / "runs" / rid / ray_exec.ROWS_DB, killed), daemon=True
    ).start()
    res = sweep.train_all(cfgs, prepared, ray_db, progress=False, log=_quiet, opts=TrainOptions(executor="ray"))
    assert killed, "the worker finished before it could be killed; make the run longer"
    assert res.done == [rid] and res.resumed[rid] >= 5
    assert _runs(ray_db)[rid][:3] == _runs(local_db)[rid][:3]  # status, final and initial loss
    assert _metrics(ray_db) == _metrics(local_db)  # no duplicated or missing rows across the two attempts


def _kill_after_checkpoint(rows_db: Path, killed: list[int], timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if rows_db.exists():
            try:
                con = sqlite3.connect(rows_db, timeout=1)
                row = con.execute("select step, pid from runs").fetchone()
                con.close()
            except sqlite3.OperationalError:
                row = None
            if row and (row[0] or 0) >= 5 and row[1]:
                os.kill(row[1], signal.SIGKILL)
                killed.append(row[1])
                return
        time.sleep(0.05)
