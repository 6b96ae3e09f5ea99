"""`benchctl share`: the copy keeps the finished runs and what hangs off them, thins the training curves, takes local
paths out, and never touches the source or a file that is not benchctl's."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from benchctl import share
from benchctl.cli import main
from benchctl.core.errors import ConfigError
from tests.fixtures_db import build_fixture_db

WORK = "/srv/alice/work"


def _cli(*args: str) -> int:
    """Run `benchctl ARGS` as the console script does; its exit code."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    return e.value.code or 0


def _rows(path: Path, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, args).fetchall()


@pytest.fixture
def source(tmp_path) -> Path:
    """A fixture study with one failed and one running run, plus what a local study adds: training metrics between
    evaluations, a sample (and its grade) of the failed run, and local paths."""
    path = build_fixture_db(tmp_path / "results.db", archs=("control", "frailt", "relaxed"), seeds=(0, 1), evals=False)
    with sqlite3.connect(path) as conn:
        done = [r[0] for r in conn.execute("select id from runs where status = 'done' order by id")]
        failed = conn.execute("select id from runs where status = 'failed'").fetchone()[0]
        for rid in [*done, failed]:
            last = conn.execute("select max(step) from metrics where run_id = ?", (rid,)).fetchone()[0]
            conn.executemany(
                "insert or ignore into metrics (run_id, step, name, value) values (?, ?, 'train_loss', ?)",
                [(rid, s, 5.0 - s / 1000) for s in range(1, last) if s % 7 == 3],
            )
        sid = hashlib.sha256(b"failed-sample").hexdigest()[:16]
        prompt = conn.execute("select prompt_id from samples limit 1").fetchone()[0]
        conn.execute(
            "insert into samples (id, run_id, prompt_id, completion) values (?, ?, ?, 'once')", (sid, failed, prompt)
        )
        grade = conn.execute("select * from judge_grades limit 1").fetchone()
        cols = [d[1] for d in conn.execute("pragma table_info(judge_grades)")]
        row = dict(zip(cols, grade, strict=True)) | {"sample_id": sid}
        conn.execute(
            f"insert into judge_grades ({', '.join(cols)}) values ({', '.join('?' * len(cols))})",
            list(row.values()),
        )
        conn.execute(
            "update runs set data_source = ?, error = ?",
            (f"{WORK}/data/tinystories", f"see {tmp_path}/runs/x/log.txt"),
        )
    return path


def test_the_copy_keeps_finished_runs_and_what_hangs_off_them(source, tmp_path):
    out = tmp_path / "shared" / "results.db"
    out.parent.mkdir()
    before = source.read_bytes()
    result = share.share(source, out)
    assert source.read_bytes() == before  # the source is never written
    done = _rows(source, "select id from runs where status = 'done' order by id")
    assert _rows(out, "select id from runs order by id") == done
    assert result.runs_kept == len(done) and result.runs_dropped == {"failed": 1, "running": 1}
    # every row of a dropped run goes, through the foreign keys: metrics, the sample, the sample's grade
    for table, col in (("metrics", "run_id"), ("samples", "run_id")):
        assert _rows(out, f"select count(*) from {table} where {col} not in (select id from runs)") == [(0,)]
    assert _rows(out, "select count(*) from judge_grades where sample_id not in (select id from samples)") == [(0,)]
    assert result.rows_dropped["judge_grades"] >= 1 and result.rows_dropped["samples"] == 1
    # the finished runs' samples and grades are all there
    for table in ("samples", "prompts"):
        n = "select count(*) from samples where run_id in (select id from runs where status = 'done')"
        sql = n if table == "samples" else "select count(*) from prompts"
        assert _rows(out, sql) == _rows(source, sql)
    meta = json.loads(_rows(out, "select value from meta where key = 'shared_copy'")[0][0])
    assert meta["runs_dropped"] == {"failed": 1, "running": 1}
    assert _rows(out, "pragma journal_mode") == [("delete",)]  # one file, no -wal beside it


