"""The README is a front door whose numbers come from benchctl: its headline table is the committed report's, the
committed report is what `benchctl report` makes of the committed database, and no user-facing page names a
directory of the machine the docs were written on."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from benchctl.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULT = REPO / "docs" / "results" / "controls-small"

# The documentation checks: the pages must hold with the extension examples in the tree (the committed report,
# which documents the committed tree, is left out of that pass by name in .ci/run).
pytestmark = pytest.mark.registry


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


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
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


@pytest.mark.parametrize("path", sorted((REPO / "docs" / "results").glob("*/results.db")), ids=lambda p: p.parent.name)
def test_the_committed_databases_name_no_local_workspace_path(path):
    """A committed study's database is published beside its report: its data source, checkpoint and plan paths
    name no directory of the machine it was trained on (they read DATA_DIR, folders beside the database and the
    built-in plan's place in the package)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        dump = "\n".join(db.iterdump())
    finally:
        db.close()
    assert "INSERT INTO" in dump  # the dump has the rows
    for local in ("shared/data", "/work/", "/home/", "/tmp/"):
        assert local not in dump, local


@pytest.mark.parametrize("path", sorted((REPO / "docs" / "results").glob("*/results.db")), ids=lambda p: p.parent.name)
def test_the_committed_databases_are_single_files(path):
    """In WAL mode every read would leave a -wal and a -shm beside a committed database (and a commit made without
    them could miss rows): committed copies use the rollback journal, as `benchctl share` writes them."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert db.execute("pragma journal_mode").fetchone()[0] == "delete"
    finally:
        db.close()
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith("results.db-")]
