"""Tests of `benchctl browse` (benchctl/browse.py, benchctl/commands/browse.py).

- The metadata describes every table the stages declare, with every column, title, facets and units.
- A real server (`python -m benchctl browse`, a subprocess on a free port of 127.0.0.1) over a fixture study
  database: table pages carry the descriptions, every canned query's JSON returns rows, a row written while it
  serves shows up, and SQL that writes is refused.
- Canned queries follow the file's schema: a depth_results table adds one (so does inference_results), a variant
  column labels the models.
- A missing file, a directory, a non-SQLite file and an SQLite file without benchctl's tables exit non-zero with
  one line; so does a port that is taken.
- Laid out for reading (through the same real server): the runs overview shows the columns read first and the
  config last, rounded; its run ids link to the validation-curve query with the id filled in; every canned query
  rounds its floats; the runs table's column descriptions sit in a collapsed list, still in each header's menu.
- Query parameters Datasette cannot read are answered 400 with a short message and no traceback on the server, on
  the runs table and another; an error from code other than Datasette's stays a 500 with its traceback.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from datasette import hookimpl
from datasette.plugins import pm

from benchctl import browse, stages
from benchctl.cli import main
from tests.fixtures_db import build_fixture_db


@pytest.mark.registry  # browse describes every registered stage's tables and serves their queries
def test_every_described_table_is_in_the_metadata_with_its_columns(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0,), judge=False, evals=False)
    served = browse.check_database(path)
    tables = browse.metadata(served)["databases"][served.name]["tables"]
    for name, spec in browse.described_tables().items():
        entry = tables[name]
        assert (entry["title"], entry["description"]) == (spec.title, spec.description)
        assert list(entry["columns"]) == served.columns[name] == spec.column_names
        assert all(entry["columns"][c.name].startswith(c.description) for c in spec.columns)
    assert tables["runs"]["facets"] == ["arch", "variant", "preset", "status"]
    assert tables["runs"]["units"]["train_seconds"] == "s" and "final_val_loss" not in tables["runs"]["units"]


def test_units_are_named_where_they_matter():
    assert browse.describe("runs", "final_val_loss").endswith("[nats/token]")
    assert browse.describe("runs", "train_seconds").endswith("[s]")
    assert browse.describe("runs", "peak_rss_bytes").endswith("[bytes]")
    assert browse.describe("runs", "flops_per_token").endswith("[FLOPs/token]")
    assert browse.describe("runs", "no_such_column") is None


def _add_depth_rows(path: Path) -> None:
    conn = sqlite3.connect(path)
    with conn:
        run_ids = [r[0] for r in conn.execute("select id from runs where status = 'done'")]
        conn.executemany(
            "insert into depth_results (run_id, n_recur, exit_rule, threshold, extrapolate, windows, "
            "val_loss) values (?, ?, '', 0, '', 8, ?)",
            [(rid, r, 3.5 - 0.1 * r) for rid in run_ids for r in (1, 2, 4)],
        )
    conn.close()


def _add_accuracy_rows(path: Path) -> None:
    """Task-accuracy rows (a reasoning task's measure) on the fixture's runs, so its canned query has rows to show."""
    conn = sqlite3.connect(path)
    with conn:
        run_ids = [r[0] for r in conn.execute("select id from runs where status = 'done'")]
        conn.executemany(
            "insert into accuracy_results (run_id, task, level, in_distribution, n_recur, trained_n_recur, problems, "
            "seed, correct, accuracy) values (?, 'addition', ?, ?, 1, 1, 10, 0, ?, ?)",
            [(rid, lv, int(lv == "id"), k, k / 10) for rid in run_ids for lv, k in (("id", 9), ("d15", 1))],
        )
    conn.close()


@pytest.mark.registry  # browse describes every registered stage's tables and serves their queries
def test_canned_queries_follow_the_schema(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0,), judge=False, evals=False)
    served = browse.check_database(path)
    queries = browse.canned_queries(served)
    assert "judge_grades_by_model" in queries and "depth_results" in queries  # both are always in the schema now
    assert "inference_results" in queries and "tokens_json" not in queries["inference_results"]["sql"]
    assert "coalesce(r.variant, r.arch) as model" in queries["final_losses"]["sql"]
    _add_depth_rows(path)
    queries = browse.canned_queries(browse.check_database(path))
    assert "coalesce(r.variant, r.arch) as model" in queries["final_losses"]["sql"]
    assert "depth_results" in queries
    conn = sqlite3.connect(path)
    for q in queries.values():  # every query is valid SQL on this schema
        sql = q["sql"].replace(":run_id", "'x'")
        conn.execute(sql).fetchall()
    conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_until_up(proc: subprocess.Popen, base: str, deadline_s: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"benchctl browse exited with {proc.returncode}: {err.decode()[-2000:]}")
        try:
            status, _ = _get(base + "/-/versions.json", timeout=2.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail("benchctl browse did not answer in time")


def _rows(base: str, path: str) -> list[dict]:
    status, body = _get(f"{base}{path}")
    assert status == 200, f"{path}: HTTP {status}: {body[:500]!r}"
    return json.loads(body)


@pytest.mark.slow
def test_serves_descriptions_and_every_canned_query(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0, 1), n_prompts=4, bench=True, infer=True)
    _add_depth_rows(path)
    _add_accuracy_rows(path)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchctl", "browse", "--db", str(path), "--port", str(port), "--no-open"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_until_up(proc, base)
        status, page = _get(f"{base}/results/runs")
        html = page.decode()
        assert status == 200
        assert browse.described_tables()["runs"].description.split(":")[0] in html  # the table's description
        assert browse.describe("runs", "final_val_loss") in html  # a column's description, with its unit
        status, page = _get(f"{base}/results")
        assert status == 200 and "Final validation loss by model" in page.decode()

        run_id = next(iter(sqlite3.connect(path).execute("select id from runs where status = 'done'")))[0]
        queries = browse.canned_queries(browse.check_database(path))
        assert len(queries) >= 6 and "depth_results" in queries
        for name in queries:
            params = f"&run_id={urllib.parse.quote(run_id)}" if ":run_id" in queries[name]["sql"] else ""
            rows = _rows(base, f"/results/{name}.json?_shape=array{params}")
            assert rows, f"canned query {name} returned no rows"
        curve = _rows(base, f"/results/validation_curve.json?_shape=array&run_id={urllib.parse.quote(run_id)}")
        assert list(curve[0]) == ["step", "tokens", "wall_seconds", "val_loss"]
        assert [r["step"] for r in curve] == sorted(r["step"] for r in curve)

        # Live: a row written by another process while the server runs is visible (the WAL is read).
        handle = stages.connect(path)
        with handle.conn:
            handle["metrics"].insert(
                {"run_id": run_id, "step": 10_000, "name": "val_loss", "value": 2.5, "tokens": 1, "wall_seconds": 1.0}
            )
        handle.conn.close()
        again = _rows(base, f"/results/validation_curve.json?_shape=array&run_id={urllib.parse.quote(run_id)}")
        assert len(again) == len(curve) + 1

        # Read-only: SQL that writes is refused and changes nothing.
        n_before = sqlite3.connect(path).execute("select count(*) from runs").fetchone()[0]
        status, _ = _get(f"{base}/results.json?sql=" + urllib.parse.quote("delete from runs"))
        assert status >= 400
        assert sqlite3.connect(path).execute("select count(*) from runs").fetchone()[0] == n_before
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One `benchctl browse` server over a fixture database for the tests below: (base URL, database, the file its
    stderr goes to)."""
    root = tmp_path_factory.mktemp("browser")
    path = build_fixture_db(root / "results.db", seeds=(0, 1), n_prompts=2, bench=True, infer=True, depth=True)
    _add_accuracy_rows(path)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = root / "stderr.txt"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchctl", "browse", "--db", str(path), "--port", str(port), "--no-open"],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        _wait_until_up(proc, base)
        yield base, path, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


OVERVIEW_COLUMNS = [
    "model",
    "run_id",
    "arch",
    "preset",
    "seed",
    "status",
    "step",
    "max_steps",
    "final_val_loss",
    "initial_val_loss",
    "mflop_per_token",
    "train_tflop",
    "train_seconds",
    "tokens_per_s",
    "config_json",
]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_runs_overview_reads_first_what_people_read_first(browser):
    base, path, _ = browser
    rows = _rows(base, "/results/runs_overview.json?_shape=array")
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    stored = {r["id"]: r for r in conn.execute("select * from runs")}
    assert [list(r) for r in rows] == [OVERVIEW_COLUMNS] * len(stored)  # every run, config last
    for row in rows:
        run = stored[row["run_id"]]
        if run["status"] == "done":
            assert row["final_val_loss"] == round(run["final_val_loss"], 4) != run["final_val_loss"]
            assert row["train_seconds"] == round(run["train_seconds"], 1) != run["train_seconds"]
        assert row["mflop_per_token"] == round(run["flops_per_token"] / 1e6, 3)
        # the same config, compacted to one unbreakable line
        assert json.loads(row["config_json"]) == json.loads(run["config_json"]) and " " not in row["config_json"]
        assert (row["seed"], row["status"]) == (run["seed"], run["status"])
    status, page = _get(f"{base}/results/runs_overview")
    assert status == 200 and "Runs at a glance" in page.decode()


def test_a_run_id_in_a_query_links_to_its_validation_curve(browser):
    base, path, _ = browser
    status, page = _get(f"{base}/results/runs_overview")
    links = re.findall(r'<td class="col-run_id"><a href="([^"]+)"', page.decode())
    run_ids = [r[0] for r in sqlite3.connect(path).execute("select id from runs order by id")]
    assert status == 200 and len(links) == len(run_ids)
    done = next(iter(sqlite3.connect(path).execute("select id from runs where status = 'done'")))[0]
    link = html.unescape(next(x for x in links if urllib.parse.quote(done) in x))
    assert link == f"/results/validation_curve?run_id={urllib.parse.quote(done)}"
    curve = _rows(base, link.replace("validation_curve?", "validation_curve.json?_shape=array&"))
    stored = list(
        sqlite3.connect(path).execute(
            "select step, value from metrics where run_id = ? and name = 'val_loss' order by step", [done]
        )
    )
    assert [(r["step"], r["val_loss"]) for r in curve] == [(step, round(v, 4)) for step, v in stored]
    assert len(curve) > 1
    status, page = _get(f"{base}/results/unfinished_runs")  # any query's run ids
    assert status == 200 and "/results/validation_curve?run_id=" in page.decode()


def _decimals(x: float) -> int:
    text = repr(x)
    return 0 if "e" in text or "." not in text else len(text.split(".")[1].rstrip("0"))


def test_every_canned_query_rounds_its_numbers(browser):
    base, path, _ = browser
    queries = browse.canned_queries(browse.check_database(path))
    run_id = next(iter(sqlite3.connect(path).execute("select id from runs where status = 'done'")))[0]
    floats = 0
    for name, query in queries.items():
        params = f"&run_id={urllib.parse.quote(run_id)}" if ":run_id" in query["sql"] else ""
        rows = _rows(base, f"/results/{name}.json?_shape=array{params}")
        assert rows, name
        for row in rows:
            for column, value in row.items():
                if isinstance(value, float):
                    floats += 1
                    assert _decimals(value) <= 4, f"{name}.{column} = {value!r}"
    assert floats > 100


def test_column_descriptions_are_one_click_away_on_a_table_page(browser):
    base, _, _ = browser
    status, page = _get(f"{base}/results/runs")
    text = page.decode()
    assert status == 200
    start, end = text.index("<details>"), text.index("</details>")
    assert text.count('class="column-descriptions"') == 1  # Datasette's open list is gone: only the collapsed one
    collapsed = html.unescape(text[start:end])
    spec = browse.described_tables()["runs"]
    assert f"What each of the {len(spec.columns)} columns holds" in collapsed
    assert all(browse.describe("runs", c.name) in collapsed for c in spec.columns)
    assert start < text.index('class="column-descriptions"') < end < text.index('<table class="rows-and-columns">')
    described = browse.describe("runs", "final_val_loss")
    assert f'data-column-description="{html.escape(described)}"' in text  # the header's menu still has it
    assert '<a href="/results/runs_overview">Runs at a glance</a>' in text


BAD_PARAMETERS = [
    ("?_timelimit=abc", "invalid literal for int()"),
    ("?id__notin=%5B", "not valid JSON"),
    ("?_through=%7B%7D", "missing key 'table'"),
    ('?_through={"table":"x"}', "missing key 'column'"),
    ("?_through=notjson", "not valid JSON"),
    ("?_sort=rowid&_next=-1", "Cannot sort table by rowid"),  # Datasette's own message, as for any unknown _sort
]


@pytest.mark.parametrize("table", ["runs", "metrics"])
@pytest.mark.parametrize("query,message", BAD_PARAMETERS)
def test_a_query_parameter_datasette_cannot_read_is_a_400(browser, table, query, message):
    base, _, log = browser
    if table == "metrics":
        query = query.replace("id__notin", "run_id__notin")
    address = f"{base}/results/{table}{urllib.parse.quote(query, safe='?&=%')}"
    status, page = _get(address)
    assert status == 400, page[-500:]
    assert message in html.unescape(page.decode()) and "Traceback" not in page.decode()
    status, body = _get(address.replace(f"/{table}?", f"/{table}.json?"))
    answer = json.loads(body)
    assert status == 400 and answer["status"] == 400 and message in answer["error"]
    assert "Traceback" not in log.read_text()  # the server printed none either


class _BuggyPlugin:
    """A plugin whose hook fails on every page it renders: a server error Datasette did not raise."""

    @hookimpl
    def extra_template_vars(self):
        raise ValueError("a bug in a plugin")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_server_error_stays_a_500_with_its_traceback(tmp_path, capfd):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0,), judge=False, evals=False, curves=False)
    ds = browse.app(browse.check_database(path))
    plugin = _BuggyPlugin()
    pm.register(plugin, name="benchctl-test-buggy")
    try:
        for page in ("/results/runs?_sort=arch", "/results/runs", "/results/final_losses?_timelimit=10"):
            response = asyncio.run(ds.client.get(page))
            assert response.status_code == 500, page
            assert "Traceback" in capfd.readouterr().err and "a bug in a plugin" in response.text
    finally:
        pm.unregister(plugin)
    response = asyncio.run(ds.client.get("/results/runs?_timelimit=abc"))  # the same server, a bad parameter
    assert response.status_code == 400 and "Traceback" not in capfd.readouterr().err


def _error(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


def test_refuses_what_is_not_a_results_database(tmp_path, capsys):
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("create table things (x integer)")
    conn.close()
    text = tmp_path / "notes.db"
    text.write_text("not a database at all " * 100)
    for target, words, exit_code in (
        (tmp_path / "missing.db", "does not exist", 5),
        (tmp_path, "directory", 5),
        (other, "not a benchctl results database", 2),
        (text, "not a readable SQLite database", 5),
    ):
        code, err = _error(capsys, ["browse", "--db", str(target), "--port", str(_free_port()), "--no-open"])
        assert code == exit_code, err
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_taken_port_is_one_line(tmp_path, capsys):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0,), judge=False, evals=False, curves=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = _error(capsys, ["browse", "--db", str(path), "--port", str(s.getsockname()[1]), "--no-open"])
    assert code == 1 and "--port" in err and len(err.strip().splitlines()) == 1
