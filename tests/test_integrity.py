"""Tests that benchctl never touches what is not its own, and never records what did not happen.

- A file benchctl creates carries its marker (`PRAGMA application_id`) and the schema version; an SQLite file
  without the marker (another program's `runs` table, a `users` table) is refused by every command in one line with
  exit 2, and keeps every byte (its SHA-256 before and after).
- A results database from before the marker is read as it is by the read-only commands, and adopted by a writing
  one through the versioned migration 1 -> 2; every version step has its migration and its test.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from benchctl import stages
from benchctl.cli import main
from benchctl.core import db as dbm
from benchctl.core.errors import ForeignDatabaseError


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of `benchctl ARGV`."""
    code: int | str | None = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return (0 if code is None else int(code)), out.err, out.out


def other_apps_runs(path: Path) -> Path:
    """Another program's database that happens to have a `runs` table."""
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("create table runs(id integer primary key, name text)")
        conn.execute("insert into runs values (1, 'x')")
    conn.close()
    return path


def other_apps_users(path: Path) -> Path:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("create table users(id integer primary key, email text)")
        conn.execute("insert into users values (1, 'a@example.org')")
    conn.close()
    return path


def marked_by_someone_else(path: Path) -> Path:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("PRAGMA application_id = 1234")
        conn.execute("create table t(x)")
    conn.close()
    return path


def legacy_database(path: Path) -> Path:
    """A results database as benchctl wrote it before the marker: every table, schema version 1, a finished run."""
    db = stages.connect(path)
    db.execute("PRAGMA application_id = 0")
    db.table("meta").upsert({"key": "schema_version", "value": "1"}, pk="key")
    db.table("runs").insert(
        {"id": "r1", "arch": "control", "variant": "control", "preset": "tiny", "seed": 0, "status": "done"}
        | {"config_json": "{}", "step": 10, "max_steps": 10}
    )
    db.conn.close()
    assert sqlite3.connect(path).execute("PRAGMA application_id").fetchone()[0] == 0
    return path


FOREIGN = (other_apps_runs, other_apps_users, marked_by_someone_else)
COMMANDS = (
    ["runs"],
    ["runs", "--json"],
    ["judge", "--dry-run"],
    ["train", "--arch", "control", "--preset", "tiny", "--yes", "--no-progress"],
    ["train-all", "--archs", "control", "--preset", "tiny", "--yes", "--no-progress"],
    ["browse", "--no-open", "--port", "8999"],
    ["report"],
    ["sample", "--no-progress"],
    ["eval", "--no-progress"],
    ["depth", "--no-progress"],
)


def test_a_new_database_carries_the_marker_and_the_schema_version(tmp_path):
    path = tmp_path / "results.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == dbm.APPLICATION_ID == 0x6263746C
    assert conn.execute("select value from meta where key = 'schema_version'").fetchone()[0] == str(dbm.SCHEMA_VERSION)
    conn.close()
    assert path.read_bytes()[68:72] == b"bctl"  # the header field, as `file` and other tools read it


