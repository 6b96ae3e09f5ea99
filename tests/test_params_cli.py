"""Tests of `benchctl params` (benchctl/commands/params.py over benchctl/accounting.py): the study's four published
totals with match marks, every component each model reports, the JSON form, and one-line errors without a traceback
for typos.

Successful runs go through `typer.testing.CliRunner` on `benchctl.cli.app`; error paths go through
`benchctl.cli.main()` (the one place that turns a BenchctlError into a printed line and an exit code), and once
through the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import architectures
from benchctl.cli import app, main
from benchctl.core import accounting, paper
from benchctl.core.config import make_config

TOTALS = {"control": 4_212_992, "frailt": 4_214_016, "three-part": 4_344_320, "relaxed": 5_462_272}
runner = CliRunner()


def run_error(capsys, argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of `benchctl argv` when it must fail."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    return info.value.code, captured.err


def test_study_totals_are_the_spec_ones():
    assert paper.TOTAL_PARAMS == TOTALS


def test_accounting_table_paper():
    rows = accounting.table("paper")
    assert [r["arch"] for r in rows] == architectures.names()
    for r in rows:
        assert r["components"][0] == "embedding" and r["components"][-1] == "final_norm"
        assert sum(r[c] for c in r["components"]) == r["total_params"]  # every component, whatever the model
        assert r["seq_len"] == 128
        if r["arch"] in TOTALS:
            assert r["total_params"] == r["paper_total_params"] == TOTALS[r["arch"]]
            assert r["matches_paper"] is True
        else:  # an architecture the study did not have has nothing to be compared with
            assert r["paper_total_params"] is None and r["matches_paper"] is None
    by = {r["arch"]: r for r in rows}
    assert by["control"]["components"] == ["embedding", "blocks", "final_norm"]
    assert by["three-part"]["components"] == ["embedding", "blocks", "adapter", "recurrent_norm", "final_norm"]
    assert by["frailt"]["depth_encoding"] == 1_024
    assert (by["three-part"]["adapter"], by["three-part"]["recurrent_norm"]) == (131_072, 256)
    assert by["relaxed"]["lora"] == 1_249_280
    assert [by[a]["effective_depth"] for a in TOTALS] == [4, 16, 16, 16]
    assert [by[a]["n_recur"] for a in TOTALS] == [1, 4, 7, 4]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_accounting_off_paper_has_no_study_total():
    rows = accounting.table("tiny", ["three-part"], {"model.n_recur": 3})
    (r,) = rows
    assert r["paper_total_params"] is None and r["matches_paper"] is None
    assert r["effective_depth"] == 1 + 3 * 2 + 1
    # a changed paper config is still compared, and no longer matches
    (changed,) = accounting.table("paper", ["relaxed"], {"model.lora_rank": 8})
    assert changed["matches_paper"] is False and changed["total_params"] == TOTALS["relaxed"] - 1_249_280 // 2
    # over every architecture an architecture's own key changes only the models that have it
    rows = {r["arch"]: r for r in accounting.table("paper", None, {"model.lora_rank": 8})}
    assert rows["relaxed"]["total_params"] == changed["total_params"]
    assert rows["control"]["total_params"] == TOTALS["control"]


def test_component_names_keep_the_models_order():
    rows = [
        {"components": ["embedding", "blocks", "final_norm"]},
        {"components": ["embedding", "blocks", "gate", "final_norm"]},
        {"components": ["embedding", "lora", "blocks", "final_norm"]},
    ]
    assert accounting.component_names(rows) == ["embedding", "blocks", "gate", "lora", "final_norm"]


def test_describe_uses_the_config_sequence_length():
    cfg = make_config("paper", "control", overrides={"model.max_seq_len": 256})
    row = accounting.describe(cfg)
    # attention grows with T: 4 * T * d per block forward, x3 for training, 4 blocks
    assert row["flops_per_token"] - accounting.describe(make_config("paper", "control"))["flops_per_token"] == (
        3 * 4 * 4 * 128 * 256
    )


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_params_table():
    result = runner.invoke(app, ["params", "--preset", "paper"])
    assert result.exit_code == 0, result.output
    out = result.output
    for arch, total in TOTALS.items():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(arch + " "))
        assert line.count(f"{total:,}") == 2, line  # ours and the study's, side by side
        assert "✓" in line and "✗" not in line
    assert out.count("✓") == 4 + 1  # one per study row, plus the legend
    # one row per component, one column per architecture (in as many tables as fit the terminal, never a count cut
    # short); each column adds up to its total
    assert "…" not in out
    lines: dict[str, list[str]] = {}
    for ln in out.split("unique parameters by component", 1)[1].split("depth and compute", 1)[0].splitlines():
        if ln.strip() and not ln.strip().startswith(("─", "(continued)")):
            lines.setdefault(ln.split()[0], []).extend(ln.split()[1:])
    archs = architectures.names()
    rows = {r["arch"]: r for r in accounting.table("paper")}
    for comp in accounting.component_names(list(rows.values())):
        assert lines[comp] == [f"{rows[a][comp]:,}" if comp in rows[a] else "-" for a in archs], comp
    assert lines["total"] == [f"{rows[a]['total_params']:,}" for a in archs]
    for comp, n in (
        ("depth_encoding", "1,024"),
        ("adapter", "131,072"),
        ("recurrent_norm", "256"),
        ("lora", "1,249,280"),
    ):
        assert n in lines[comp]
    assert "13,706,496" in out  # FraiLT's effective parameters at depth 16


def test_params_table_marks_a_mismatch():
    result = runner.invoke(app, ["params", "--preset", "paper", "--arch", "relaxed", "--set", "model.lora_rank=8"])
    assert result.exit_code == 0, result.output
    assert "✗" in result.output and f"{TOTALS['relaxed']:,}" in result.output


def test_params_json():
    result = runner.invoke(app, ["params", "--preset", "paper", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert isinstance(rows, list) and [r["arch"] for r in rows] == architectures.names()
    for r in rows:
        assert {"arch", "components", "total_params", "paper_total_params", "flops_per_token"} <= r.keys()
        assert r["total_params"] == sum(r[c] for c in r["components"])
        assert r["paper_total_params"] == TOTALS.get(r["arch"])
        assert isinstance(r["flops_per_token"], (int, float)) and r["flops_per_token"] > 0
    flops = {r["arch"]: r["flops_per_token"] for r in rows}
    assert flops["control"] == 26_836_992  # = 3 x (4 blocks + tied head) forward FLOPs at T = 128


def test_params_json_one_arch_list():
    result = runner.invoke(app, ["params", "-p", "tiny", "--arch", "frailt, relaxed", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["arch"] for r in json.loads(result.output)] == ["frailt", "relaxed"]


def test_params_unknown_arch_is_one_line(capsys):
    code, err = run_error(capsys, ["params", "--arch", "thre-part"])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "'thre-part'" in lines[0] and "did you mean 'three-part'?" in lines[0]
    assert "available: " + ", ".join(architectures.names()) in lines[0]
    assert "Traceback" not in err


def test_params_unknown_key_is_one_line(capsys):
    code, err = run_error(capsys, ["params", "--set", "model.dimm=3"])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "unknown config key 'model.dimm'" in lines[0] and "did you mean 'model.dim'?" in lines[0]
    assert "valid keys:" in lines[0] and "model.n_heads" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["params", "--preset", "papr"], "unknown preset 'papr'; did you mean 'paper'?"),
        (["params", "--set", "model.dim"], "--set expects key=value"),
        (["params", "--set", "model.dim=abc"], "model.dim: expected an integer"),
        (
            ["params", "--arch", "three-part", "--set", "model.n_prelude=2", "--set", "model.n_coda=2"],
            "model.n_prelude (2) + model.n_coda (2)",
        ),
        (
            ["params", "--arch", "control", "--set", "model.lora_rank=8"],
            "config key 'model.lora_rank' belongs to architecture 'relaxed', not to 'control'",
        ),
        (
            ["params", "--arch", "frailt", "--set", "model.frailt_init=ones"],
            "model.frailt_init: must be one of zeros, normal; got 'ones'",
        ),
    ],
)
def test_params_config_errors(capsys, argv, expect):
    code, err = run_error(capsys, argv)
    assert code == 2 and expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a benchctl process importing torch
def test_console_script_error_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "benchctl", "params", "--arch", "thre-part"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "three-part" in proc.stderr and ", ".join(architectures.names()) in proc.stderr
