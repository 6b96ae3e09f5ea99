"""A copy of a results database to commit, publish or send: finished runs only, training curves thinned to the
evaluation steps, local paths taken out.

A working results.db keeps every run in every state, a metrics row per logged step and the absolute paths of the
machine it ran on (data directory, run directories, the plan file): tens of megabytes for a grid of small runs, and
a home directory in every row. What someone else needs to read the results (`benchctl report`, `benchctl browse`)
is the finished runs and what hangs off them. The copy is taken with SQLite's backup API (consistent while a study
is still writing the source), edited as a temporary file next to the destination and renamed into place, so a
killed `share` leaves no half-written database behind; the source is only ever opened read-only.

Rows that belong to dropped runs go with them, found through the schema's declared foreign keys (samples of a run,
grades of those samples, ...), so a table added later is covered without being named here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchctl.core import db as dbm
from benchctl.core.errors import ConfigError, DatabaseError, output_error
from benchctl.core.files import partial_path, stale_partials

# an absolute path inside a text value: a slash and a name, then at least one more "/name", starting the value or
# after a space, quote, '=', '(', ':' or ','. A URL's "//host/x" does not match (the first slash has no name after
# it, the second follows a slash).
_ABS_PATH = re.compile(r"""(?:^|(?<=[\s'"=(:,]))(/[\w.+-]+(?:/[\w.+-]+)+)""")


@dataclass(frozen=True)
class Redaction:
    """Every occurrence of `old` in a text value becomes `new`."""

    old: str
    new: str


@dataclass
class Shared:
    """What `share` did: runs kept and dropped, rows dropped per table, values changed per redaction, and the local
    directories still named in the copy (`leftover`: directory -> values naming it)."""

    path: Path
    runs_kept: int
    runs_dropped: dict[str, int]  # status -> runs
    rows_dropped: dict[str, int]  # table -> rows (the runs table excluded; metrics thinned counted under metrics)
    redacted: list[tuple[Redaction, int]]
    leftover: dict[str, int] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0


def parse_redaction(text: str) -> Redaction:
    """'OLD=NEW' or 'OLD' (becomes empty); a ConfigError for an empty OLD."""
    old, _, new = text.partition("=")
    if not old:
        raise ConfigError(f"--redact needs the text to replace before '=', got {text!r}")
    return Redaction(old, new)


def default_redactions(source: Path, home: Path | None = None) -> list[Redaction]:
    """The source database's own directory (paths below it become relative to it: the runs directory), the directory
    benchctl is installed in (a built-in plan's file becomes 'benchctl/plans/NAME.toml') and the home directory (as
    '~'). The filesystem root is never one: that would strip the leading slash of every path."""
    import benchctl

    dirs = [
        (source.resolve().parent, ""),
        (Path(benchctl.__file__).resolve().parent.parent, ""),
        (home if home is not None else Path.home(), "~/"),
    ]
    out: list[Redaction] = []
    for d, new in dirs:
        old = str(d).rstrip("/") + "/"
        if old != "/" and d.is_absolute() and all(r.old != old for r in out):
            out.append(Redaction(old, new))
    return out


def share(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    redactions: Sequence[Redaction] = (),
    all_metrics: bool = False,
    force: bool = False,
    home: Path | None = None,
) -> Shared:
    """Write the shareable copy of `source` to `dest` (see the module docstring). `redactions` are applied before the
    defaults, longest first, so a more specific one wins; `all_metrics` keeps every metrics row."""
    src, dst = Path(source).expanduser(), Path(dest).expanduser()
    if not src.is_file():
        what = "is a directory, not" if src.is_dir() else "does not exist; expected"
        raise DatabaseError(f"{src} {what} a results database; pass --db PATH")
    if dbm.check_file(src).kind == "new":
        raise DatabaseError(f"{src} is an empty SQLite file, not a results database")
    if dst.resolve() == src.resolve():
        raise ConfigError(f"the copy must be a new file, not the source database itself ({src})")
    if dst.is_dir():
        raise ConfigError(f"{dst} is a directory; pass the path of the .db file to write")
    if dst.exists():
        if not force:
            raise ConfigError(f"{dst} exists; pass --force to replace it")
        dbm.check_target(dst)  # never replace a file that is not a benchctl database
    if not dst.parent.is_dir():
        raise ConfigError(f"{dst.parent} does not exist; create it first")
    rules = sorted([*redactions, *default_redactions(src, home)], key=lambda r: len(r.old), reverse=True)

    for stale in stale_partials(dst):  # left by a share that was killed
        _remove_partial(stale)
    tmp = partial_path(dst)
    try:
        with _copy(src, tmp) as conn:
            result = _edit(conn, all_metrics=all_metrics, rules=rules)
        os.replace(tmp, dst)
    except OSError as e:
        raise output_error(dst, e) from None
    except sqlite3.OperationalError as e:
        raise _write_error(dst, e) from None
    finally:
        _remove_partial(tmp)
    result.path = dst
    result.bytes_before = src.stat().st_size + _wal_size(src)
    result.bytes_after = dst.stat().st_size
    return result


def _write_error(dst: Path, e: sqlite3.OperationalError) -> Exception:
    """SQLite's words for a destination it could not write (a full disk, a read-only or forbidden directory) as the
    one-line OutputError; any other OperationalError is a fault in the source database. SQLite does not say why it
    could not open or write a file, so the directory is asked the same question in the OS's words."""
    text = str(e)
    if "disk is full" in text:
        return output_error(dst, OSError(errno.ENOSPC, "No space left on device"))
    if "readonly" in text or "unable to open database file" in text or "disk I/O error" in text:
        probe = partial_path(dst).with_name(partial_path(dst).name + "-probe")
        try:
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
            probe.unlink()
        except OSError as why:
            return output_error(dst, why)
    return DatabaseError(f"cannot copy the results database to {dst}: {text}")


def _remove_partial(tmp: Path) -> None:
    """The staged copy and SQLite's journal beside it; a read-only directory refuses even the removal of a missing
    file, which is no failure here."""
    for p in (tmp, tmp.with_name(tmp.name + "-journal"), tmp.with_name(tmp.name + "-wal")):
        with contextlib.suppress(OSError):
            p.unlink(missing_ok=True)


def _wal_size(p: Path) -> int:
    wal = p.with_name(p.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


@contextlib.contextmanager
def _copy(src: Path, tmp: Path) -> Iterator[sqlite3.Connection]:
    reader = sqlite3.connect(src.resolve().as_uri() + "?mode=ro", uri=True, timeout=30.0)
    conn = sqlite3.connect(str(tmp))
    try:
        reader.backup(conn)
        # one self-contained file: the copy is meant to be committed or sent, never to get a -wal beside it
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.execute("PRAGMA foreign_keys = OFF")  # rows are dropped below in dependency order by hand
        yield conn
        conn.commit()
        conn.execute("VACUUM")
    finally:
        reader.close()
        conn.close()


def _tables(conn: sqlite3.Connection) -> list[str]:
    return [
        r[0] for r in conn.execute("select name from sqlite_master where type = 'table' and name not like 'sqlite_%'")
    ]


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _edit(conn: sqlite3.Connection, *, all_metrics: bool, rules: Sequence[Redaction]) -> Shared:
    tables = _tables(conn)
    if "runs" not in tables:
        raise DatabaseError("the database has no runs table: nothing to share")
    dropped_runs = dict(conn.execute("select status, count(*) from runs where status != 'done' group by status"))
    conn.execute("delete from runs where status != 'done'")
    kept = conn.execute("select count(*) from runs").fetchone()[0]
    rows_dropped = _drop_orphans(conn, tables)
    if not all_metrics and "metrics" in tables:
        n = _thin_metrics(conn)
        if n:
            rows_dropped["metrics"] = rows_dropped.get("metrics", 0) + n
    redacted = [(rule, _redact(conn, tables, rule)) for rule in rules]
    leftover = _local_paths(conn, tables)
    if "meta" in tables:
        conn.execute(
            "insert or replace into meta (key, value) values ('shared_copy', ?)",
            (
                json.dumps(
                    {
                        "created_at": dbm.now(),
                        "metrics": "every row" if all_metrics else "evaluation steps and each run's last step",
                        "runs_dropped": dropped_runs,
                    }
                ),
            ),
        )
    return Shared(Path(), kept, dropped_runs, rows_dropped, redacted, leftover)


def _drop_orphans(conn: sqlite3.Connection, tables: Sequence[str]) -> dict[str, int]:
    """Delete every row whose declared foreign key names a row that is gone, until none is left (a sample's grades
    go after the sample, which went after its run)."""
    keys = [
        (t, fk[3], fk[2], fk[4])  # child table, child column, parent table, parent column
        for t in tables
        for fk in conn.execute(f"pragma foreign_key_list({_q(t)})")
    ]
    dropped: dict[str, int] = {}
    changed = True
    while changed:
        changed = False
        for child, col, parent, pcol in keys:
            if parent not in tables:
                continue
            pcol = pcol or "rowid"
            cur = conn.execute(
                f"delete from {_q(child)} where {_q(col)} is not null and {_q(col)} not in "
                f"(select {_q(pcol)} from {_q(parent)} where {_q(pcol)} is not null)"
            )
            if cur.rowcount > 0:
                dropped[child] = dropped.get(child, 0) + cur.rowcount
                changed = True
    return dropped


def _thin_metrics(conn: sqlite3.Connection) -> int:
    """Keep every validation metric (val_*), and the training metrics at the steps that have a val_loss row and at
    each run's last step: the curves the report draws at evaluation resolution, and every final value."""
    conn.execute("create temp table keep_steps (run_id text, step integer, primary key (run_id, step))")
    conn.execute(
        "insert or ignore into keep_steps select run_id, step from metrics where name = 'val_loss' "
        "union select run_id, max(step) from metrics group by run_id"
    )
    cur = conn.execute(
        "delete from metrics where name not like 'val\\_%' escape '\\' and not exists "
        "(select 1 from keep_steps k where k.run_id = metrics.run_id and k.step = metrics.step)"
    )
    conn.execute("drop table keep_steps")
    return max(cur.rowcount, 0)


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"pragma table_info({_q(table)})")]


def _redact(conn: sqlite3.Connection, tables: Sequence[str], rule: Redaction) -> int:
    n = 0
    for t in tables:
        for c in _columns(conn, t):
            cur = conn.execute(
                f"update {_q(t)} set {_q(c)} = replace({_q(c)}, ?, ?) "
                f"where typeof({_q(c)}) = 'text' and instr({_q(c)}, ?) > 0",
                (rule.old, rule.new, rule.old),
            )
            n += max(cur.rowcount, 0)
    return n


def _local_paths(conn: sqlite3.Connection, tables: Sequence[str]) -> dict[str, int]:
    """Absolute paths still in the copy, by their first two directories ('/srv/data'), with how many values name
    each: what the user may want to --redact."""
    found: dict[str, int] = {}
    for t in tables:
        for c in _columns(conn, t):
            for (value,) in conn.execute(
                f"select {_q(c)} from {_q(t)} where typeof({_q(c)}) = 'text' and instr({_q(c)}, '/') > 0"
            ):
                seen = {"/".join(m.split("/")[:3]) for m in _ABS_PATH.findall(value)}
                for prefix in seen:
                    found[prefix] = found.get(prefix, 0) + 1
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))