@pytest.mark.parametrize("make", FOREIGN, ids=lambda f: f.__name__)
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_refuses_a_foreign_file_and_changes_no_byte(tmp_path, capsys, make, argv):
    path = make(tmp_path / "o.db")
    before = sha256(path)
    extra = ["--out", str(tmp_path / "rep")] if argv[0] == "report" else []
    code, err, _ = run_cli(capsys, [*argv, "--db", str(path), *extra])
    assert code == 2, err
    assert "not a benchctl results database" in err and "nothing was changed" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sha256(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.db"]  # no -wal, -shm, report or runs/ beside it


@pytest.mark.parametrize("make", FOREIGN, ids=lambda f: f.__name__)
def test_the_db_layer_refuses_a_foreign_file_for_reading_and_writing(tmp_path, make):
    path = make(tmp_path / "o.db")
    before = sha256(path)
    for kw in ({}, {"create": False}, {"readonly": True}, {"wal": False}):
        with pytest.raises(ForeignDatabaseError):
            stages.connect(path, **kw)
    with pytest.raises(ForeignDatabaseError):
        dbm.check_file(path)
    assert sha256(path) == before


def test_an_empty_file_is_a_new_database(tmp_path, capsys):
    path = tmp_path / "results.db"
    path.touch()
    for argv in (["runs"], ["judge", "--dry-run"]):  # a reader finds nothing to read, and creates nothing
        code, err, _ = run_cli(capsys, [*argv, "--db", str(path)])
        assert code == 5 and "is empty, not a results database yet" in err and len(err.strip().splitlines()) == 1
    assert path.read_bytes() == b""
    stages.connect(path).conn.close()
    assert dbm.check_file(path).kind == "ours"


def test_a_database_from_a_newer_benchctl_is_refused_and_kept(tmp_path):
    path = tmp_path / "results.db"
    db = stages.connect(path)
    db.table("meta").upsert({"key": "schema_version", "value": str(dbm.SCHEMA_VERSION + 1)}, pk="key")
    db.conn.close()
    before = sha256(path)
    for kw in ({}, {"readonly": True}):
        with pytest.raises(dbm.DatabaseError, match="newer than this benchctl"):
            stages.connect(path, **kw)
    assert sha256(path) == before


# --------------------------------------------------------------------------------------------------------------------
# Databases from before the marker, and the versioned migrations


def test_every_version_step_has_a_migration():
    assert sorted(dbm.MIGRATIONS) == list(range(1, dbm.SCHEMA_VERSION))


def test_a_legacy_database_is_recognised_only_with_benchctls_runs_columns(tmp_path):
    legacy = legacy_database(tmp_path / "legacy.db")
    assert dbm.check_file(legacy) == dbm.Identity("legacy", 1)
    lookalike = tmp_path / "lookalike.db"  # schema version 1 in a meta table, but some other program's runs
    conn = sqlite3.connect(lookalike)
    with conn:
        conn.execute("create table meta(key text primary key, value text)")
        conn.execute("insert into meta values ('schema_version', '1')")
        conn.execute("create table runs(id integer primary key, name text)")
    conn.close()
    with pytest.raises(ForeignDatabaseError):
        dbm.check_file(lookalike)


def test_read_only_commands_read_a_legacy_database_without_migrating_it(tmp_path, capsys):
    path = legacy_database(tmp_path / "legacy.db")
    before = sha256(path)
    code, _, out = run_cli(capsys, ["runs", "--db", str(path), "--json"])
    assert code == 0 and '"id": "r1"' in out
    code, err, _ = run_cli(capsys, ["report", "--db", str(path), "--out", str(tmp_path / "rep")])
    assert code == 0, err
    rows = stages.connect(path, readonly=True).execute("select id, status from runs").fetchall()
    assert rows == [("r1", "done")]
    assert dbm.check_file(path).kind == "legacy"
    assert sha256(path) == before


def test_migration_1_to_2_adopts_a_legacy_database_and_keeps_its_rows(tmp_path):
    path = legacy_database(tmp_path / "legacy.db")
    db = stages.connect(path)
    assert db.execute("PRAGMA application_id").fetchone()[0] == dbm.APPLICATION_ID
    assert db.execute("select value from meta where key = 'schema_version'").fetchone()[0] == "2"
    assert db.execute("select id, status, step from runs").fetchall() == [("r1", "done", 10)]
    db.conn.close()
    assert dbm.check_file(path) == dbm.Identity("ours", 2)


def test_a_failed_migration_leaves_the_legacy_file_as_it_was(tmp_path, monkeypatch):
    path = legacy_database(tmp_path / "legacy.db")
    stages.connect(path, readonly=True).conn.close()

    def broken(db):
        dbm._adopt_marker(db)
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setitem(dbm.MIGRATIONS, 1, broken)
    with pytest.raises(dbm.DatabaseError):
        stages.connect(path)
    assert dbm.check_file(path) == dbm.Identity("legacy", 1)  # the step and the version move together, or neither


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints belong to their database; a run is done only with its data

FAST = ["--set", "train.max_steps=6", "--set", "train.eval_interval=3", "--set", "train.ckpt_interval=2"]


def train_argv(data_dir: Path, db: Path) -> list[str]:
    return ["train", "--arch", "control", "--preset", "tiny", "--data", str(data_dir), "--no-progress", "--yes", *FAST]


def runs_of(db: Path) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("select id, status, step from runs").fetchall()
    finally:
        conn.close()


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_copied_runs_dir_is_never_resumed_nor_marked_done_by_a_new_database(
    tmp_path, tinystories_dir, capsys, monkeypatch
):
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    first = tmp_path / "a" / "results.db"
    code, err, _ = run_cli(capsys, [*train_argv(tinystories_dir, first), "--db", str(first)])
    assert code == 0, err
    (rid, status, step), *_ = runs_of(first)
    assert status == "done" and step == 6

    second = tmp_path / "b" / "results.db"  # a new database beside a copy of the finished run's folder
    second.parent.mkdir()
    import shutil

    shutil.copytree(first.parent / "runs", second.parent / "runs")
    ckpt_sha = sha256(second.parent / "runs" / rid / "ckpt.pt")
    code, err, out = run_cli(capsys, [*train_argv(tinystories_dir, second), "--db", str(second)])
    assert code == 4, err
    assert "never recorded" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "resuming" not in out
    assert [r for r in runs_of(second) if r[1] == "done"] == []
    assert sha256(second.parent / "runs" / rid / "ckpt.pt") == ckpt_sha  # the other database's checkpoint is kept

    # two databases in one directory share its runs dir: the second never takes the first's run as its own
    other = first.parent / "other.db"
    code, err, _ = run_cli(capsys, [*train_argv(tinystories_dir, other), "--db", str(other)])
    assert code == 4 and "never recorded" in err
    assert [r for r in runs_of(other) if r[1] == "done"] == []
    assert runs_of(first) == [(rid, "done", 6)]


def test_a_run_is_recorded_done_only_with_its_final_checkpoint_and_loss(tmp_path):
    from benchctl.stages.train import tables as train_tables

    db = stages.connect(tmp_path / "results.db")
    run = {"id": "r1", "arch": "control", "preset": "tiny", "seed": 0, "config_json": "{}", "max_steps": 4}
    train_tables.start_run(db, run, new=True, resume_step=0)

    def finish():
        train_tables.finish_run(db, "r1", final_val_loss=3.0, initial_val_loss=4.0)

    with pytest.raises(dbm.DatabaseError, match="recorded step is 0 of 4"):
        finish()
    val = {"run_id": "r1", "step": 4, "name": "val_loss", "value": 3.0, "tokens": 0, "wall_seconds": 1.0}
    train_tables.record_checkpoint(db, "r1", step=2, path="ck", size=1, metrics=[], run_values={})
    train_tables.update_run(db, "r1", step=4)
    with pytest.raises(dbm.DatabaseError, match="no checkpoint is recorded at step 4"):
        finish()
    train_tables.record_checkpoint(db, "r1", step=4, path="ck", size=1, metrics=[], run_values={})
    with pytest.raises(dbm.DatabaseError, match="no validation loss is recorded at step 4"):
        finish()
    assert train_tables.get_run(db, "r1")["status"] != "done"
    train_tables.record_metrics(db, [val])
    finish()
    assert train_tables.get_run(db, "r1")["status"] == "done"


def test_a_checkpoint_written_but_not_recorded_is_recorded_on_resume(tmp_path, tinystories_dir, monkeypatch):
    """Killed between writing the final checkpoint and recording it: the rerun records it and finishes the run."""
    from benchctl.core import data
    from benchctl.core.config import make_config
    from benchctl.stages.train import tables as train_tables
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    overrides = {"data.source": str(tinystories_dir), "train.max_steps": 6, "train.ckpt_interval": 3}
    cfg = make_config("tiny", "control", overrides=overrides)
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    path = tmp_path / "results.db"
    db = stages.connect(path)
    r = train_run(cfg, prepared, db, path, progress=False, log=lambda *_: None)
    with db.atomic():  # as if the last record_checkpoint and finish_run never happened
        db.execute("update checkpoints set step = 3 where run_id = ?", [r.run_id])
        db.execute("update runs set status = 'failed', step = 3 where id = ?", [r.run_id])
    r2 = train_run(cfg, prepared, db, path, progress=False, log=lambda *_: None)
    assert r2.resumed_from == 6 and r2.status == "done"
    row = train_tables.get_run(db, r.run_id)
    assert row["status"] == "done" and row["step"] == 6 and train_tables.incomplete(db, r.run_id) is None


# --------------------------------------------------------------------------------------------------------------------
# Lifecycle: SIGTERM, two sweeps over one database, read-only files


def test_a_second_sigterm_while_unwinding_from_the_first_is_ignored():
    """The handler raises once: a SIGTERM arriving while the first one unwinds (recording the run, printing the
    last line) would otherwise raise inside that code and end in a chain of tracebacks."""
    import signal

    from benchctl.core.errors import Terminated, raise_terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)  # ignored: nothing raised
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow  # a training process, signalled
def test_sigterm_records_the_run_interrupted_like_ctrl_c(tmp_path, tinystories_dir):
    import os
    import signal
    import subprocess
    import sys
    import time

    db_path = tmp_path / "results.db"
    args = [*train_argv(tinystories_dir, db_path), "--set", "train.max_steps=400", "--db", str(db_path)]
    env = {**os.environ, "BENCHCTL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "benchctl", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline, step = time.time() + 240, 0
    while time.time() < deadline and p.poll() is None and step < 2:
        if db_path.exists():
            try:
                conn = sqlite3.connect(db_path, timeout=1)
                step = (conn.execute("select step from runs").fetchone() or (0,))[0] or 0
                conn.close()
            except sqlite3.OperationalError:
                step = 0
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be terminated"
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGTERM)  # a second one at once (a scheduler that signals twice): the same clean ending
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated; rerun the same command to resume"
    conn = sqlite3.connect(db_path)
    status, error, pid = conn.execute("select status, error, pid from runs").fetchone()
    conn.close()
    assert (status, error, pid) == ("failed", "interrupted", None)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_sweep_waits_for_a_run_another_process_trains_and_reports_no_failure(tmp_path, tinystories_dir, monkeypatch):
    import socket
    import subprocess
    import threading

    from benchctl.core import data
    from benchctl.core.config import make_config, run_id
    from benchctl.stages.train import sweep
    from benchctl.stages.train import tables as train_tables
    from benchctl.stages.train.options import TrainOptions

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    cfg = make_config("tiny", "control", overrides={"data.source": str(tinystories_dir), "train.max_steps": 6})
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    path = tmp_path / "results.db"
    db = stages.connect(path)
    rid = run_id(cfg, prepared.fingerprint)
    other = subprocess.Popen(["sleep", "60"])  # the other process, training the run
    run = {"id": rid, "arch": "control", "preset": "tiny", "seed": 0, "config_json": cfg.to_json(), "max_steps": 6}
    train_tables.start_run(
        db, {**run, "status": "running", "pid": other.pid, "hostname": socket.gethostname()}, new=True, resume_step=0
    )
    lines: list[str] = []
    # it ends (killed: the run is left `running`, to be taken up); reaped, or its pid would stay alive as a zombie
    threading.Timer(1.0, lambda: (other.kill(), other.wait())).start()
    result = sweep.train_all([cfg], prepared, path, TrainOptions(yes=True), progress=False, log=lines.append)
    assert result.failed == [] and result.done == [rid]
    assert any("being trained by another process" in line and "waiting" in line for line in lines)
    assert train_tables.get_run(db, rid)["status"] == "done"


