"""The report's loader reads databases written by older benchctl versions without migrating them."""

from __future__ import annotations

import sqlite3

from benchctl import report, stages


def test_an_older_bench_table_without_newer_columns_is_read_not_refused(tmp_path):
    # a bench table as written before the decode benchmark added `mode` (which the report's filter names)
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("create table bench (bench_id text, arch text, impl text, preset text, tokens_per_s real)")
    conn.execute("insert into bench values ('b1', 'control', 'benchctl', 'small', 1234.5)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    data = report.read(path, stages.tables())
    bench = data.bench
    assert list(bench["tokens_per_s"]) == [1234.5] and bench["mode"].isna().all()
    assert path.read_bytes() == before  # read, never migrated