def test_training_metrics_are_kept_at_evaluation_steps_and_the_last(source, tmp_path):
    out = share.share(source, tmp_path / "thin.db").path
    for rid, last in _rows(source, "select id, max_steps from runs where status = 'done'"):
        evals = {s for (s,) in _rows(source, "select step from metrics where run_id = ? and name = 'val_loss'", rid)}
        kept = {s for (s,) in _rows(out, "select step from metrics where run_id = ? and name = 'train_loss'", rid)}
        assert kept == (evals | {last}) - {0}  # the fixture logs no training loss at step 0
        assert _rows(out, "select count(*) from metrics where run_id = ? and name = 'val_loss'", rid) == [(len(evals),)]
        # values unchanged
        assert _rows(out, "select step, value from metrics where run_id = ? order by step, name", rid) == _rows(
            source,
            "select step, value from metrics where run_id = ? and (name = 'val_loss' or step in "
            "(select step from metrics where run_id = ? and name = 'val_loss') or step = ?) order by step, name",
            rid,
            rid,
            last,
        )
    every = share.share(source, tmp_path / "all.db", all_metrics=True).path
    n = "select count(*) from metrics where run_id in (select id from runs where status = 'done')"
    assert _rows(every, n) == _rows(source, n)


def test_local_paths_are_redacted_and_the_rest_is_reported(source, tmp_path):
    result = share.share(source, tmp_path / "a.db", home=Path("/srv/alice"))
    # the database's own directory goes (paths become relative to it), home becomes ~
    assert {e for (e,) in _rows(result.path, "select error from runs")} == {"see runs/x/log.txt"}
    assert {d for (d,) in _rows(result.path, "select data_source from runs")} == {"~/work/data/tinystories"}
    assert result.leftover == {}

    other = share.share(source, tmp_path / "b.db", home=Path("/home/bob"))
    assert other.leftover == {"/srv/alice": other.runs_kept}  # named, with how many values
    named = share.share(
        source, tmp_path / "c.db", home=Path("/home/bob"), redactions=[share.parse_redaction(f"{WORK}/data=DATA")]
    )
    assert {d for (d,) in _rows(named.path, "select data_source from runs")} == {"DATA/tinystories"}
    assert named.leftover == {}


def test_default_redactions_never_strip_the_root(tmp_path):
    rules = share.default_redactions(tmp_path / "results.db", home=Path("/"))
    assert all(r.old != "/" and r.old.endswith("/") for r in rules)
    assert rules[0] == share.Redaction(f"{tmp_path}/", "")


def test_url_slashes_are_not_local_paths():
    assert share._ABS_PATH.findall("https://example.org/a/b and val_arch/depth_frac_0") == []
    assert share._ABS_PATH.findall('{"data": "/srv/x/y"} /tmp/z') == ["/srv/x/y", "/tmp/z"]


def test_bad_targets_are_refused_without_writing(source, tmp_path, capsys):
    with pytest.raises(ConfigError, match="not the source"):
        share.share(source, source)
    assert share.parse_redaction("/a=B") == share.Redaction("/a", "B")
    with pytest.raises(ConfigError, match="before '='"):
        share.parse_redaction("=x")
    foreign = tmp_path / "notes.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("create table notes (t text)")
    before = foreign.read_bytes()
    assert _cli("share", str(foreign), "--db", str(source)) != 0
    assert "--force" in capsys.readouterr().err
    assert _cli("share", str(foreign), "--db", str(source), "--force") != 0
    assert "not a benchctl results database" in capsys.readouterr().err
    assert foreign.read_bytes() == before
    assert _cli("share", str(tmp_path / "x.db"), "--db", str(tmp_path / "missing.db")) != 0
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()
    assert not list(tmp_path.glob(".*partial*"))


