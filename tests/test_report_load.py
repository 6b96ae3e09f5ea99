"""The report's loader reads databases written by older benchctl versions without migrating them."""

from __future__ import annotations

import sqlite3

from benchctl import report, stages


def test_an_older_bench_table_without_newer_columns_is_read_not_refused(tmp_path):
    # a results database whose bench table is as written before the decode benchmark added `mode` (which the
    # report's filter names)
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("alter table bench drop column mode")
        conn.execute(
            "insert into bench (bench_id, arch, impl, preset, tokens_per_s) values ('b1', 'control', 'benchctl', "
            "'small', 1234.5)"
        )
    conn.close()
    before = path.read_bytes()
    data = report.read(path, stages.tables())
    bench = data.bench
    assert list(bench["tokens_per_s"]) == [1234.5] and bench["mode"].isna().all()
    assert path.read_bytes() == before  # read, never migrated


def test_provenance_names_the_data_source_as_given_not_where_it_resolved():
    from benchctl.stages.report.summary import _given_source

    cfg = '{"data": {"source": "data/tinystories"}}'
    assert _given_source(cfg, "/home/me/datasets/tinystories") == "data/tinystories"
    assert _given_source('{"data": {"source": "hub"}}', "hub") == "hub"
    assert _given_source("not json", "/x") == "/x"  # a config that cannot be read: the stored location
