"""The probes of docs/troubleshooting.md: bad input a careful new user might try, and the one line each gets.

Each row of the table there has a test here: the command, its exit code, and words of its one-line message (no
traceback). The integrity probes (foreign databases, copied checkpoints, SIGTERM, two sweeps) are in
tests/test_integrity.py; the judge's non-JSON bodies in tests/test_judge.py.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from benchctl.cli import main


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code: int | str | None = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return (0 if code is None else int(code)), out.err, out.out


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir) -> Path:
    """A results database with one finished tiny run (its checkpoint beside it)."""
    import os

    folder = tmp_path_factory.mktemp("trained")
    os.environ["BENCHCTL_CACHE"] = str(folder / "cache")
    try:
        main(
            ["train", "--arch", "control", "--preset", "tiny", "--data", str(tinystories_dir), "--yes"]
            + ["--no-progress", "--set", "train.max_steps=6", "--set", "train.warmup_steps=1"]
            + ["--db", str(folder / "results.db")]
        )
    except SystemExit as e:
        assert not e.code
    finally:
        os.environ.pop("BENCHCTL_CACHE", None)
    return folder / "results.db"


def copy_db(src: Path, dst: Path) -> Path:
    """A copy of a results database with what its WAL holds (a copy of the main file alone may lack it)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    return dst


