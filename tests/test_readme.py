"""The README is a front door whose numbers come from benchctl: its headline table is the committed report's, the
committed report is what `benchctl report` makes of the committed database, and no user-facing page names a
directory of the machine the docs were written on."""

from __future__ import annotations

import re
from pathlib import Path

from benchctl.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULT = REPO / "docs" / "results" / "controls-small"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_readme_links_point_at_files_that_exist():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), target


def test_headline_table_is_the_committed_reports():
    readme = README.read_text().splitlines()
    report = set((RESULT / "report.md").read_text().splitlines())
    start = readme.index("## A result")
    rows = [line for line in readme[start:] if line.startswith("| ")][:8]
    assert len(rows) == 8  # header and the seven models
    for row in rows:
        assert row in report, row


def test_committed_report_is_what_benchctl_makes_of_the_committed_database(tmp_path):
    try:
        main(
            [
                "report",
                "--db",
                str(RESULT / "results.db"),
                "--plan",
                "controls",
                "--preset",
                "small",
                "--out",
                str(tmp_path),
            ]
        )
    except SystemExit as e:
        assert e.code in (0, None)
    assert (tmp_path / "report.md").read_text() == (RESULT / "report.md").read_text(), (
        "the report's text changed: regenerate it with the command in README.md and commit it"
    )
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {p.name for p in (RESULT / "figures").iterdir()}


def test_no_page_names_a_local_workspace_path():
    pages = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert "shared/data" not in text and "/work/" not in text, page