def test_runs_reads_a_database_it_cannot_write(tmp_path, capsys):
    import os

    path = tmp_path / "ro" / "results.db"
    db = stages.connect(path)
    db.table("runs").insert({"id": "r1", "arch": "control", "preset": "tiny", "seed": 0, "config_json": "{}"})
    db.conn.close()
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        stages.connect(path, readonly=True).execute("create table x(y)")
    if os.geteuid() == 0:
        return  # root writes whatever the permissions say; the read-only connection above is what `runs` uses
    for p in (path.parent, *path.parent.iterdir()):
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        code, err, out = run_cli(capsys, ["runs", "--db", str(path), "--json"])
        assert code == 0 and '"id": "r1"' in out, err
    finally:
        path.parent.chmod(0o755)


# ---- a checkpoint is bound to its run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swapped(tmp_path_factory, tinystories_dir):
    """Two tiny runs (control, frailt), frailt's checkpoint copied over the control's (as a user might by mistake)."""
    import shutil

    from fixtures_db import train_tiny_runs

    root = train_tiny_runs(tmp_path_factory.mktemp("swap"), tinystories_dir)
    db_path = root / "results" / "results.db"
    ids = {r["arch"]: r["id"] for r in stages.connect(db_path).query("select id, arch from runs")}
    runs = db_path.parent / "runs"
    shutil.copyfile(runs / ids["frailt"] / "ckpt.pt", runs / ids["control"] / "ckpt.pt")
    return root, db_path, ids


