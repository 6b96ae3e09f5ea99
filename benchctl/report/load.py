"""Reading results.db for the report: the only place besides the stages' tables modules that runs SQL, and it only
reads.

Every registered table becomes one DataFrame with every described column present (an older database gets NULLs for
columns it lacks, a missing table an empty frame), sorted by its `Table.sort_keys` so the same database always gives
the same frames in the same order. Each `Table` says what the report leaves out: large text columns
(`report_skip`) and rows (`report_where`: only validation losses of the training curves).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from benchctl.core.db import SCHEMA_VERSION, check_file
from benchctl.core.errors import DatabaseError
from benchctl.core.tables import Table


@dataclass(frozen=True)
class Data:
    """Every registered table as a DataFrame, sorted by its report sort keys (empty when the file lacks the table).

    A frame is reached by its table's name, as an attribute (`data.runs`, `data.judge_grades`) or an item
    (`data["eval_results"]`); `replace` gives a copy with some frames swapped."""

    frames: Mapping[str, pd.DataFrame]

    def __getitem__(self, table: str) -> pd.DataFrame:
        return self.frames[table]

    def __getattr__(self, table: str) -> pd.DataFrame:
        frames = self.__dict__.get("frames")  # absent while copy/pickle build an instance without __init__
        if frames is None or table not in frames:
            raise AttributeError(f"no table {table!r} in the report's data")
        return frames[table]

    def replace(self, **frames: pd.DataFrame) -> Data:
        unknown = sorted(set(frames) - set(self.frames))
        if unknown:
            raise KeyError(f"no table {', '.join(unknown)} in the report's data")
        return Data({**self.frames, **frames})


def open_db(path: str | os.PathLike) -> sqlite3.Connection:
    """Open results.db read-only; a missing or unreadable file is a DatabaseError that says what to do."""
    p = Path(path)
    if not p.is_file():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' (or 'benchctl study') first, "
            "or pass --db PATH (or set BENCHCTL_DB)"
        )
    check_file(p)  # benchctl's own file (or one from before the marker), of a schema this benchctl reads
    try:
        conn = sqlite3.connect(p.resolve().as_uri() + "?mode=ro", uri=True, timeout=30.0)
        conn.execute("select count(*) from sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database {p}: {e}") from None
    return conn


def read(db: str | os.PathLike | sqlite3.Connection | Any, tables: Sequence[Table]) -> Data:
    """`tables` from results.db: a path (opened read-only, closed after) or an open connection (a sqlite3
    connection, or a sqlite_utils.Database, which wraps one)."""
    conn = getattr(db, "conn", db)
    if isinstance(conn, sqlite3.Connection):
        return load(conn, tables)
    conn = open_db(db)
    try:
        return load(conn, tables)
    finally:
        conn.close()


def load(conn: sqlite3.Connection, tables: Sequence[Table]) -> Data:
    """Read `tables` (the report stage passes every registered stage's) into DataFrames with every described column
    present (older databases get NULLs). The tables are given, not looked up: the stages build their report sections
    from this package, so it cannot import their registry."""
    try:
        have = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
        if "meta" in have:
            row = conn.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise DatabaseError(
                    f"results database has schema version {row[0]}, newer than this benchctl ({SCHEMA_VERSION}); "
                    "upgrade benchctl"
                )
        return Data({t.name: _read_table(conn, t, have) for t in tables})
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database: {e}") from None


def _read_table(conn: sqlite3.Connection, table: Table, have: set[str]) -> pd.DataFrame:
    wanted = [c for c in table.column_names if c not in table.report_skip]
    if table.name not in have:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in wanted})
    present = {r[1] for r in conn.execute(f"pragma table_info('{table.name}')")}
    # An older database lacks the newer columns: they read as NULL, also where `report_where` names one (a read-only
    # report never migrates the file, so the condition must hold on the columns as they would be after migration).
    described = ", ".join(c if c in present else f"NULL AS {c}" for c in table.column_names)
    where = f" where {table.report_where}" if table.report_where else ""
    sql = f"select {', '.join(wanted)} from (select {described} from {table.name}){where}"
    df = pd.DataFrame.from_records(conn.execute(sql).fetchall(), columns=wanted)
    return df.sort_values(list(table.sort_keys), kind="mergesort", na_position="first").reset_index(drop=True)
