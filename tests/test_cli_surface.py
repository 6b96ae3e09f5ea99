"""The command line as a newcomer meets it: a wrong --data is reported at once, and the help starts them off."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_process import run_main

from benchctl.core.errors import DataError

# every command that takes --data, with the other arguments it needs to get as far as reading it
DATA_COMMANDS = [
    ["train", "--arch", "control", "--preset", "tiny"],
    ["train-all", "--preset", "tiny", "--archs", "control", "--seeds", "0"],
    ["study", "--preset", "tiny", "--seeds", "0"],
    ["prepare", "--preset", "tiny"],
    ["retrofit", "--from", "control", "--preset", "tiny"],
    ["plans", "show", "study", "--preset", "tiny"],
]


def _bad_sources(root: Path) -> dict[str, tuple[Path, str]]:
    """Data sources that cannot be prepared, each with what its error says."""
    (root / "a-file.txt").write_text("not a directory")
    (root / "no-valid").mkdir()
    (root / "no-valid" / "train.txt").write_text("Once upon a time.\n<|endoftext|>\n")
    (root / "two-trains").mkdir()
    for name in ("train.txt", "train.jsonl", "valid.txt"):
        (root / "two-trains" / name).write_text("")
    return {
        "missing": (root / "nonexistent", "does not exist"),
        "file": (root / "a-file.txt", "is a file"),
        "no valid split": (root / "no-valid", "no valid split"),
        "two train files": (root / "two-trains", "holds several train files"),
    }


@pytest.mark.parametrize("argv", DATA_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_missing_data_directory_is_one_line_before_torch(argv):
    ran = run_main([*argv, "--data", "/nonexistent"])
    assert ran.code == DataError.exit_code, ran.err
    lines = ran.err.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("error: --data: data source /nonexistent does not exist")
    assert ran.heavy == [], ran.heavy


@pytest.mark.parametrize("kind", ["missing", "file", "no valid split", "two train files"])
def test_every_wrong_data_directory_is_reported_before_torch(tmp_path, kind):
    path, says = _bad_sources(tmp_path)[kind]
    ran = run_main(["train", "--arch", "control", "--preset", "tiny", "--data", str(path)])
    assert ran.code == DataError.exit_code and says in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err
    assert ran.heavy == []


def test_a_wrong_benchctl_data_is_reported_the_same_way(tmp_path):
    ran = run_main(["study", "--preset", "tiny"], env={"BENCHCTL_DATA": str(tmp_path / "gone")})
    assert ran.code == DataError.exit_code and not ran.heavy
    assert ran.err.startswith("error: $BENCHCTL_DATA: data source")


def test_a_good_data_directory_and_the_hub_pass_the_check(tinystories_dir):
    """The check lets a valid directory through (the command goes on to its next mistake: here an unknown
    architecture, exit 2) and never looks at the hub."""
    from benchctl.core.datadir import check_source

    check_source("hub")
    check_source(tinystories_dir)
    ran = run_main(["train", "--arch", "no-such-arch", "--preset", "tiny", "--data", str(tinystories_dir)])
    assert ran.code == 2 and "no-such-arch" in ran.err
