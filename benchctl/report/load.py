"""Reading results.db for the report: the only place besides benchctl.core.db that runs SQL, and it only reads.

Every table the report needs becomes one DataFrame with every schema column present (an older database gets NULLs
for columns it lacks, a missing table an empty frame), sorted by primary key so the same database always gives the
same frames in the same order.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from benchctl.core.db import SCHEMA_VERSION, schema_columns
from benchctl.core.errors import DatabaseError

# Columns the report reads; large text columns (completions, raw judge answers, configs of bench rows) are skipped.
# (bench's config_json is read: the cost section matches bench rows to models by config.)
_SKIP_COLUMNS = {"samples": {"completion", "settings_json"}, "judge_grades": {"raw_text"}, "prompts": {"text"}}
_TABLES = ("runs", "metrics", "prompts", "samples", "judge_grades", "eval_results", "bench", "depth_results",
           "plan_runs")
_PKS = {
    "runs": ["preset", "arch", "seed", "id"],
    "metrics": ["run_id", "name", "step"],
    "prompts": ["id"],
    "samples": ["id"],
    "judge_grades": ["sample_id", "judge_model", "prompt_hash", "repeat"],
    "eval_results": ["run_id", "task", "metric", "n_recur", "limit_n"],
    "bench": ["id"],
    "depth_results": ["run_id", "exit_rule", "threshold", "extrapolate", "windows", "n_recur"],
    "plan_runs": ["plan", "preset", "seed", "variant"],
}


@dataclass(frozen=True)
class Data:
    """The tables the report reads, one DataFrame each, sorted by primary key (empty when a table is absent)."""

    runs: pd.DataFrame
    metrics: pd.DataFrame  # val_loss rows only
    prompts: pd.DataFrame
    samples: pd.DataFrame
    grades: pd.DataFrame
    evals: pd.DataFrame
    bench: pd.DataFrame
    depth: pd.DataFrame = field(default_factory=pd.DataFrame)  # depth_results
    plan_runs: pd.DataFrame = field(default_factory=lambda: _empty("plan_runs"))  # which run each plan variant is


def open_db(path: str | os.PathLike) -> sqlite3.Connection:
    """Open results.db read-only; a missing or unreadable file is a DatabaseError that says what to do."""
    p = Path(path)
    if not p.is_file():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' (or 'benchctl study') first, "
            "or pass --db PATH (or set BENCHCTL_DB)"
        )
    try:
        conn = sqlite3.connect(p.resolve().as_uri() + "?mode=ro", uri=True, timeout=30.0)
        conn.execute("select count(*) from sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database {p}: {e}") from None
    return conn


def read(db: str | os.PathLike | sqlite3.Connection | Any) -> Data:
    """The report's tables from results.db: a path (opened read-only, closed after) or an open connection (a
    sqlite3 connection, or a sqlite_utils.Database, which wraps one)."""
    conn = getattr(db, "conn", db)
    if isinstance(conn, sqlite3.Connection):
        return load(conn)
    conn = open_db(db)
    try:
        return load(conn)
    finally:
        conn.close()


def load(conn: sqlite3.Connection) -> Data:
    """Read the report's tables into DataFrames with every schema column present (older databases get NULLs)."""
    try:
        have = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
        if "meta" in have:
            row = conn.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise DatabaseError(
                    f"results database has schema version {row[0]}, newer than this benchctl ({SCHEMA_VERSION}); "
                    "upgrade benchctl"
                )
        frames = {t: _read_table(conn, t, have) for t in _TABLES}
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot read results database: {e}") from None
    return Data(
        runs=frames["runs"], metrics=frames["metrics"], prompts=frames["prompts"], samples=frames["samples"],
        grades=frames["judge_grades"], evals=frames["eval_results"], bench=frames["bench"],
        depth=frames["depth_results"],
        plan_runs=frames["plan_runs"],
    )


def _empty(table: str) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in schema_columns(table)})


def _read_table(conn: sqlite3.Connection, table: str, have: set[str]) -> pd.DataFrame:
    wanted = [c for c in schema_columns(table) if c not in _SKIP_COLUMNS.get(table, set())]
    if table not in have:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in wanted})
    present = {r[1] for r in conn.execute(f"pragma table_info('{table}')")}
    cols = [c for c in wanted if c in present]
    where = " where name = 'val_loss'" if table == "metrics" else ""
    sql = f"select {', '.join(cols)} from {table}{where}"
    df = pd.DataFrame.from_records(conn.execute(sql).fetchall(), columns=cols)
    for c in wanted:
        if c not in df.columns:
            df[c] = None
    df = df[wanted]
    keys = [k for k in _PKS[table] if k in df.columns]
    return df.sort_values(keys, kind="mergesort", na_position="first").reset_index(drop=True)