@pytest.mark.parametrize(
    "argv",
    [
        ["depth", "--depths", "1", "--windows", "2"],
        ["sample", "--n-prompts", "1"],
        ["infer", "--batch", "1", "--single", "1", "--drafts", "", "--thresholds", "0"],
        ["export", "-f", "hf"],
        ["eval"],
    ],
    ids=lambda a: a[0],
)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_checkpoint_of_another_run_is_refused_with_exit_4(swapped, capsys, monkeypatch, tmp_path, argv):
    root, db_path, ids = swapped
    monkeypatch.setenv("BENCHCTL_CACHE", str(root / "cache"))
    rid = ids["control"]
    target = ["--runs", rid] if argv[0] != "export" else [rid, "--out", str(tmp_path / "out")]
    code, err, _ = run_cli(capsys, [argv[0], *target, *argv[1:], "--db", str(db_path)])
    assert code == 4, err
    assert "holds a frailt model, but run" in err and rid in err and "\n" not in err.strip()
    with stages.connect(db_path).conn as conn:  # nothing was stored under the control's name
        for table in ("depth_results", "samples", "inference_results", "eval_results"):
            assert not conn.execute(f"select count(*) from {table} where run_id = ?", [rid]).fetchone()[0]
    assert not (tmp_path / "out").exists()


