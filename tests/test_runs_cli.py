"""`benchctl runs`: a table read whole at 80 columns, built without the heavy libraries, and the status of runs whose
process is gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cli_process import run_main
from fixtures_db import build_fixture_db

from benchctl.core.config import short_run_ids

REPO = Path(__file__).resolve().parents[1]
TIMING = ("wall", "CPU", "thr", "jobs", "load")


def benchctl(*args: str, columns: int = 80, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`benchctl ARGS` in its own process, on a terminal `columns` wide (rich reads COLUMNS when it starts)."""
    full = {
        **os.environ,
        "COLUMNS": str(columns),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    full.pop("BENCHCTL_DB", None)
    return subprocess.run(
        [sys.executable, "-m", "benchctl", *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def realistic_db(tmp_path_factory) -> Path:
    """A small-preset study of long-named architectures and plan variants: five-digit steps and seconds, loads with
    two decimals, two runs whose names differ only in their hash, one failed run and one still running."""
    path = tmp_path_factory.mktemp("runs") / "results.db"

    def extra(arch: str, seed: int) -> dict:
        return {
            "train_seconds": 12345.67 + 1000 * seed,
            "cpu_seconds": 23456.78 + 1000 * seed,
            "threads": 16,
            "concurrent_jobs": 12,
            "load_avg": 7.46 + seed / 100,
            "step": 25000,
            "max_steps": 25000,
        }

    build_fixture_db(
        path,
        preset="small",
        archs=("control", "three-part", "shared-cycle", "relaxed"),
        seeds=(0, 1, 2),
        judge=False,
        evals=False,
        curves=False,
        run_extra=extra,
    )
    # the same name at another learning rate: a second id that only its hash tells apart
    build_fixture_db(
        path,
        preset="small",
        archs=("three-part",),
        seeds=(0,),
        judge=False,
        evals=False,
        curves=False,
        failed_run=False,
        running_run=False,
        overrides={"train.lr": 1e-3},
        run_extra=extra,
    )
    conn = sqlite3.connect(path)
    with conn:  # the names a plan gives its variants
        conn.execute("update runs set variant = 'control-iso-flops' where arch = 'control'")
        conn.execute("update runs set variant = 'three-part-lora-init' where arch = 'three-part'")
    conn.close()
    return path


def _rows(path: Path) -> list[dict]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("select * from runs")]
    conn.close()
    return rows


def _expected(r: dict) -> dict[str, str]:
    """What each column must show for a run, written out from the stored values."""

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return {
        "variant": r["variant"],
        "status": r["status"],
        "step": f"{r['step'] or 0}/{r['max_steps']}",
        "final loss": num(r["final_val_loss"], ".4f"),
        "wall": num(r["train_seconds"], ".1f"),
        "CPU": num(r["cpu_seconds"], ".1f"),
        "thr": num(r["threads"], "d"),
        "jobs": num(r["concurrent_jobs"], "d"),
        "load": num(r["load_avg"], ".2f"),
    }


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names and each row's cells, split on spaces (no cell of this table holds one)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["id"])
    heads = lines[head].replace("final loss", "final_loss").split()
    body = []
    for line in lines[head + 2 :]:
        if not line.strip():
            break
        body.append(line.split())
    return [h.replace("_", " ") for h in heads], body


@pytest.mark.parametrize("columns", [80, 100, 60])
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_number_of_the_runs_table_is_whole(realistic_db, columns):
    res = benchctl("runs", "--db", str(realistic_db), columns=columns)
    assert res.returncode == 0, res.stderr
    assert all(len(line) <= columns for line in res.stdout.splitlines()), res.stdout
    heads, body = _table(res.stdout)
    assert heads[:4] == ["id", "variant", "status", "step"] or heads[:3] == ["id", "status", "step"]
    assert {"id", "status", "step", "final loss"} <= set(heads)
    if columns >= 80:
        assert {"wall", "CPU", "load"} <= set(heads), res.stdout
    rows = _rows(realistic_db)
    short = short_run_ids(r["id"] for r in rows)
    by_short = {short[r["id"]]: r for r in rows}
    assert len(by_short) == len(rows) and len(body) == len(rows)
    for cells in body:
        assert len(cells) == len(heads), (cells, heads)
        run = by_short[cells[0]]  # each id shown names exactly one run
        want = _expected(run)
        assert dict(zip(heads[1:], cells[1:])) == {h: want[h] for h in heads[1:]}
    left_out = {h for h in ("variant", *TIMING) if h not in heads}
    said = " ".join(res.stdout.split()).partition("Left out at this width: ")[2].partition(".")[0]
    assert set(filter(None, said.split(", "))) == left_out


def test_short_ids_keep_a_hash_only_where_a_name_is_shared(realistic_db):
    ids = [r["id"] for r in _rows(realistic_db)]
    short = short_run_ids(ids)
    shared = [i for i in ids if i.startswith("three-part-small-s0-")]
    assert len(shared) == 2 and len({short[i] for i in shared}) == 2
    assert all(short[i] == i[: -len("-0123456789")] for i in ids if i not in shared)
    assert all(len(short[i]) == len("three-part-small-s0-") + 4 for i in shared)
    assert all(i.startswith(short[i]) for i in ids)


def test_whole_ids_with_wide_and_json(realistic_db):
    rows = _rows(realistic_db)
    wide = benchctl("runs", "--db", str(realistic_db), "--wide")
    assert wide.returncode == 0, wide.stderr
    heads, body = _table(wide.stdout)
    assert heads == ["id", "variant", "status", "step", "final loss", *TIMING]
    assert sorted(cells[0] for cells in body) == sorted(r["id"] for r in rows)
    listed = benchctl("runs", "--db", str(realistic_db), "--json")
    assert sorted(r["id"] for r in json.loads(listed.stdout)) == sorted(r["id"] for r in rows)


def test_errors_are_printed_whole_under_the_table(realistic_db):
    res = benchctl("runs", "--db", str(realistic_db), "--status", "failed")
    failed = [r for r in _rows(realistic_db) if r["status"] == "failed"]
    assert failed and all(f"(failed): {r['error']}" in res.stdout for r in failed)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--wide"], ["--status", "running"]])
def test_listing_runs_imports_nothing_heavy(realistic_db, extra):
    ran = run_main(["runs", "--db", str(realistic_db), *extra])
    assert (ran.code, ran.heavy) == (0, [])


@pytest.mark.slow  # a benchctl process that loads pandas
def test_the_import_check_sees_a_heavy_import(realistic_db):
    """`report` reads the database with pandas before it finds that the plan asked for has no runs there: the same
    check finds pandas, so the empty lists above mean something (stopping there spares drawing the figures)."""
    out = realistic_db.parent / "report"
    ran = run_main(["report", "--db", str(realistic_db), "--plan", "no-such-plan", "--out", str(out)])
    assert ran.code == 2 and "no runs of plan 'no-such-plan'" in ran.err, ran.err
    assert "pandas" in ran.heavy


def test_a_command_is_built_alone():
    """`benchctl runs` builds only its own click command (Typer builds every command it holds on each call); help,
    the root's options and a typo get the whole root."""
    from benchctl import cli

    one = cli._app_for(["runs", "--db", "x.db"])
    assert [c.callback.__name__ for c in one.registered_commands] == ["runs"] and not one.registered_groups
    assert [g.name for g in cli._app_for(["plans", "show", "study"]).registered_groups] == ["plans"]
    assert [c.callback.__name__ for c in cli._app_for(["train-all"]).registered_commands] == ["train_all"]
    for argv in ([], ["--help"], ["--version"], ["rns"]):
        assert cli._app_for(argv) is cli.app
    assert len(cli.app.registered_commands) > 1  # the root itself keeps every command


# ---- runs whose process is gone ---------------------------------------------------------------------------------


def _running_row(db: Path, deadline: float) -> dict | None:
    """The run's row once it is recorded as running (None if that never happens before `deadline`)."""
    while time.time() < deadline:
        if db.exists():
            try:
                conn = sqlite3.connect(db, timeout=1)
                conn.row_factory = sqlite3.Row
                row = conn.execute("select * from runs where status = 'running'").fetchone()
                conn.close()
                if row is not None:
                    return dict(row)
            except sqlite3.OperationalError:
                pass
        time.sleep(0.1)
    return None


def _runs(capsys, *args: str) -> str:
    """`benchctl runs ARGS` in this process (the trainer is another one): its output."""
    from benchctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["runs", *args])
    assert e.value.code == 0
    return capsys.readouterr().out


def _states(capsys, db: Path, *args: str) -> dict[str, str]:
    return {r["id"]: r["status"] for r in json.loads(_runs(capsys, "--db", str(db), "--json", *args))}


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_killed_training_shows_as_interrupted_and_a_live_one_as_running(tmp_path, tinystories_dir, capsys):
    """A real training process, told to train far longer than the test waits: running while it lives, interrupted
    once it is killed with SIGKILL (which lets it record nothing), in `runs`, its filters and the report."""
    db = tmp_path / "results.db"
    env = {**os.environ, "BENCHCTL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env.pop("BENCHCTL_DB", None)
    args = ["train", "--arch", "control", "--preset", "tiny", "--data", str(tinystories_dir), "--db", str(db)]
    args += ["--no-progress", "--yes", "--set", "train.max_steps=100000", "--set", "train.eval_interval=100000"]
    trainer = subprocess.Popen([sys.executable, "-m", "benchctl", *args], cwd=REPO, env=env, stderr=subprocess.PIPE)
    try:
        row = _running_row(db, time.time() + 240)
        assert row is not None and trainer.poll() is None, trainer.stderr.read().decode() if trainer.stderr else ""
        assert row["pid"] == trainer.pid and row["pid_started"] and row["heartbeat_at"]
        short = short_run_ids([row["id"]])[row["id"]]
        assert _states(capsys, db) == {row["id"]: "running"}
        assert f"{short} running" in " ".join(_runs(capsys, "--db", str(db)).split())
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert _states(capsys, db) == {row["id"]: "interrupted"}
    table = " ".join(_runs(capsys, "--db", str(db)).split())
    assert f"{short} interrupted" in table and "interrupted: recorded as running" in table
    assert _states(capsys, db, "--status", "interrupted") == {row["id"]: "interrupted"}
    assert _states(capsys, db, "--status", "running") == {}
    conn = sqlite3.connect(db)
    assert conn.execute("select status from runs").fetchone()[0] == "running"  # shown, never written
    conn.close()
    from benchctl.stages.report import engine as report

    md = report.build(db, "tiny").markdown
    assert "Runs of preset `tiny`: 1 interrupted." in md and "Interrupted: recorded as running" in md


def _ago(seconds: float) -> str:
    return (datetime.now(timezone.utc) - timedelta(seconds=seconds)).replace(microsecond=0).isoformat()


def test_a_run_on_this_machine_is_alive_while_its_very_process_is():
    from benchctl.core.liveness import process_start_time, run_state

    here, me = socket.gethostname(), os.getpid()
    mine = {"status": "running", "hostname": here, "pid": me, "pid_started": process_start_time(me)}
    assert run_state(mine) == "running"
    # the same id given to a later process: not the trainer
    assert run_state({**mine, "pid_started": mine["pid_started"] - 3600}) == "interrupted"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert run_state({**mine, "pid": gone.pid, "pid_started": None}) == "interrupted"
    # the stored status of any other row is shown as it is
    assert {run_state({**mine, "pid": gone.pid, "status": s}) for s in ("done", "failed", "pending")} == {
        "done",
        "failed",
        "pending",
    }


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_process_that_exited_but_was_not_collected_is_not_alive():
    from benchctl.core.liveness import alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 60
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.time() < deadline
            time.sleep(0.05)
        assert not alive(child.pid)  # a zombie until its parent (this process) collects it
    finally:
        child.wait()


def test_a_run_of_another_machine_is_alive_while_its_heartbeat_is_recent():
    from benchctl.core.liveness import STALE_AFTER_S, run_state

    row = {"status": "running", "hostname": "elsewhere", "pid": 4242, "started_at": _ago(10 * STALE_AFTER_S)}
    assert run_state({**row, "heartbeat_at": _ago(60)}) == "running"
    assert run_state({**row, "heartbeat_at": _ago(STALE_AFTER_S + 60)}) == "interrupted"
    assert run_state(row) == "interrupted"  # no heartbeat (a benchctl before them): its start is the last sign
    assert run_state({**row, "started_at": None, "updated_at": _ago(30)}) == "running"
    # nothing to tell by: left as recorded (a row written by hand, or by a very old benchctl)
    assert run_state({"status": "running", "hostname": None, "pid": float("nan"), "heartbeat_at": None}) == "running"


def test_the_heartbeat_stamps_only_the_row_its_process_holds(tmp_path):
    from benchctl import stages
    from benchctl.core.liveness import Heartbeat
    from benchctl.stages.train import tables as train_tables

    path = build_fixture_db(tmp_path / "r.db", judge=False, evals=False, curves=False, failed_run=False)
    db = stages.connect(path)
    running = db.execute("select id, pid from runs where status = 'running'").fetchone()
    other = db.execute("select id from runs where status = 'done'").fetchone()[0]
    db.execute("update runs set heartbeat_at = null")
    db.conn.commit()
    train_tables.heartbeat(str(path), running[0], running[1] + 1)  # another process: not its row
    train_tables.heartbeat(str(path), other, running[1])  # not running: left alone
    assert db.execute("select count(*) from runs where heartbeat_at is not null").fetchone()[0] == 0
    beats: list[float] = []
    beat = Heartbeat(lambda: (beats.append(time.time()), train_tables.heartbeat(str(path), *running)), interval=0.05)
    beat.start()
    deadline = time.time() + 30
    while len(beats) < 3 and time.time() < deadline:
        time.sleep(0.02)
    beat.stop()
    assert len(beats) >= 3
    stamped = db.execute("select id from runs where heartbeat_at is not null").fetchall()
    assert [r[0] for r in stamped] == [running[0]]
