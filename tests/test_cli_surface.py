"""The command line as a newcomer meets it: a wrong --data is reported at once, and the help starts them off."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
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


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_good_data_directory_and_the_hub_pass_the_check(tinystories_dir):
    """The check lets a valid directory through (the command goes on to its next mistake: here an unknown
    architecture, exit 2) and never looks at the hub."""
    from benchctl.core.datadir import check_source

    check_source("hub")
    check_source(tinystories_dir)
    ran = run_main(["train", "--arch", "no-such-arch", "--preset", "tiny", "--data", str(tinystories_dir)])
    assert ran.code == 2 and "no-such-arch" in ran.err


# ---- help --------------------------------------------------------------------------------------------------------


def _help(capsys, monkeypatch, argv: list[str], columns: int) -> str:
    from benchctl.cli import main

    monkeypatch.setenv("COLUMNS", str(columns))  # click sizes help to the terminal when it formats it
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _listed(text: str) -> list[str]:
    """The command names of the root help's command lists, in order."""
    names, in_list = [], False
    for line in text.splitlines():
        if line and not line.startswith(" "):
            in_list = line.endswith(":") and line not in ("Usage:", "Options:")
        elif in_list and line.startswith("  ") and not line.startswith("   "):
            names.append(line.split()[0])
    return names


@pytest.mark.parametrize("columns", [80, 60, 120])
def test_root_help_starts_a_newcomer(capsys, monkeypatch, columns):
    import typer.main

    from benchctl.cli import app

    text = _help(capsys, monkeypatch, ["--help"], columns)
    assert "…" not in text and "..." not in text.replace("[ARGS]...", "")
    intro = text.split("\n\n")[1]
    assert all(f"'benchctl {c}'" in " ".join(intro.split()) for c in ("study", "runs", "report"))
    if columns >= 80:
        assert len(intro.splitlines()) <= 2
    listed = _listed(text)
    assert listed[:3] == ["study", "runs", "report"]
    assert sorted(listed) == sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_the_stages_commands_follow_the_study_order(capsys, monkeypatch):
    from benchctl import stages

    text = _help(capsys, monkeypatch, ["--help"], 100)
    stage_list = text.split("The study's stages")[1].split("\n\n")[0]
    shown = [line.split()[0] for line in stage_list.splitlines()[1:] if line.strip()]
    order = [d.name for d in stages.declared()]
    positions = [order.index(n) for n in shown if n in order]
    assert positions == sorted(positions) and {"prepare", "train", "sample", "eval", "depth"} <= set(shown)


def test_every_short_help_is_whole_in_the_reference_page():
    """docs/cli.md lists each command with its short help, which click would otherwise cut at 45 characters."""
    from benchctl import clidoc

    page = clidoc.render()
    commands = page.split("**Commands**:", 1)[1].split("## ", 1)[0]
    assert "..." not in commands and "…" not in commands


def _registered() -> list[str]:
    from benchctl import stages

    return stages.names()


@pytest.mark.parametrize("stage", _registered())
def test_study_help_names_every_registered_stage(capsys, monkeypatch, stage):
    from benchctl import stages

    text = " ".join(_help(capsys, monkeypatch, ["study", "--help"], 80).split())
    listed = text.split("Stages, in order: ", 1)[1].split(".", 1)[0].split(", ")
    assert listed == stages.names() and stage in listed
    skip = text.split("--skip takes ", 1)[1].split(".", 1)[0].split(", ") if stages.skippable() else []
    assert skip == stages.skippable()
    assert (stage in skip) == (stage in stages.skippable())


@pytest.mark.parametrize("stage", _registered())
def test_the_help_reads_each_stage_as_the_registry_has_it(stage):
    from benchctl import stages

    (reg,) = [s for s in stages.registered() if s.name == stage]
    (dec,) = [d for d in stages.declared() if d.name == stage]
    assert (dec.order, dec.skippable) == (reg.order, reg.skippable)
    assert [d.name for d in stages.declared()] == stages.names()
    # the tables the database is opened with, read without importing the stage, are the stage's own objects
    if dec.tables is not None:
        light = tuple(t for module, attr in dec.tables for t in getattr(importlib.import_module(module), attr))
        assert len(light) == len(reg.tables) and all(a is b for a, b in zip(light, reg.tables, strict=True))


def test_opening_the_database_imports_no_stage(tmp_path):
    """Every command that opens results.db creates its tables: that reads the stages' `tables.py` modules, not the
    stages (their engines and reports import torch, scipy and seaborn), and gives the same tables in the same order."""
    code = (
        "import sys; from benchctl import stages; db = stages.connect(sys.argv[1]);"
        "print(sorted(m for m in sys.modules if m.endswith('.stage') or m.split('.')[0] in ('torch', 'scipy')));"
        "print(db.table_names())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r.db")], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "[]"
    from benchctl import stages

    assert [t.name for t in stages.tables()] == [t.name for s in stages.registered() for t in s.tables]
    assert {t.name for t in stages.tables()} <= set(ast.literal_eval(out[1]))


def test_a_declaration_not_written_out_is_left_to_the_import(tmp_path):
    """A stage whose name, order or skippable flag is computed cannot be read from its source: the light reading
    gives it up (the registry is imported for it instead), and never guesses."""
    from benchctl.stages import Declared, _read_declaration

    path = tmp_path / "stage.py"
    path.write_text('ORDER = 57\nNAME = "norms"\nSTAGE = Stage(name=NAME, order=ORDER, run=run, skippable=True)\n')
    assert _read_declaration(path, "norms") == Declared("norms", 57, True, "norms")
    path.write_text('STAGE = Stage(name="norms", order=50 + 7, run=run)\n')
    assert _read_declaration(path, "norms") is None
    path.write_text('STAGE = Stage(name="norms", order=57, skippable=SKIP)\n')
    assert _read_declaration(path, "norms") is None
    path.write_text('STAGE = make_stage("norms", 57)\n')
    assert _read_declaration(path, "norms") is None
    path.write_text('STAGE = Stage(name="norms", order=57)\n')
    assert _read_declaration(path, "norms") == Declared("norms", 57, False, "norms")
    # tables imported by name are read from their module; any other expression imports the stage for them
    path.write_text('from .tables import TABLES as T\nSTAGE = Stage(name="norms", order=57, tables=T)\n')
    found = _read_declaration(path, "norms")
    assert found is not None and found.tables == (("benchctl.stages.norms.tables", "TABLES"),)
    path.write_text('from .tables import TABLES\nSTAGE = Stage(name="norms", order=57, tables=TABLES + EXTRA)\n')
    found = _read_declaration(path, "norms")
    assert found is not None and found.tables is None