def test_the_run_check_names_a_configuration_difference(swapped):
    """Same architecture, another configuration (a seed): the row and the checkpoint disagree, and the message says
    on what."""
    import json

    from benchctl.core import checkpoint
    from benchctl.core.errors import CheckpointError

    root, db_path, ids = swapped
    row = dict(stages.connect(db_path)["runs"].get(ids["frailt"]))
    cfg = json.loads(row["config_json"])
    cfg["seed"] = 7
    row["config_json"] = json.dumps(cfg)
    path = db_path.parent / "runs" / ids["frailt"] / "ckpt.pt"
    with pytest.raises(CheckpointError, match="another configuration than run .*seed: 0 != 7"):
        checkpoint.load_model(path, "cpu", row)
    row = dict(stages.connect(db_path)["runs"].get(ids["frailt"]))
    checkpoint.load_model(path, "cpu", row)  # its own row: fine
    row["n_params"] = 1
    with pytest.raises(CheckpointError, match="parameters"):
        checkpoint.load_model(path, "cpu", row)


@pytest.mark.parametrize("n, message", [("100000", "at most 1024 iterations"), ("1025", "at most 1024"), ("0", ">= 1")])
def test_export_bounds_its_depth_before_writing_anything(capsys, tmp_path, n, message):
    out = tmp_path / "out"
    code, err, _ = run_cli(
        capsys, ["export", "any-run", "-f", "hf", "-o", str(out), "--n-recur", n, "--db", str(tmp_path / "r.db")]
    )
    assert code == 2 and message in err and "--n-recur" in err
    assert not out.exists() and not (tmp_path / "r.db").exists()


