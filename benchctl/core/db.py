"""results.db: opening it (WAL, foreign keys, a busy timeout), creating and migrating its tables, transactions.

SQLite through sqlite-utils. Every stage of benchctl (train, sample, judge, eval, bench, depth) writes here and
`report` only reads from here, so every number the tool prints can be traced back to a row and the settings that
produced it. Users query it directly (`sqlite3 results/results.db`, `sqlite-utils`, Datasette), so table and column
names are meant to be read.

This module knows no table but its own `meta` (the schema version): each stage describes the tables it owns in
`benchctl/stages/<name>/tables.py` (a `benchctl.core.tables.Table` each) and writes them there, and `connect` creates
or migrates whatever tables it is given. `benchctl.stages.connect` opens the file with every registered stage's
tables; that is how everything but this module opens it.

A file is benchctl's only if it says so: benchctl writes `PRAGMA application_id = APPLICATION_ID` into every file it
creates, and the schema version into `meta`. Before anything is written, `identify` reads what a file is: new (no
file, an empty file, or an SQLite file holding no schema object), benchctl's (the marker), a results database of a
benchctl from before the marker (schema version 1 in `meta` and a `runs` table with benchctl's identifying columns,
which a writing command adopts through the versioned migration 1 -> 2), or anything else, which every command
refuses without changing a byte. Read-only commands (`readonly=True`) never migrate: they read a file of an older
version as it is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from benchctl.core.errors import DatabaseError, ForeignDatabaseError
from benchctl.core.tables import Column, Table

if TYPE_CHECKING:
    # sqlite_utils imports pandas and numpy whenever they are installed: loaded only when a connection is made, so
    # a command that merely reads rows (`benchctl runs`, through `read_only`) never pays for them
    import sqlite_utils

SCHEMA_VERSION = 2
# ASCII "bctl": SQLite's application_id header field (offset 68), written into every file benchctl creates, so that
# `file results.db` and any tool can tell benchctl's files apart and benchctl never mistakes another program's
# SQLite file for its own. Fixed forever: changing it would disown every database already written.
APPLICATION_ID = 0x6263746C
# Columns a `runs` table has had since the first benchctl: with schema version 1 in `meta`, how a database written
# before the marker existed is recognised.
LEGACY_RUNS_COLUMNS = frozenset({"id", "arch", "preset", "seed", "status", "config_json"})
if TYPE_CHECKING:
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


@dataclass(frozen=True)
class Identity:
    """What an SQLite file is to benchctl: `kind` is "new" (nothing in it yet), "ours" (the marker), "legacy" (a
    results database from before the marker) or "foreign" (anything else; `reason` says why)."""

    kind: str
    version: int | None = None  # the schema version stored in `meta` (ours, legacy)
    reason: str = ""


def identify(conn: sqlite3.Connection) -> Identity:
    """Read (never write) what the open file is."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    names = {r[0]: r[1] for r in conn.execute("select name, type from sqlite_master")}
    version = None
    if names.get("meta") == "table":
        cols = {r[1] for r in conn.execute("pragma table_info([meta])")}
        if {"key", "value"} <= cols:
            row = conn.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and str(row[0]).isdigit():
                version = int(row[0])
    if app_id == APPLICATION_ID:
        if version is None:
            return Identity("foreign", reason="it carries benchctl's marker but no schema version in its meta table")
        return Identity("ours", version)
    if app_id != 0:
        return Identity("foreign", reason=f"it belongs to another application (application_id {app_id:#010x})")
    if not names:
        return Identity("new")
    runs_cols = {r[1] for r in conn.execute("pragma table_info([runs])")} if names.get("runs") == "table" else set()
    if version == 1 and LEGACY_RUNS_COLUMNS <= runs_cols:
        return Identity("legacy", 1)
    return Identity("foreign", reason="it has no benchctl marker and is not a results database benchctl wrote")


def _refuse(p: Path, ident: Identity) -> None:
    if ident.kind == "foreign":
        raise ForeignDatabaseError(
            f"{p} is not a benchctl results database ({ident.reason}); nothing was changed. Pass a results.db "
            "benchctl wrote, or a new path"
        )
    if ident.version is not None and ident.version > SCHEMA_VERSION:
        raise DatabaseError(
            f"results database has schema version {ident.version}, newer than this benchctl ({SCHEMA_VERSION}); "
            "upgrade benchctl or use another --db"
        )


def _open(p: Path, *, readonly: bool) -> sqlite3.Connection:
    if readonly:
        # mode=ro: nothing this connection does can write the file (a read-only file or directory is fine too)
        conn = sqlite3.connect(p.resolve().as_uri() + "?mode=ro", uri=True, timeout=30.0)
    else:
        conn = sqlite3.connect(str(p), timeout=30.0)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def check_file(path: str | os.PathLike) -> Identity:
    """Identify the existing file at `path` through a read-only connection and refuse (one line) one benchctl must
    not touch: foreign, or of a newer schema. What the readers (`report`, `browse`) check before reading."""
    p = Path(path)
    try:
        conn = _open(p, readonly=True)
        try:
            ident = identify(conn)
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"{p} is not a readable SQLite database ({e})") from None
    _refuse(p, ident)
    return ident