def test_the_command_prints_what_it_did_and_replaces_its_own_copy(source, tmp_path, capsys):
    out = tmp_path / "copy.db"
    assert _cli("share", str(out), "--db", str(source), "--redact", f"{WORK}/=", "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert first["runs_kept"] == 6 and first["local_paths_left"] == {}
    assert {"old": f"{WORK}/", "new": "", "values": first["runs_kept"]} in first["redacted"]
    assert _cli("share", str(out), "--db", str(source), "--force") == 0  # a benchctl database: replaced
    text = capsys.readouterr().out
    assert "6 finished run(s) kept" in text
    assert "warning: the copy still names local paths: /srv/alice" in " ".join(text.split())


@pytest.mark.parametrize(
    "failure, words",
    [
        (sqlite3.OperationalError("database or disk is full"), "the disk is full"),
        (OSError(30, "Read-only file system"), "read-only file system"),
        (OSError(28, "No space left on device"), "the disk is full"),
    ],
    ids=["sqlite-full", "read-only", "os-full"],
)
def test_a_share_that_cannot_write_is_one_line_exit_8(source, tmp_path, capsys, monkeypatch, failure, words):
    """SQLite's and the OS's words for a full disk or a read-only destination, raised half-way through the copy:
    one line, exit 8, nothing left beside the destination."""
    real = share._edit

    def failing(conn, **kw):
        real(conn, **kw)
        raise failure

    monkeypatch.setattr(share, "_edit", failing)
    out = tmp_path / "copy.db"
    assert _cli("share", str(out), "--db", str(source)) == 8
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".copy.db*"))


def test_a_share_into_a_directory_it_cannot_write_is_one_line(source, tmp_path, capsys, monkeypatch):
    """SQLite cannot open its file in the destination directory (read-only: simulated, as root writes anyway): the
    directory is asked in the OS's words, and the removal of the partial copy in a read-only directory (itself an
    EROFS) does not hide it."""
    import os as os_module

    def connect(path, *a, **k):
        if ".partial-" in str(path):
            raise sqlite3.OperationalError("unable to open database file")
        return real_connect(path, *a, **k)

    def os_open(path, *a, **k):
        raise OSError(30, "Read-only file system")

    def unlink(self, missing_ok=False):
        raise OSError(30, "Read-only file system")

    real_connect = sqlite3.connect
    monkeypatch.setattr(share.sqlite3, "connect", connect)
    monkeypatch.setattr(os_module, "open", os_open)
    monkeypatch.setattr(Path, "unlink", unlink)
    assert _cli("share", str(tmp_path / "copy.db"), "--db", str(source)) == 8
    err = capsys.readouterr().err
    assert "read-only file system" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_share_killed_at_any_point_leaves_the_destination_absent_or_complete(source, tmp_path):
    """kill -9 of a real `benchctl share` process at 20 random moments of its run: the destination is absent or a
    complete shared copy every time, and a rerun without --force writes it and removes the killed runs' leftovers."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "dest" / "copy.db"
    out.parent.mkdir()
    argv = [sys.executable, "-m", "benchctl", "share", str(out), "--db", str(source)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    full = time.perf_counter() - t0
    expected = _rows(out, "select id from runs order by id")
    rng = random.Random(0)
    outcomes = {"absent": 0, "complete": 0}
    for _ in range(20):
        out.unlink(missing_ok=True)
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, full * 1.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            assert _rows(out, "pragma integrity_check") == [("ok",)]
            assert _rows(out, "select id from runs order by id") == expected
            assert _rows(out, "select count(*) from meta where key = 'shared_copy'") == [(1,)]
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
    assert outcomes["absent"] > 0  # the kills did land before the rename
    out.unlink(missing_ok=True)
    subprocess.run(argv, env=env, check=True, capture_output=True)
    assert _rows(out, "select id from runs order by id") == expected
    assert [p.name for p in out.parent.iterdir()] == ["copy.db"]