def test_an_export_killed_at_any_point_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    """kill -9 at 20 random points of writing a folder (simulated: the cleanup never runs, and the killed process's
    pid is dead): the destination is absent every time, and the next export writes it whole without --force."""
    import random

    import benchctl.export as ex

    names = [f"f{i}.bin" for i in range(6)]

    def writer(stop: int | None):
        def write(folder: Path) -> list[str]:
            for i, name in enumerate(names):
                if i == stop:
                    raise KeyboardInterrupt  # the kill, between two files
                (folder / name).write_bytes(bytes(1000 + i))
            return names

        return write

    rng = random.Random(0)
    out = tmp_path / "export"
    for trial in range(20):
        with monkeypatch.context() as m:
            m.setattr(ex.shutil, "rmtree", lambda *a, **k: None)  # SIGKILL: no cleanup
            m.setattr(ex.os, "getpid", lambda: 2**22 + 17 + trial)  # a pid no process has
            with pytest.raises(KeyboardInterrupt):
                ex.write_folder(out, writer(rng.randrange(len(names))))
        assert not out.exists()
    assert len(list(tmp_path.glob(".export.partial-*"))) == 20  # the killed exports' staging folders
    assert ex.write_folder(out, writer(None)) == names
    assert sorted(p.name for p in out.iterdir()) == names and not list(tmp_path.glob(".export.partial-*"))


@pytest.fixture(scope="module")
def exportable(tmp_path_factory, tinystories_dir):
    """A tiny control, trained for 2 steps: a run `export` takes."""
    from fixtures_db import train_tiny_runs

    root = train_tiny_runs(tmp_path_factory.mktemp("export"), tinystories_dir, archs="control")
    db_path = root / "results" / "results.db"
    (rid,) = [r["id"] for r in stages.connect(db_path).query("select id from runs")]
    return db_path, rid


@pytest.mark.parametrize(
    "failure, words",
    [
        (OSError(28, "No space left on device"), "the disk is full"),
        (OSError(30, "Read-only file system"), "read-only file system"),
        (OSError(13, "Permission denied"), "permission denied"),
        (RuntimeError("Error while serializing: IoError(Os { code: 28, message: No space left on device })"), "full"),
    ],
    ids=["full", "read-only", "denied", "safetensors-full"],
)
def test_an_export_that_cannot_write_is_one_line_exit_8(exportable, capsys, tmp_path, monkeypatch, failure, words):
    """A full disk, a read-only or a forbidden destination (the writer fails as the OS or safetensors would): one
    line, exit 8, and no folder in its place."""
    import benchctl.export.hf as hf

    db_path, rid = exportable

    def failing(weights, tok_path, folder):
        (folder / "config.json").write_text("{}")  # part of the folder was written
        raise failure

    monkeypatch.setattr(hf, "write_hf", failing)
    out = tmp_path / "out"
    code, err, _ = run_cli(capsys, ["export", rid, "-f", "hf", "-o", str(out), "--db", str(db_path)])
    assert code == 8 and words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_full_disk_under_results_db_is_one_line_and_keeps_the_database(exportable, capsys, monkeypatch, tmp_path):
    """`sample` on a full disk: SQLite's own SQLITE_FULL (the database is held at its current size, as a full disk
    would hold it) is one line with exit 8, and the database keeps its runs, consistent."""
    db_path, rid = _copy_of(exportable, tmp_path)
    real = stages.connect

    def full(*a, **k):
        db = real(*a, **k)
        pages = db.conn.execute("pragma page_count").fetchone()[0]
        db.conn.execute(f"pragma max_page_count = {pages}")
        return db

    monkeypatch.setattr(stages, "connect", full)
    code, err, _ = run_cli(capsys, ["sample", "--db", str(db_path), "--n-prompts", "64", "--no-progress"])
    assert code == 8 and "disk is full" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    conn = sqlite3.connect(db_path)
    assert conn.execute("pragma integrity_check").fetchone() == ("ok",)
    assert conn.execute("select id, status from runs").fetchall() == [(rid, "done")]
    conn.close()