def checkpoint_of(db: Path) -> Path:
    conn = sqlite3.connect(db)
    (rid,) = conn.execute("select id from runs").fetchone()
    conn.close()
    return db.parent / "runs" / rid / "ckpt.pt"


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (
            ["train", "--arch", "control", "--preset", "tiny", "--seed", "99999999999999999999999"],
            2,
            "seed: must be in",
        ),
        (["params", "--preset", "tiny", "--arch", "control", "--set", "model.dim=1000000000"], 2, "not enough memory"),
        (["browse", "--port", "99999", "--no-open"], 2, "--port must be in [1, 65535]"),
        (["runs", "--status", "weird"], 2, "--status must be one of pending, running, interrupted, done, failed"),
        (["judge", "--dry-run", "--temperature", "-5"], 2, "--temperature must be in [0, 2]"),
        (["judge", "--dry-run", "--thinking-budget", "-7"], 2, "--thinking-budget must be -1 (dynamic)"),
        (["bench", "--preset", "tiny", "--check-steps", "-1"], 2, "--check-steps must be >= 0"),
        (["sample", "--n-recur", "100000"], 2, "--n-recur: at most 1024 iterations, got 100000"),
        (["depth", "--depths", "1,100000"], 2, "--depths: at most 1024 iterations, got 100000"),
        (["depth", "--exit", "kl", "--max-depth", "5000"], 2, "--max-depth: at most 1024 iterations, got 5000"),
        (["train-all", "--preset", "tiny", "--seeds", "0-100000"], 2, "--seeds: at most 1000 seeds in one command"),
        (
            ["train-all", "--preset", "tiny", "--seeds", "0,99999999999"],
            2,
            "--seeds: a seed must be in [0, 4294967295]",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_value_is_one_line(tmp_path, capsys, argv, code, words):
    got, err, _ = run_cli(capsys, [*argv, "--db", str(tmp_path / "results.db")] if argv[0] != "params" else argv)
    assert got == code, err
    assert words in one_line(err)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["sample", "--extrapolate", "bogus", "--archs", "control"], "--extrapolate: unknown rule 'bogus'"),
        (["depth", "--extrapolate", "bogus", "--archs", "control"], "--extrapolate: unknown rule 'bogus'"),
        (["sample", "--n-recur", "0"], "--n-recur must be >= 1"),
        (["eval", "--n-recur", "0"], "--n-recur must be >= 1"),
        (["eval", "--tasks", "tinystories_ppll"], "did you mean 'tinystories_ppl'"),
        (["eval", "--runs", "nope"], "unknown run id(s): nope"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_bad_input_to_sample_eval_and_depth_exits_2(trained, capsys, argv, words):
    """Bad input is exit 2 in every command (sample and eval once used 7, the code of an evaluation that cannot run);
    an unknown extrapolation rule is refused even when only fixed-depth runs (the control) are selected."""
    code, err, _ = run_cli(capsys, [*argv, "--db", str(trained), "--no-progress"])
    assert code == 2, err
    assert words in one_line(err)


def test_a_plan_without_variants_says_what_is_missing(tmp_path, capsys):
    plan = tmp_path / "empty.toml"
    plan.write_text('name = "empty"\ndescription = "nothing to compare"\n')
    for argv in (["plans", "show", str(plan)], ["train-all", "--plan", str(plan), "--preset", "tiny"]):
        code, err, _ = run_cli(capsys, [*argv, *(["--db", str(tmp_path / "r.db")] if argv[0] != "plans" else [])])
        assert code == 2, err
        assert f"plan {plan} defines no [[variant]] tables" in one_line(err)  # the brackets shown as written


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_html_in_a_variant_name_is_escaped_in_the_report(trained, tmp_path, capsys):

    db = copy_db(trained, tmp_path / "results.db")
    name = "<b>bold</b><script>alert(1)</script><!-- hidden -->"
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("update runs set variant = ?", (name,))
    conn.close()
    code, err, _ = run_cli(capsys, ["report", "--db", str(db), "--out", str(tmp_path / "out")])
    assert code == 0, err
    md = (tmp_path / "out" / "report.md").read_text()
    assert "&lt;b>bold&lt;/b>&lt;script>alert(1)&lt;/script>&lt;!-- hidden -->" in md
    assert "<script" not in md and "<b>" not in md and "<!--" not in md


def test_escape_html_keeps_code_and_comparisons():
    from benchctl.report.fmt import escape_html

    text = "| <i>x</i> | p < 0.001 | `openai:<name>` |\n```\n<pre>\n```\n## <h1>t</h1>"
    assert escape_html(text) == (
        "| &lt;i>x&lt;/i> | p < 0.001 | `openai:<name>` |\n```\n<pre>\n```\n## &lt;h1>t&lt;/h1>"
    )


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/results/runs/x/y/z", 404),  # no route: Datasette's 404 page once failed with a server error
        ("GET", "/results/runs/-/nope", 404),
        ("GET", "/results/runs/-/insert", 404),
        ("GET", "/nope", 404),
        ("POST", "/results/runs", 405),  # Datasette answers a POST to a table with a server error
        ("POST", "/results/runs/-/insert", 405),
        ("PUT", "/results", 405),
        ("DELETE", "/results/runs", 405),
        ("POST", "/nope", 405),
        ("GET", "/results/runs", 200),
        ("HEAD", "/results/runs", 200),
    ],
)
def test_browse_answers_unknown_routes_404_and_writes_405(browser, method, path, status):
    import asyncio

    r = asyncio.run(browser.client.request(method, path))
    assert r.status_code == status, r.text[:500]
    if status == 405:
        assert r.headers["allow"] == "GET, HEAD"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """The browser's Datasette, in this process, over a new results database (no server, no port)."""
    import asyncio

    from benchctl import browse, stages

    path = tmp_path_factory.mktemp("browse") / "results.db"
    stages.connect(path).conn.close()
    ds = browse.app(browse.check_database(path))
    asyncio.run(ds.invoke_startup())
    return ds


