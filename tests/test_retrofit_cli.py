"""`benchctl retrofit`: a finished control converted into recurrent models and trained as new runs."""

from __future__ import annotations

import sqlite3

import pytest
from test_train import run_cli

from benchctl import stages
from benchctl.stages.train import tables as train_tables


@pytest.fixture(scope="module")
def parent(tmp_path_factory, tinystories_dir):
    """A finished 16-layer tiny control (few steps: enough to be far from a fresh model's loss)."""
    root = tmp_path_factory.mktemp("retrofit")
    mp = pytest.MonkeyPatch()
    mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
    db_path = root / "results.db"
    code = run_cli(
        [
            "train",
            "--arch",
            "control",
            "--preset",
            "tiny",
            "--data",
            str(tinystories_dir),
            "--db",
            str(db_path),
            "--no-progress",
            "--set",
            "model.n_layers=16",
            "--set",
            "train.max_steps=12",
        ]
    )
    assert code == 0
    con = sqlite3.connect(db_path)
    rid = con.execute("select id from runs").fetchone()[0]
    con.close()
    yield db_path, rid
    mp.undo()


def _retrofit(db_path, *args):
    return run_cli(
        ["retrofit", "--db", str(db_path), "--no-progress", "--steps", "2", "--set", "train.warmup_steps=1", *args]
    )


def _row(db_path, where, params):
    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    row = con.execute(f"select * from runs where {where}", params).fetchone()
    con.close()
    return dict(row) if row else None


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_retrofit_makes_a_done_run_that_starts_near_the_parent(parent, capsys):
    db_path, pid = parent
    p = _row(db_path, "id = ?", [pid])
    ranks = {}
    for rank in (4, 32):
        assert (
            _retrofit(
                db_path,
                "--from",
                pid,
                "--to",
                "relaxed",
                "--init",
                "average",
                "--lora-init",
                "svd",
                "--set",
                f"model.lora_rank={rank}",
            )
            == 0
        )
        ranks[rank] = _row(db_path, "parent_run_id = ? and config_json like ?", [pid, f'%"lora_rank": {rank},%'])
    assert "retrofit " + pid in capsys.readouterr().out
    for r in ranks.values():
        assert r["status"] == "done" and r["init_method"] == "average+svd" and r["step"] == 2
        assert r["parent_tokens"] == p["tokens_seen"] > 0
        assert r["parent_flops"] == pytest.approx(p["flops_per_token"] * p["tokens_seen"])
        assert f'"init_from": "{pid}:average+svd"' in r["config_json"]
    fresh = p["initial_val_loss"]  # the parent's own loss before training: a fresh model's
    # right after conversion, before any step: far below a fresh model (it keeps most of what the parent learned,
    # whatever the data), and at full rank the parent's exactly up to the norm gains the shared blocks average
    gain = fresh - p["final_val_loss"]
    assert gain > 0.2
    assert ranks[4]["initial_val_loss"] < fresh - 0.8 * gain
    assert (
        abs(ranks[32]["initial_val_loss"] - p["final_val_loss"])
        <= abs(ranks[4]["initial_val_loss"] - p["final_val_loss"]) + 1e-6
    )
    # a rerun is skipped (same id: the conversion is part of the run's identity, not a fresh relaxed run's)
    assert _retrofit(db_path, "--from", pid, "--to", "relaxed", "--init", "average", "--set", "model.lora_rank=4") == 0
    assert "already done" in capsys.readouterr().out


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_three_part_selection_and_frailt_stepwise(parent):
    db_path, pid = parent
    assert _retrofit(db_path, "--from", "control", "--to", "three-part", "--init", "select") == 0
    assert _retrofit(db_path, "--from", pid, "--to", "frailt", "--init", "stepwise") == 0
    tp = _row(db_path, "arch = 'three-part'", [])
    fr = _row(db_path, "arch = 'frailt'", [])
    assert tp["init_method"] == "select" and fr["init_method"] == "stepwise"
    assert tp["status"] == fr["status"] == "done"


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--to", "relaxed", "--init", "average", "--set", "model.n_layers=3"],
            "L x R = 3 x 4 = 12 layers; the parent has 16",
        ),
        (["--to", "three-part", "--init", "average"], "use select"),
        (["--to", "relaxed", "--init", "middle"], "--init must be one of stepwise, average, select"),
        (["--to", "relaxed", "--init", "average", "--set", "model.dim=64"], "(512, 64)"),
    ],
)
def test_impossible_retrofits_are_one_clear_line(parent, capsys, args, needle):
    db_path, pid = parent
    assert _retrofit(db_path, "--from", pid, *args) != 0
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.slow  # reads the runs the slow tests above made
def test_unknown_parent_and_a_recurrent_parent_are_refused(parent, capsys):
    db_path, _ = parent
    assert _retrofit(db_path, "--from", "nope", "--to", "relaxed", "--init", "average") != 0
    assert "no run with that id" in capsys.readouterr().err
    rid = _row(db_path, "arch = 'relaxed'", [])["id"]
    assert _retrofit(db_path, "--from", rid, "--to", "relaxed", "--init", "average") != 0
    assert "converts a plain transformer" in capsys.readouterr().err


@pytest.mark.slow  # reads the runs the slow tests above made
def test_init_from_without_retrofit_is_refused(parent, capsys, tinystories_dir):
    db_path, pid = parent
    code = run_cli(
        [
            "train",
            "--arch",
            "relaxed",
            "--preset",
            "tiny",
            "--data",
            str(tinystories_dir),
            "--db",
            str(db_path),
            "--no-progress",
            "--set",
            f"train.init_from={pid}:average+svd",
        ]
    )
    assert code != 0 and "benchctl retrofit" in capsys.readouterr().err
    assert train_tables.retrofit_runs(stages.connect(db_path))  # the retrofitted runs are listed


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_has_a_retrofit_section_with_compute_including_the_parent(parent):
    from benchctl.stages.report.engine import build

    db_path, pid = parent
    p = _row(db_path, "id = ?", [pid])
    rendered = build(db_path, "tiny")
    md = rendered.markdown
    section = md.split("## Retrofit", 1)[1].split("\n## ", 1)[0]
    assert "| relaxed [" in section and "average+svd" in section and "select" in section
    # parent TFLOP = the parent's FLOPs/token x its tokens
    assert f"{p['flops_per_token'] * p['tokens_seen'] / 1e12:.3f}" in section
    assert "retrofit_loss_flops.png" in rendered.figures


def test_no_retrofit_section_without_retrofitted_runs(tmp_path):
    from benchctl.stages.report.engine import build

    md = build(stages.connect(tmp_path / "empty.db")).markdown
    assert "## Retrofit" not in md