def _copy_of(exportable, tmp_path: Path) -> tuple[Path, str]:
    """The trained tiny control's database and runs directory copied into `tmp_path` (a test that writes to it
    leaves the module's fixture as it was)."""
    import shutil

    db_src, rid = exportable
    tmp_path.mkdir(parents=True, exist_ok=True)
    db_path = tmp_path / "results.db"
    with sqlite3.connect(db_src) as a, sqlite3.connect(db_path) as b:
        a.backup(b)  # with what is still in the source's WAL
    shutil.copytree(db_src.parent / "runs", tmp_path / "runs")
    if (db_src.parent / "cache").is_dir():
        shutil.copytree(db_src.parent / "cache", tmp_path / "cache")
    return db_path, rid


def test_a_command_given_db_elsewhere_keeps_its_cache_beside_that_database(exportable, capsys, monkeypatch, tmp_path):
    """`sample --db OTHER/results.db` run from another directory prepares (or finds) the data cache beside that
    database, as its runs directory is, and writes nothing into the working directory."""
    db_path, _ = _copy_of(exportable, tmp_path / "study")
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.delenv("BENCHCTL_CACHE", raising=False)
    code, err, _ = run_cli(capsys, ["sample", "--db", str(db_path), "--n-prompts", "2", "--no-progress"])
    assert code == 0, err
    assert list(here.iterdir()) == []
    assert any((db_path.parent / "cache").iterdir())


def test_train_refuses_init_from_before_making_a_database_or_a_cache(tinystories_dir, capsys, monkeypatch, tmp_path):
    """A run that starts from converted weights is `retrofit`'s to start: `train` says so before it creates
    results.db or prepares the data."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BENCHCTL_CACHE", raising=False)
    db = tmp_path / "results" / "results.db"
    argv = [*train_argv(tinystories_dir, db), "--set", "train.init_from=somewhere", "--db", str(db)]
    code, err, _ = run_cli(capsys, argv)
    assert code == 2 and "benchctl retrofit" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["study", "report"])
def test_an_output_folder_that_cannot_be_written_is_refused_first(
    tinystories_dir, capsys, monkeypatch, tmp_path, command
):
    """`study --out` where a file stands in the way (as a read-only folder would, which root cannot simulate): one
    line, exit 8, before any data is prepared or a database made; the same for `report --out`."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    db = tmp_path / "results.db"
    extra = ["--preset", "tiny", "--seeds", "0", "--data", str(tinystories_dir), "-y"] if command == "study" else []
    code, err, _ = run_cli(capsys, [command, "--out", str(blocker / "reports"), "--db", str(db), *extra])
    assert code == 8 and "is a file, not a folder" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_folder_probe_reports_the_oses_reason(tmp_path, monkeypatch):
    """A read-only folder (simulated at the probe: root writes anywhere) is named by its cause."""
    import tempfile

    from benchctl.core import files
    from benchctl.core.errors import OutputError

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(OutputError, match="read-only file system"):
        files.check_writable_dir(tmp_path / "reports")
    assert not (tmp_path / "reports").exists()