@pytest.mark.parametrize(
    "argv, estimator",
    [
        (["depth", "--depths", "1,2"], "benchctl.stages.depth.engine.planned_seconds"),
        (["sample", "--n-recur", "1", "--n-prompts", "1"], "benchctl.stages.sample.engine.estimate_seconds"),
    ],
    ids=["depth", "sample"],
)
def test_a_long_depth_or_sample_asks_first_and_yes_answers(trained, tmp_path, capsys, monkeypatch, argv, estimator):
    """Within the bounds, work estimated at over an hour asks first, as `train` does: with no terminal to ask on it
    is refused with one line naming --yes (nothing measured or sampled), and --yes starts it."""
    import shutil

    db = copy_db(trained, tmp_path / "results.db")
    shutil.copytree(trained.parent / "runs", tmp_path / "runs")
    monkeypatch.setattr(estimator, lambda *a, **kw: 7200.0)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    code, err, _ = run_cli(capsys, [*argv, "--db", str(db), "--no-progress"])
    assert code == 130, err
    assert "would take about 2.0 h; pass --yes to start anyway" in one_line(err)
    conn = sqlite3.connect(db)
    assert conn.execute("select count(*) from depth_results").fetchone()[0] == 0
    assert conn.execute("select count(*) from samples").fetchone()[0] == 0
    conn.close()
    code, err, _ = run_cli(capsys, [*argv, "--db", str(db), "--no-progress", "--yes"])
    assert code == 0, err


@pytest.mark.parametrize("out", ["/etc/passwd", "/proc/nope"])
def test_report_into_a_place_it_cannot_write_is_one_line(trained, capsys, out):
    code, err, _ = run_cli(capsys, ["report", "--db", str(trained), "--out", out])
    assert code == 8, err  # an output that cannot be written: exit 8, asked before the report is built
    assert f"cannot write {out}" in one_line(err)


@pytest.mark.slow  # a process importing lm-eval per case
@pytest.mark.parametrize(
    "model_args, tasks, words",
    [
        (",n_recur=0", "tinystories_ppl", "n_recur must be an integer >= 1"),
        (",dtype=fp8", "tinystories_ppl", "dtype must be auto or one of float32"),
        ("", "nosuchtask", "Tasks not found: nosuchtask"),
    ],
)
def test_lm_eval_bad_arguments_are_one_line(trained, model_args, tasks, words):
    argv = ["lm-eval", "--model", "benchctl", "--model_args", f"checkpoint={checkpoint_of(trained)}{model_args}"]
    code, err = run_subprocess([*argv, "--tasks", tasks, "--limit", "2"], trained.parent / "cache")
    assert code == 2, err
    # lm-eval logs its own warnings (about --limit) before; the error is the last line
    assert words in err.strip().splitlines()[-1] and "Traceback" not in err


@pytest.mark.slow  # a process importing lm-eval
def test_lm_eval_on_a_file_that_is_no_checkpoint_gives_no_advice_to_delete_it(tmp_path):
    argv = ["lm-eval", "--model", "benchctl", "--model_args", "checkpoint=/etc/passwd", "--tasks", "tinystories_ppl"]
    code, err = run_subprocess(argv, tmp_path)
    line = err.strip().splitlines()[-1]
    assert code == 4 and "unreadable" in line and "delete" not in line and "Traceback" not in err


def run_subprocess(argv: list[str], cache: Path) -> tuple[int, str]:
    """lm-eval's logging keeps the stream it first saw: in-process runs would log into a closed capture."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BENCHCTL_CACHE": str(cache), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "benchctl", *argv], env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr


def test_out_of_memory_is_recognised_and_nothing_else():
    from benchctl.cli import _out_of_memory

    alloc = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 25600000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert "not enough memory for this configuration (23.8 GiB at once)" in _out_of_memory(alloc)
    assert _out_of_memory(MemoryError()) is not None
    assert _out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is not None
    assert _out_of_memory(RuntimeError("shape mismatch")) is None


def test_a_checkpoint_write_on_a_full_disk_says_so_and_keeps_the_previous_one(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from benchctl.core import checkpoint as ckpt
    from benchctl.core.errors import CheckpointError

    path = tmp_path / "ckpt.pt"
    ckpt.save(path, {"config": "{}", "step": 2})
    before = path.read_bytes()

    def full(target, write):  # what torch's zip writer says when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 5824 vs 5760")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt, "atomic_write", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(CheckpointError, match="the disk is full") as info:
        ckpt.save(path, {"config": "{}", "step": 4})
    assert "Nothing was lost" in str(info.value) and "rerun" in str(info.value)
    assert path.read_bytes() == before
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # with space left it is not a full disk: kept as is
        ckpt.save(path, {"config": "{}", "step": 4})
