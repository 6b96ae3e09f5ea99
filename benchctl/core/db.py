"""results.db: opening it (WAL, foreign keys, a busy timeout), creating and migrating its tables, transactions.

SQLite through sqlite-utils. Every stage of benchctl (train, sample, judge, eval, bench, depth) writes here and
`report` only reads from here, so every number the tool prints can be traced back to a row and the settings that
produced it. Users query it directly (`sqlite3 results/results.db`, `sqlite-utils`, Datasette), so table and column
names are meant to be read.

This module knows no table but its own `meta` (the schema version): each stage describes the tables it owns in
`benchctl/stages/<name>/tables.py` (a `benchctl.core.tables.Table` each) and writes them there, and `connect` creates
or migrates whatever tables it is given. `benchctl.stages.connect` opens the file with every registered stage's
tables; that is how everything but this module opens it.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from benchctl.core.errors import DatabaseError
from benchctl.core.tables import Column, Table

SCHEMA_VERSION = 1
Database = sqlite_utils.Database  # what `connect` returns; the stages name the type through this module
DEFAULT_DB = Path("results") / "results.db"

META = Table(
    "meta",
    "Schema",
    "Key-value facts about this database (its schema version).",
    (Column("key", str, "fact name, e.g. schema_version"), Column("value", str, "its value")),
    pk="key",
)


def now() -> str:
    """UTC timestamp, ISO 8601, second resolution."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def default_path() -> Path:
    return Path(os.environ.get("BENCHCTL_DB") or DEFAULT_DB)


def connect(
    path: str | os.PathLike | None = None, *, tables: Sequence[Table], create: bool = True, wal: bool = True
) -> sqlite_utils.Database:
    """Open results.db with WAL, foreign keys and a busy timeout, creating or migrating `tables` (and `meta`).

    `tables` are the stages' tables, parents before the tables whose foreign keys point at them. `wal=False` keeps
    the file's rollback journal instead (a file that processes on different machines share: WAL needs shared
    memory); either way the journal mode is only changed when it differs, since changing it needs the file to
    itself."""
    p = Path(path) if path is not None else default_path()
    if not create and not p.exists():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' first, or pass --db PATH (or set BENCHCTL_DB)"
        )
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(p), timeout=30.0)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA foreign_keys = ON")
        db = _ImmediateDatabase(conn)
        if wal and db.journal_mode != "wal":
            db.enable_wal()
        elif not wal and db.journal_mode == "wal":
            db.disable_wal()
        migrate(db, tables)
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot open results database {p}: {e}") from None
    return db


def migrate(db: sqlite_utils.Database, tables: Sequence[Table]) -> None:
    """Create missing tables, add missing columns (filling in those with a backfill) and indexes, for `tables` and
    `meta`; refuse a database from a newer benchctl."""
    tables = (*tables, META)
    with db.atomic():
        if "meta" in db.table_names():
            row = db.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise DatabaseError(
                    f"results database has schema version {row[0]}, newer than this benchctl ({SCHEMA_VERSION}); "
                    "upgrade benchctl or use another --db"
                )
        for spec in tables:
            table = db.table(spec.name)  # a Table (db[name] may also be a View, which cannot be migrated)
            if not table.exists():
                table.create(
                    {c.name: c.type for c in spec.columns},
                    pk=spec.pk,
                    foreign_keys=list(spec.foreign_keys) or None,
                    not_null=set(spec.not_null) or None,
                    defaults=dict(spec.defaults) or None,
                    if_not_exists=True,
                )
            else:
                have = set(table.columns_dict)
                for col in spec.columns:
                    if col.name not in have:
                        table.add_column(col.name, col.type)
                        if col.name in spec.backfill:
                            db.execute(spec.backfill[col.name])
        db.table("meta").upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")
    for spec in tables:
        for cols in spec.indexes:
            db.table(spec.name).create_index(list(cols), if_not_exists=True)


def file_columns(path: str | os.PathLike) -> dict[str, list[str]]:
    """table -> columns of the SQLite file at `path`, opened read-only (nothing is created or migrated): what a
    reader such as `benchctl browse` checks before serving a file."""
    p = Path(path)
    try:
        conn = sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")]
            return {t: [r[1] for r in conn.execute(f"pragma table_info([{t}])")] for t in tables}
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"{p} is not a readable SQLite database ({e})") from None


# --------------------------------------------------------------------------------------------------------------------
# Writing: transactions and the write lock


def retry_locked(fn, *args, attempts: int = 5, **kwargs):
    """Run a write, retrying briefly when another process holds the write lock beyond the busy timeout."""
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or i == attempts - 1:
                raise
            time.sleep(0.5 * (i + 1))
    return None  # pragma: no cover


class _ImmediateDatabase(sqlite_utils.Database):
    """Transactions that take the write lock when they begin (BEGIN IMMEDIATE), waiting for it up to the busy
    timeout. sqlite-utils begins them deferred: a transaction that reads first (sqlite-utils looks up a table's
    columns before it writes) and only then writes fails at once with "database is locked" if another process wrote
    in between, whatever the timeout, which parallel training processes sharing results.db hit."""

    @contextlib.contextmanager
    def atomic(self):
        if self.conn.in_transaction:  # nested: a savepoint, as sqlite-utils does
            with super().atomic():
                yield self
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self
        except BaseException:
            self.rollback()
            raise
        try:
            self.conn.execute("COMMIT")
        except BaseException:
            self.rollback()
            raise
