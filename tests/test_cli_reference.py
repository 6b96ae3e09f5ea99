"""The command-line reference page (docs/cli.md) is the Typer app's own help: regenerated here, compared whole."""

from __future__ import annotations

import pytest

from benchctl import clidoc

# The command line holds every registered stage's command: an added stage must get its section (the whole page,
# which documents the committed tree, is left out of that pass by name in .ci/run).
pytestmark = pytest.mark.registry


def test_cli_reference_matches_the_commands():
    committed = clidoc.PAGE.read_text()
    assert committed == clidoc.render(), (
        "docs/cli.md disagrees with the command line's options: run `python -m benchctl.clidoc` and commit the page"
    )


def test_every_command_has_a_section():
    import typer.main

    from benchctl.cli import app

    page = clidoc.render()
    for name in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
        assert f"## `benchctl {name}`" in page
