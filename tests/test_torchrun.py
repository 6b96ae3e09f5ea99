"""torchrun on the CPU (gloo, 2 processes): every rank takes the same skip / resume / abort decision.

Before rank 0 decided for all, a rerun of a finished run under torchrun had rank 0 print "already done" and exit while
rank 1 built the model and died in DDP's constructor (gloo: "Connection closed by peer"; NCCL: a hang until the
timeout). The same happened when rank 0 alone stopped at the long-run confirmation.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.test_train import REPO, env_for

TINY = ["--preset", "tiny", "--no-progress", "--set", "train.warmup_steps=1", "--set", "train.eval_interval=3"]


def torchrun(args: list[str], cache, **kw) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node 2 -m benchctl ...` (through python -m, torchrun need not be on PATH)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "benchctl",
            *args,
        ],
        env=env_for(cache),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.slow
def test_torchrun_rerun_of_a_done_run_skips_on_every_rank(tmp_path, tinystories_dir):
    args = [
        "train",
        "--arch",
        "control",
        *TINY,
        "--set",
        "train.max_steps=4",
        "--data",
        str(tinystories_dir),
        "--db",
        str(tmp_path / "results.db"),
        "--yes",
    ]
    first = torchrun(args, tmp_path / "cache")
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    again = torchrun(args, tmp_path / "cache")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "already done (rerun skipped)" in out
    assert "Traceback" not in err and "Connection closed" not in err


@pytest.mark.slow
def test_torchrun_abort_at_the_confirmation_stops_every_rank_cleanly(tmp_path, tinystories_dir):
    """Rank 0 refuses a long run (no --yes, nobody to ask): every rank exits with the abort's code, no traceback."""
    args = [
        "train",
        "--arch",
        "control",
        "--preset",
        "paper",
        "--no-progress",
        "--set",
        "model.vocab_size=512",
        "--data",
        str(tinystories_dir),
        "--db",
        str(tmp_path / "results.db"),
    ]
    p = torchrun(args, tmp_path / "cache", stdin=subprocess.DEVNULL)
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0
    # both ranks stop on the same one-line refusal with the abort's exit code (the traceback torchrun prints after
    # is its own report of a non-zero exit, not a crash); no rank is left behind to break the process group
    assert err.count("would take about") == 2 and "exitcode  : 130" in err
    assert "Connection closed" not in err and "benchctl/" not in err


def _final(db) -> tuple[str, float, list[float]]:
    con = sqlite3.connect(db)
    status, final = con.execute("select status, final_val_loss from runs").fetchone()
    vals = [v for (v,) in con.execute("select value from metrics where name = 'val_loss' order by step")]
    return status, final, vals


@pytest.mark.slow
def test_killed_torchrun_run_resumes_to_the_same_final_loss(tmp_path, tinystories_dir):
    common = [
        "train",
        "--arch",
        "control",
        *TINY,
        "--set",
        "train.max_steps=40",
        "--set",
        "train.ckpt_interval=2",
        "--data",
        str(tinystories_dir),
        "--yes",
    ]
    whole = torchrun([*common, "--db", str(tmp_path / "whole" / "results.db")], tmp_path / "cache")
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err

    killed_db = tmp_path / "killed" / "results.db"
    p = torchrun([*common, "--db", str(killed_db)], tmp_path / "cache", start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:  # kill once a checkpoint past step 0 exists
        if killed_db.exists():
            try:
                row = sqlite3.connect(killed_db).execute("select max(step) from checkpoints").fetchone()
            except sqlite3.OperationalError:  # the schema is still being created
                row = None
            if row and row[0] and row[0] >= 4:
                break
        time.sleep(0.2)
    assert p.poll() is None, "the run finished before it could be killed; make it longer"
    import os

    os.killpg(p.pid, signal.SIGKILL)  # torchrun and both ranks at once, as a lost node would
    p.communicate(timeout=60)
    resumed = torchrun([*common, "--db", str(killed_db)], tmp_path / "cache")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    s1, f1, v1 = _final(tmp_path / "whole" / "results.db")
    s2, f2, v2 = _final(killed_db)
    assert s1 == s2 == "done"
    assert f2 == pytest.approx(f1, abs=1e-5)
    assert v2 == pytest.approx(v1, abs=1e-5)


@pytest.mark.slow
def test_study_under_torchrun_trains_on_every_rank_and_reports_once(tmp_path, tinystories_dir):
    """The study keeps one process group for its training and then rank 0 alone runs the later stages: the other
    rank stops cleanly instead of sampling, evaluating and writing the same report a second time."""
    args = [
        "study",
        "--archs",
        "control",
        "--seeds",
        "0",
        *TINY,
        "--no-bench",
        "--set",
        "train.max_steps=4",
        "--skip",
        "sample,judge,eval",
        "--data",
        str(tinystories_dir),
        "--db",
        str(tmp_path / "results.db"),
        "--out",
        str(tmp_path / "reports"),
        "--yes",
    ]
    p = torchrun(args, tmp_path / "cache")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert out.count(" prepare: data source") == 1 and out.count(" train: plan") == 1, out  # one voice: rank 0's
    assert (tmp_path / "reports" / "report.md").exists()
    assert "Traceback" not in err and "Connection closed" not in err
    assert sqlite3.connect(tmp_path / "results.db").execute("select status from runs").fetchall() == [("done",)]
