"""Tests of `benchctl lm-eval` (benchctl/lm_eval_cli.py, benchctl/commands/lm_eval.py) on a tiny trained run.

- End to end in a subprocess, as a user types it: lm-eval's own results table on stdout, its --output_path file,
  exit code 0; with --record, the metrics land in eval_results keyed like `benchctl eval`'s rows (same task
  version, limit, recurrence) and equal to what `benchctl eval` computes on the same documents.
- What --record cannot key, a bundled task without a benchctl checkpoint, and a run missing from the database are
  one-line errors with eval's exit code, before anything is evaluated; lm-eval's own argument errors stay its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchctl import stages
from benchctl.cli import main
from benchctl.core import data as datamod
from benchctl.core.checkpoint import CKPT_NAME, run_dir
from benchctl.core.config import RunConfig
from benchctl.stages.eval import api as ev
from benchctl.stages.train import tables as train_tables


def run_cli(argv: list[str]) -> None:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"benchctl {' '.join(argv)} exited with {e.code}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir):
    root = tmp_path_factory.mktemp("lm_eval_cli")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
        mp.delenv("BENCHCTL_DB", raising=False)
        db = root / "results.db"
        run_cli(
            [
                "train-all",
                "--preset",
                "tiny",
                "--archs",
                "control",
                "--data",
                str(tinystories_dir),
                "--db",
                str(db),
                "--set",
                "train.max_steps=3",
                "--set",
                "train.warmup_steps=1",
                "--no-progress",
                "--yes",
            ]
        )
        (row,) = train_tables.runs(stages.connect(db), status="done")
        yield {"root": root, "db": db, "run": row, "ckpt": run_dir(db, row["id"]) / CKPT_NAME}


@pytest.mark.slow
def test_lm_eval_passthrough_prints_its_table_and_records(trained):
    out_dir = trained["root"] / "lm_eval_out"
    env = {**os.environ, "BENCHCTL_CACHE": str(trained["root"] / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("BENCHCTL_DB", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchctl",
            "lm-eval",
            "--model",
            "benchctl",
            "--model_args",
            f"checkpoint={trained['ckpt']}",
            "--tasks",
            "tinystories_ppl",
            "--limit",
            "5",
            "--batch_size",
            "16",
            "--output_path",
            str(out_dir),
            "--record",
            "--db",
            str(trained["db"]),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=trained["root"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table and "Tasks" in table[0] and "Metric" in table[0], proc.stdout
    assert any("tinystories_ppl" in line and "bits_per_byte" in line for line in table), proc.stdout
    results_files = list(out_dir.rglob("results_*.json"))
    assert len(results_files) == 1
    saved = json.loads(results_files[0].read_text())
    assert "bits_per_byte,none" in saved["results"]["tinystories_ppl"]

    handle = stages.connect(trained["db"])
    rows = {r["metric"]: r for r in handle.query("select * from eval_results where task = 'tinystories_ppl'")}
    assert set(rows) >= {"bits_per_byte", "byte_perplexity", "word_perplexity"}
    cfg = RunConfig.from_json(trained["run"]["config_json"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(trained["root"] / "cache"))
        prepared = datamod.prepare(cfg.data, cfg.model.vocab_size, progress=False)
        version = ev.build_bundled_tasks(prepared, ["tinystories_ppl"]).versions["tinystories_ppl"]
        for r in rows.values():
            assert (r["run_id"], r["n_recur"], r["limit_n"], r["batch_size"], r["task_version"]) == (
                trained["run"]["id"],
                cfg.model.n_recur,
                5,
                16,
                version,
            )
            assert r["value"] == pytest.approx(saved["results"]["tinystories_ppl"][f"{r['metric']},none"])
            assert (r["dtype"], r["dtype_reason"]) == ("float32", "default: float32")  # no dtype in --model_args
        # The same documents through `benchctl eval` give the same numbers.
        opts = ev.EvalOptions(tasks=["tinystories_ppl"], limit=5, batch_size=16, device="cpu", force=True)
        summary = ev.evaluate_runs(handle, trained["db"], opts, progress=False)
    again = {r["metric"]: r["value"] for r in summary.rows if r["task"] == "tinystories_ppl"}
    for metric, r in rows.items():
        assert again[metric] == pytest.approx(r["value"], rel=1e-5), metric


def _error(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


def test_what_cannot_run_fails_in_one_line(trained, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHCTL_CACHE", str(trained["root"] / "cache"))
    ckpt = f"checkpoint={trained['ckpt']}"
    empty = tmp_path / "empty.db"
    stages.connect(empty).conn.close()
    for argv, code, words in (
        (
            [
                "--model",
                "benchctl",
                "--model_args",
                ckpt,
                "--tasks",
                "tinystories_ppl",
                "--limit",
                "0.5",
                "--record",
                "--db",
                str(trained["db"]),
            ],
            2,
            "--limit",
        ),
        (["--model", "hf", "--model_args", "pretrained=gpt2", "--tasks", "tinystories_*"], 2, "checkpoint="),
        (
            ["--model", "benchctl", "--model_args", ckpt, "--tasks", "tinystories_ppl", "--record", "--db", str(empty)],
            5,
            "is not in",
        ),
        (["--model", "hf", "--tasks", "hellaswag", "--record"], 2, "--record"),
    ):
        got, err = _error(capsys, ["lm-eval", *argv])
        assert got == code, err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_lm_eval_argument_errors_are_its_own(capsys):
    with pytest.raises(SystemExit) as info:
        main(["lm-eval", "--model", "benchctl", "--limit", "not-a-number"])
    assert info.value.code == 2
    assert "--limit" in capsys.readouterr().err