def check_target(path: str | os.PathLike) -> None:
    """Refuse, before any slow work, a --db that a writing command would refuse later: an existing file that is not
    benchctl's (or of a newer schema). A missing file is fine: it will be created."""
    p = Path(path)
    if p.is_dir():
        raise DatabaseError(f"{p} is a directory, not a results database; pass the path of a .db file")
    if p.exists():
        check_file(p)


def read_only(path: str | os.PathLike | None = None) -> sqlite3.Connection:
    """Open an existing results database read-only (`path`, else $BENCHCTL_DB, else results/results.db), refusing
    one benchctl must not read (foreign, newer) or that holds nothing yet. Nothing is created or migrated: a reader of
    an older file reads it as it is. A plain sqlite3 connection, for readers that only run queries: it needs neither
    the stages' tables nor sqlite_utils, so `benchctl runs` imports neither (nor pandas, which sqlite_utils loads)."""
    p = Path(path) if path is not None else default_path()
    if not p.exists():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' first, or pass --db PATH (or set BENCHCTL_DB)"
        )
    if p.is_dir():
        raise DatabaseError(f"{p} is a directory, not a results database; pass the path of a .db file")
    try:
        conn = _open(p, readonly=True)
        ident = identify(conn)
        if ident.kind == "foreign" or (ident.version or 0) > SCHEMA_VERSION:
            conn.close()
            _refuse(p, ident)
        if ident.kind == "new":  # nothing to read, and a reader creates nothing
            conn.close()
            raise DatabaseError(
                f"{p} is empty, not a results database yet; run 'benchctl train-all' first, or pass --db PATH"
            )
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot open results database {p}: {e}") from None
    return conn


def connect(
    path: str | os.PathLike | None = None,
    *,
    tables: Sequence[Table],
    create: bool = True,
    wal: bool = True,
    readonly: bool = False,
) -> sqlite_utils.Database:
    """Open results.db with WAL, foreign keys and a busy timeout, creating or migrating `tables` (and `meta`).

    `tables` are the stages' tables, parents before the tables whose foreign keys point at them. `wal=False` keeps
    the file's rollback journal instead (a file that processes on different machines share: WAL needs shared
    memory); either way the journal mode is only changed when it differs, since changing it needs the file to
    itself. A file that is not benchctl's is refused (ForeignDatabaseError) before anything is written.
    `readonly=True` opens an existing file read-only and changes nothing (`read_only`): `tables` go unused."""
    if readonly:
        return _database_class()(read_only(path))
    p = Path(path) if path is not None else default_path()
    if not create and not p.exists():
        raise DatabaseError(
            f"no results database at {p}; run 'benchctl train-all' first, or pass --db PATH (or set BENCHCTL_DB)"
        )
    if p.is_dir():
        raise DatabaseError(f"{p} is a directory, not a results database; pass the path of a .db file")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        conn = _open(p, readonly=False)
        ident = identify(conn)  # before any write: a foreign file must keep every byte
        if ident.kind == "foreign" or (ident.version or 0) > SCHEMA_VERSION:
            conn.close()
            _refuse(p, ident)
        conn.execute("PRAGMA foreign_keys = ON")
        db = _database_class()(conn)
        if wal and db.journal_mode != "wal":
            db.enable_wal()
        elif not wal and db.journal_mode == "wal":
            db.disable_wal()
        migrate(db, tables)
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot open results database {p}: {e}") from None
    return db


def _adopt_marker(db: sqlite_utils.Database) -> None:
    """1 -> 2: a results database from before the marker gets it (its tables are benchctl's already)."""
    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")


# The explicit, versioned steps: MIGRATIONS[v] turns a version-v file into a version v+1 file. Added tables and
# columns need no step (`migrate` creates what a file lacks); a step is for what that cannot express.
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {1: _adopt_marker}


def migrate(db: sqlite_utils.Database, tables: Sequence[Table]) -> None:
    """Bring a benchctl file (or a new one) to SCHEMA_VERSION: the versioned steps from its version, then create
    missing tables, add missing columns (filling in those with a backfill) and indexes, for `tables` and `meta`.
    Refuses a foreign file or one from a newer benchctl."""
    tables = (*tables, META)
    with db.atomic():
        ident = identify(db.conn)  # again, under the write lock: another process may have created it meanwhile
        if ident.kind == "foreign" or (ident.version or 0) > SCHEMA_VERSION:
            _refuse(Path(db.conn.execute("PRAGMA database_list").fetchone()[2] or "database"), ident)
        if ident.kind == "new":
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        else:
            for version in range(ident.version or SCHEMA_VERSION, SCHEMA_VERSION):
                MIGRATIONS[version](db)
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


@functools.cache
def _database_class() -> type[sqlite_utils.Database]:
    """The Database class `connect` returns, made on first use: defining it needs sqlite_utils (and so pandas)."""
    import sqlite_utils

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

    return _ImmediateDatabase
