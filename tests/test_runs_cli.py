"""`benchctl runs`: a table read whole at 80 columns, built without the heavy libraries, and the status of runs whose
process is gone."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import run_main
from fixtures_db import build_fixture_db

from benchctl.core.config import short_run_ids

REPO = Path(__file__).resolve().parents[1]
TIMING = ("wall", "CPU", "thr", "jobs", "load")


def benchctl(*args: str, columns: int = 80, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`benchctl ARGS` in its own process, on a terminal `columns` wide (rich reads COLUMNS when it starts)."""
    full = {
        **os.environ,
        "COLUMNS": str(columns),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    full.pop("BENCHCTL_DB", None)
    return subprocess.run(
        [sys.executable, "-m", "benchctl", *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def realistic_db(tmp_path_factory) -> Path:
    """A small-preset study of long-named architectures and plan variants: five-digit steps and seconds, loads with
    two decimals, two runs whose names differ only in their hash, one failed run and one still running."""
    path = tmp_path_factory.mktemp("runs") / "results.db"

    def extra(arch: str, seed: int) -> dict:
        return {
            "train_seconds": 12345.67 + 1000 * seed,
            "cpu_seconds": 23456.78 + 1000 * seed,
            "threads": 16,
            "concurrent_jobs": 12,
            "load_avg": 7.46 + seed / 100,
            "step": 25000,
            "max_steps": 25000,
        }

    build_fixture_db(
        path,
        preset="small",
        archs=("control", "three-part", "shared-cycle", "relaxed"),
        seeds=(0, 1, 2),
        judge=False,
        evals=False,
        curves=False,
        run_extra=extra,
    )
    # the same name at another learning rate: a second id that only its hash tells apart
    build_fixture_db(
        path,
        preset="small",
        archs=("three-part",),
        seeds=(0,),
        judge=False,
        evals=False,
        curves=False,
        failed_run=False,
        running_run=False,
        overrides={"train.lr": 1e-3},
        run_extra=extra,
    )
    conn = sqlite3.connect(path)
    with conn:  # the names a plan gives its variants
        conn.execute("update runs set variant = 'control-iso-flops' where arch = 'control'")
        conn.execute("update runs set variant = 'three-part-lora-init' where arch = 'three-part'")
    conn.close()
    return path


def _rows(path: Path) -> list[dict]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("select * from runs")]
    conn.close()
    return rows


def _expected(r: dict) -> dict[str, str]:
    """What each column must show for a run, written out from the stored values."""

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return {
        "variant": r["variant"],
        "status": r["status"],
        "step": f"{r['step'] or 0}/{r['max_steps']}",
        "final loss": num(r["final_val_loss"], ".4f"),
        "wall": num(r["train_seconds"], ".1f"),
        "CPU": num(r["cpu_seconds"], ".1f"),
        "thr": num(r["threads"], "d"),
        "jobs": num(r["concurrent_jobs"], "d"),
        "load": num(r["load_avg"], ".2f"),
    }


def _table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header's column names and each row's cells, split on spaces (no cell of this table holds one)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["id"])
    heads = lines[head].replace("final loss", "final_loss").split()
    body = []
    for line in lines[head + 2 :]:
        if not line.strip():
            break
        body.append(line.split())
    return [h.replace("_", " ") for h in heads], body


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_every_number_of_the_runs_table_is_whole(realistic_db, columns):
    res = benchctl("runs", "--db", str(realistic_db), columns=columns)
    assert res.returncode == 0, res.stderr
    assert all(len(line) <= columns for line in res.stdout.splitlines()), res.stdout
    heads, body = _table(res.stdout)
    assert heads[:4] == ["id", "variant", "status", "step"] or heads[:3] == ["id", "status", "step"]
    assert {"id", "status", "step", "final loss"} <= set(heads)
    if columns >= 80:
        assert {"wall", "CPU", "load"} <= set(heads), res.stdout
    rows = _rows(realistic_db)
    short = short_run_ids(r["id"] for r in rows)
    by_short = {short[r["id"]]: r for r in rows}
    assert len(by_short) == len(rows) and len(body) == len(rows)
    for cells in body:
        assert len(cells) == len(heads), (cells, heads)
        run = by_short[cells[0]]  # each id shown names exactly one run
        want = _expected(run)
        assert dict(zip(heads[1:], cells[1:])) == {h: want[h] for h in heads[1:]}
    left_out = {h for h in ("variant", *TIMING) if h not in heads}
    said = " ".join(res.stdout.split()).partition("Left out at this width: ")[2].partition(".")[0]
    assert set(filter(None, said.split(", "))) == left_out


def test_short_ids_keep_a_hash_only_where_a_name_is_shared(realistic_db):
    ids = [r["id"] for r in _rows(realistic_db)]
    short = short_run_ids(ids)
    shared = [i for i in ids if i.startswith("three-part-small-s0-")]
    assert len(shared) == 2 and len({short[i] for i in shared}) == 2
    assert all(short[i] == i[: -len("-0123456789")] for i in ids if i not in shared)
    assert all(len(short[i]) == len("three-part-small-s0-") + 4 for i in shared)
    assert all(i.startswith(short[i]) for i in ids)


def test_whole_ids_with_wide_and_json(realistic_db):
    rows = _rows(realistic_db)
    wide = benchctl("runs", "--db", str(realistic_db), "--wide")
    assert wide.returncode == 0, wide.stderr
    heads, body = _table(wide.stdout)
    assert heads == ["id", "variant", "status", "step", "final loss", *TIMING]
    assert sorted(cells[0] for cells in body) == sorted(r["id"] for r in rows)
    listed = benchctl("runs", "--db", str(realistic_db), "--json")
    assert sorted(r["id"] for r in json.loads(listed.stdout)) == sorted(r["id"] for r in rows)


def test_errors_are_printed_whole_under_the_table(realistic_db):
    res = benchctl("runs", "--db", str(realistic_db), "--status", "failed")
    failed = [r for r in _rows(realistic_db) if r["status"] == "failed"]
    assert failed and all(f"(failed): {r['error']}" in res.stdout for r in failed)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--wide"], ["--status", "running"]])
def test_listing_runs_imports_nothing_heavy(realistic_db, extra):
    ran = run_main(["runs", "--db", str(realistic_db), *extra])
    assert (ran.code, ran.heavy) == (0, [])


@pytest.mark.slow  # a benchctl process that loads pandas and writes a report
def test_the_import_check_sees_a_heavy_import(realistic_db):
    """`report` reads the database with pandas: the same check finds it, so the empty lists above mean something."""
    ran = run_main(["report", "--db", str(realistic_db), "--out", str(realistic_db.parent / "report")])
    assert ran.code == 0 and "pandas" in ran.heavy


def test_a_command_is_built_alone():
    """`benchctl runs` builds only its own click command (Typer builds every command it holds on each call); help,
    the root's options and a typo get the whole root."""
    from benchctl import cli

    one = cli._app_for(["runs", "--db", "x.db"])
    assert [c.callback.__name__ for c in one.registered_commands] == ["runs"] and not one.registered_groups
    assert [g.name for g in cli._app_for(["plans", "show", "study"]).registered_groups] == ["plans"]
    assert [c.callback.__name__ for c in cli._app_for(["train-all"]).registered_commands] == ["train_all"]
    for argv in ([], ["--help"], ["--version"], ["rns"]):
        assert cli._app_for(argv) is cli.app
    assert len(cli.app.registered_commands) > 1  # the root itself keeps every command
