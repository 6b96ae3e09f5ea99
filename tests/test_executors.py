"""Executors on one machine: how --jobs shares the machine, N spawned training processes giving the same runs as one
process, their progress lines, a runs dir of its own, copying a run's rows, and a kill of the parent leaving every
run resumable."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from benchctl import stages
from benchctl.cli import main
from benchctl.core import accounting
from benchctl.core.config import make_config
from benchctl.core.errors import ConfigError
from benchctl.core.progress import Progress
from benchctl.stages.train import executors, sweep
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.executors import Execution, RunSpec, plan_slots
from benchctl.stages.train.executors.local import ProcessPool, _RemoteProgress
from benchctl.stages.train.options import TrainOptions

REPO = Path(__file__).resolve().parents[1]
SHORT = {"train.max_steps": 6, "train.eval_interval": 3, "train.ckpt_interval": 3, "train.warmup_steps": 1}


def run_cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _losses(db_path: Path) -> dict[str, tuple[str, float]]:
    con = sqlite3.connect(db_path)
    rows = con.execute("select id, status, final_val_loss from runs").fetchall()
    con.close()
    return {r[0]: (r[1], r[2]) for r in rows}


def _prepared(tmp_path, monkeypatch, tinystories_dir, overrides=SHORT):
    from benchctl.core import data

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    cfgs = sweep.sweep("tiny", ["control", "frailt"], [0], {**overrides, "data.source": str(tinystories_dir)})
    return cfgs, data.prepare(cfgs[0].data, cfgs[0].model.vocab_size, progress=False)


# ---- planning -------------------------------------------------------------------------------------------------------


def test_jobs_share_the_cores_and_never_exceed_the_runs():
    assert plan_slots(2, 4, cores=2, gpus=0) == executors.Slots(jobs=2, threads=1)
    assert plan_slots(3, 2, cores=8, gpus=0) == executors.Slots(jobs=2, threads=4)  # 2 runs: 2 jobs, 4 threads
    assert plan_slots(1, 4, cores=8, gpus=0).threads == 8
    # auto on a CPU: one job per core (a small model gains little from a second thread), capped by the runs
    assert plan_slots("auto", 12, cores=4, gpus=0) == executors.Slots(jobs=4, threads=1)
    assert plan_slots("AUTO", 3, cores=16, gpus=0) == executors.Slots(jobs=3, threads=5)


def test_auto_on_a_gpu_machine_runs_one_job_per_gpu_each_pinned(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slots = plan_slots("auto", 12, cores=16, gpus=4)
    assert (slots.jobs, slots.threads, slots.gpus) == (4, 4, ("0", "1", "2", "3"))
    env = slots.env(2)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env[executors.ENV_JOBS] == "4" and env[executors.ENV_THREADS] == env["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")  # a subset given by the scheduler is kept
    assert plan_slots(4, 12, cores=8, gpus=2).env(3)["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert "CUDA_VISIBLE_DEVICES" not in plan_slots(2, 2, cores=2, gpus=0).env(0)


@pytest.mark.parametrize("jobs", ["0", "-1", "many", "1.5"])
def test_bad_jobs_is_a_config_error(jobs):
    with pytest.raises(ConfigError, match="--jobs must be a positive number or 'auto'"):
        Execution(jobs=jobs)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--jobs", "zero"], "--jobs must be a positive number"),
        (["--executor", "spark"], "--executor must be one of local, ray"),
        (["--ray-address", "10.0.0.1:6379"], "--ray-address needs --executor ray"),
    ],
)
def test_bad_execution_options_are_one_clear_line(tmp_path, capsys, args, needle):
    for command in (["train-all", "--preset", "tiny"], ["study", "--preset", "tiny"]):
        assert run_cli([*command, "--db", str(tmp_path / "r.db"), *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
    assert not (tmp_path / "r.db").exists()  # refused before anything was prepared or written


def test_jobs_under_torchrun_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfgs = sweep.sweep("tiny", ["control"], [0])
    for opts in (TrainOptions(jobs=2), TrainOptions(executor="ray")):
        with pytest.raises(ConfigError, match="under torchrun"):
            sweep.train_all(cfgs, None, Path("unused.db"), opts)


# ---- progress lines from the jobs ------------------------------------------------------------------------------------


class _Events(list):
    def put(self, item):
        self.append(item)


def test_each_job_reports_its_own_progress_line():
    events = _Events()
    remote = _RemoteProgress(events, 1, enabled=True)
    with remote.task("control s0", total=30, loss="-") as t:
        t.move_to(10, loss="4.1")
    remote.log("  control s0 step 10: val loss 4.2")

    out = io.StringIO()
    parent = Progress(enabled=True, console=Console(file=out, force_terminal=False, width=200), interval=0.0)
    pool = ProcessPool(Execution(jobs=2), prepared=None, db_path=Path("r.db"), db=None, progress=parent, log=parent.log)
    for e in events:
        pool._handle(e, [], None, 0, lambda *_: None)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job 1: control s0: 0/30 (0%)")
    assert any(ln.startswith("job 1: control s0: 10/30 (33%) loss 4.1") for ln in lines)
    assert "  control s0 step 10: val loss 4.2" in lines
    assert pool._relay._tasks == {}  # closed with the run


def test_a_disabled_job_progress_sends_only_messages():
    events = _Events()
    remote = _RemoteProgress(events, 0, enabled=False)
    with remote.task("control s0", total=30) as t:
        t.move_to(5)
    remote.log("resuming")
    assert events == [("log", 0, "resuming")]


# ---- training -------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # three spawned processes importing torch: about 30 s on a shared 2-core machine
def test_two_jobs_give_the_same_runs_as_one(tmp_path, tinystories_dir, monkeypatch):
    """--jobs 2 on two cores: one thread per run, as the in-process reference (the suite runs one torch thread).
    A run that fails in one job is recorded and the others go on."""
    cfgs, prepared = _prepared(tmp_path, monkeypatch, tinystories_dir)
    monkeypatch.setattr(executors, "cpu_cores", lambda: 2)
    one, two = tmp_path / "one" / "results.db", tmp_path / "two" / "results.db"
    res1 = sweep.train_all(cfgs, prepared, one, progress=False, log=lambda *_: None)
    lines: list[str] = []
    bad = make_config("tiny", "control", 1, {**SHORT, "data.source": str(tinystories_dir), "train.lr": 1e6})
    res2 = sweep.train_all([bad, *cfgs], prepared, two, progress=False, log=lines.append, opts=TrainOptions(jobs=2))
    assert sorted(res1.done) == sorted(res2.done) and len(res2.done) == 2
    assert len(res2.failed) == 1 and "training loss became" in res2.failed[0][1]
    losses = _losses(two)
    assert {k: losses[k] for k in res2.done} == _losses(one)
    assert lines[0] == "3 run(s), 2 at a time, 1 thread(s) each"
    assert sum("-> job" in ln for ln in lines) == 3
    lines.clear()
    again = sweep.train_all(cfgs, prepared, two, progress=False, log=lines.append, opts=TrainOptions(jobs=2))
    assert sorted(again.skipped) == sorted(res2.done) and not again.done
    assert not any("at a time" in ln for ln in lines)  # finished runs start no process
    lines.clear()  # a resumed sweep numbers the runs it hands out against the whole sweep, as the first time
    sweep.train_all([bad, *cfgs], prepared, two, progress=False, log=lines.append, opts=TrainOptions(jobs=2))
    assert "1 run(s), 1 at a time, 2 thread(s) each" in lines
    assert any(ln.startswith("[1/3] control seed 1 (preset tiny) -> job") for ln in lines), lines


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_done_run_without_its_checkpoint_counts_as_done_when_nothing_reads_weights(
    tmp_path, tinystories_dir, monkeypatch
):
    """results.db carried to another machine without its run directories: a study that only trains and reports
    goes on from its done runs; one whose later stages load weights trains them again."""
    import shutil

    cfgs, prepared = _prepared(tmp_path, monkeypatch, tinystories_dir, {**SHORT, "train.max_steps": 2})
    db_path = tmp_path / "results.db"
    quiet = {"progress": False, "log": lambda *_: None}
    first = sweep.train_all(cfgs, prepared, db_path, **quiet)
    assert len(first.done) == 2
    shutil.rmtree(tmp_path / "runs")
    losses = _losses(db_path)
    for jobs in (1, 2):  # in this process (train_run's verdict) and the process pool's check before it starts any
        kept = sweep.train_all(cfgs, prepared, db_path, **quiet, opts=TrainOptions(jobs=jobs, weights_needed=False))
        assert sorted(kept.skipped) == sorted(first.done) and not kept.done, jobs
    assert _losses(db_path) == losses and not (tmp_path / "runs").exists()
    lines: list[str] = []
    again = sweep.train_all(cfgs, prepared, db_path, progress=False, log=lines.append)
    assert sorted(again.done) == sorted(first.done) and not again.skipped
    assert any("is marked done but its checkpoint is missing; training it again" in ln for ln in lines)


def test_a_run_dir_of_its_own_is_linked_where_later_stages_look(tmp_path, tinystories_dir, monkeypatch):
    from benchctl.core import checkpoint as ckpt

    cfgs, prepared = _prepared(tmp_path, monkeypatch, tinystories_dir, {**SHORT, "train.max_steps": 2})
    db_path, runs = tmp_path / "results.db", tmp_path / "shared" / "runs"
    res = sweep.train_all(
        cfgs[:1], prepared, db_path, progress=False, log=lambda *_: None, opts=TrainOptions(runs_dir=runs)
    )
    (rid,) = res.done
    assert (runs / rid / ckpt.CKPT_NAME).is_file()
    usual = ckpt.run_dir(db_path, rid)
    assert usual.is_symlink() and usual.resolve() == (runs / rid).resolve()
    model, cfg, _ = ckpt.load_model(usual / ckpt.CKPT_NAME)  # what sample, eval and depth do
    assert cfg.arch == "control"


def test_copy_run_rows_takes_every_table_training_writes(tmp_path, tinystories_dir, monkeypatch):
    from benchctl.stages.train.engine import train_run

    cfgs, prepared = _prepared(tmp_path, monkeypatch, tinystories_dir, {**SHORT, "train.max_steps": 3})
    src_path = tmp_path / "worker" / "rows.db"
    src = stages.connect(src_path)
    rid = train_run(cfgs[0], prepared, src, src_path, progress=False, log=lambda *_: None).run_id
    written = {
        t
        for t in src.table_names()
        if t == "runs"
        or (
            "run_id" in src[t].columns_dict
            and src.execute(f"select count(*) from [{t}] where run_id = ?", [rid]).fetchone()[0]
        )
    }
    assert written == set(train_tables.RUN_TABLES)  # a table training starts writing must be added to RUN_TABLES

    dst = stages.connect(tmp_path / "results.db")
    n = train_tables.copy_run_rows(src, dst, rid)
    assert n == 1 + sum(src[t].count_where("run_id = ?", [rid]) for t in train_tables.RUN_TABLES[1:])
    for t in train_tables.RUN_TABLES[1:]:
        assert list(dst[t].rows_where("run_id = ?", [rid], order_by="step")) == list(
            src[t].rows_where("run_id = ?", [rid], order_by="step")
        )
    assert train_tables.get_run(dst, rid) == train_tables.get_run(src, rid)
    train_tables.update_run(dst, rid, variant="first-name")  # copying again keeps the name results.db knew it by
    train_tables.copy_run_rows(src, dst, rid)
    assert train_tables.get_run(dst, rid)["variant"] == "first-name"
    assert train_tables.copy_run_rows(src, dst, "no-such-run") == 0


@pytest.mark.slow
def test_killing_the_parent_leaves_every_run_resumable(tmp_path, tinystories_dir):
    env = {**os.environ, "BENCHCTL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("BENCHCTL_DB", None)
    db_path = tmp_path / "results.db"
    args = [
        sys.executable,
        "-m",
        "benchctl",
        "train-all",
        "--preset",
        "tiny",
        "--archs",
        "control,frailt",
        "--data",
        str(tinystories_dir),
        "--db",
        str(db_path),
        "--no-progress",
        "--jobs",
        "2",
        "--set",
        "train.max_steps=60",
        "--set",
        "train.ckpt_interval=5",
        "--set",
        "train.eval_interval=100",
    ]
    p = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, steps = time.time() + 240, []
    while time.time() < deadline and p.poll() is None:
        try:
            con = sqlite3.connect(db_path, timeout=1)
            steps = [r[0] or 0 for r in con.execute("select step from runs")]
            con.close()
        except sqlite3.OperationalError:
            steps = []
        if len(steps) == 2 and min(steps) >= 5:
            break
        time.sleep(0.2)
    assert p.poll() is None, "the runs finished before the parent could be killed; make them longer"
    con = sqlite3.connect(db_path)
    pids = [r[0] for r in con.execute("select pid from runs")]
    con.close()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode != 0
    time.sleep(1.0)
    for pid in pids:  # no training process outlives its parent
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    con = sqlite3.connect(db_path)
    rows = con.execute("select status, step from runs").fetchall()
    con.close()
    assert all(status != "done" and step >= 5 for status, step in rows)

    again = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("resuming") == 2
    assert all(status == "done" for status, _ in _losses(db_path).values())


# ---- sample and eval across runs (executors.local.in_processes) -----------------------------------------------------


@pytest.mark.slow  # two spawned processes importing torch
def test_a_groups_error_is_raised_after_every_group_has_ended(tmp_path):
    """One share fails with a benchctl error (a run id that does not exist), the other ends normally: the caller
    gets that error, with its own message and class, once both processes are gone."""
    from benchctl.stages import RunSelection
    from benchctl.stages.sample import engine as smp
    from benchctl.stages.sample.options import SampleOptions
    from benchctl.stages.train.executors.local import in_processes

    db_path = tmp_path / "results.db"
    stages.connect(db_path)  # an empty results.db
    said: list[str] = []
    with pytest.raises(ConfigError, match="nope"):
        in_processes(
            smp.sample_all,
            [{"opts": SampleOptions(select=RunSelection(run_ids=[ids]))} for ids in ("nope", "nope-either")],
            db_path=db_path,
            device_spec="cpu",
            progress=Progress(enabled=False),
            log=said.append,
            what="sampling",
        )
    assert said[0] == "sampling: 2 jobs at once, 1 thread(s) each"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("benchctl-job")]


def test_the_longest_runs_are_handed_out_first(monkeypatch):
    """Jobs end close together when the short runs start last: the pool orders its runs by training FLOPs (the
    control's are about a third of a recurrent model's), keeping each run's number."""
    specs = [
        RunSpec(i, make_config("tiny", arch, seed), arch, f"{arch}-{seed}")
        for i, (arch, seed) in enumerate([("control", 0), ("frailt", 0), ("control", 1), ("relaxed", 0)], 1)
    ]
    handed: list[RunSpec] = []
    monkeypatch.setattr(ProcessPool, "_run", lambda self, todo, on_outcome: handed.extend(todo))
    pool = ProcessPool(
        Execution(jobs=2), prepared=None, db_path=Path("r.db"), db=None, progress=False, log=lambda _: None
    )
    pool.run(specs, lambda *_: None)
    flops = [accounting.training_flops(s.cfg) for s in handed]
    assert flops == sorted(flops, reverse=True) and flops[0] > 2 * flops[-1]
    assert [s.variant for s in handed[-2:]] == ["control", "control"] and [s.index for s in handed[-2:]] == [1, 3]
