"""`benchctl report --plan NAME`: one plan's runs alone, under its variant names, when the database holds several."""

from __future__ import annotations

import pytest

from benchctl.cli import main
from tests.fixtures_db import CONTROLS_VARIANTS, DEPTH_VARIANTS, build_plan_fixture_db


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory):
    path = tmp_path_factory.mktemp("two_plans") / "results.db"
    build_plan_fixture_db(path, "controls", CONTROLS_VARIANTS[:2] + CONTROLS_VARIANTS[4:5], seeds=(0,))
    build_plan_fixture_db(path, "depth", DEPTH_VARIANTS[:2], seeds=(0,))
    return path


def _report(capsys, db, out, *extra) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["report", "--db", str(db), "--out", str(out), *extra])
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_plan_keeps_only_that_plans_runs(two_plans, tmp_path, capsys):
    code, _, err = _report(capsys, two_plans, tmp_path / "depth", "--plan", "depth")
    assert code == 0, err
    md = (tmp_path / "depth" / "report.md").read_text()
    assert "| frailt-r1 |" in md and "| frailt-r2 |" in md
    assert "| control-2x |" not in md and "Runs of preset `tiny`: 2 done" in md  # the controls plan's are left out
    code, _, err = _report(capsys, two_plans, tmp_path / "all")
    md = (tmp_path / "all" / "report.md").read_text()
    assert code == 0 and "| control-2x |" in md and "| frailt-r1 |" in md  # without --plan: every run of the preset


def test_report_plan_without_runs_is_one_line(two_plans, tmp_path, capsys):
    code, out, err = _report(capsys, two_plans, tmp_path / "r", "--plan", "retrofit")
    assert code != 0 and "Traceback" not in out + err
    assert "no runs of plan 'retrofit'" in out + err and "controls, depth" in out + err
    assert not (tmp_path / "r" / "report.md").exists()
