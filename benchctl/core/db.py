"""results.db: the single source of truth, and the one module that writes it (its tables are described in schema.py).

SQLite through sqlite-utils, WAL mode, foreign keys on, a busy timeout on every connection. Every stage of
benchctl (train, sample, judge, eval, bench) writes here and `report` only reads from here, so every number the
tool prints can be traced back to a row and the settings that produced it. Users query it directly
(`sqlite3 results/results.db`, `sqlite-utils`, Datasette), so table and column names are meant to be read.

Tables (see README "Querying results.db"):
  runs            one row per (architecture, preset, seed, data): variant name, status, config, losses, telemetry
  metrics         long format (run_id, step, name) -> value, with tokens seen and wall time
  checkpoints     checkpoint files written per run and step
  prompts         the versioned story beginnings used for sampling
  samples         generated completions, with every sampling setting
  judge_requests  cache of every judge request/response, keyed by (judge model, prompt hash, sample, repeat)
  judge_grades    parsed grades (or failures) per (sample, judge model, prompt hash, repeat)
  eval_results    lm-eval metrics per (run, task, metric, n_recur, limit)
  bench           benchmark measurements
  depth_results   validation loss per (run, inference depth or adaptive-exit setting)
  plan_runs       which run each study plan's (variant, preset, seed) reached, with the plan file's hash
  meta            schema version
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import sqlite_utils

from benchctl.core.errors import BenchctlError, CheckpointError, ConfigError, DatabaseError
from benchctl.core.schema import TABLES

SCHEMA_VERSION = 1
Database = sqlite_utils.Database  # what `connect` returns; the stages name the type through this module
DEFAULT_DB = Path("results") / "results.db"

_SCHEMA: dict[str, dict[str, Any]] = TABLES  # the tables, described in benchctl/schema.py


def now() -> str:
    """UTC timestamp, ISO 8601, second resolution."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def default_path() -> Path:
    return Path(os.environ.get("BENCHCTL_DB") or DEFAULT_DB)


def connect(path: str | os.PathLike | None = None, *, create: bool = True, wal: bool = True) -> sqlite_utils.Database:
    """Open (and create or migrate) results.db with WAL, foreign keys and a busy timeout. `wal=False` keeps the
    file's rollback journal instead (a file that processes on different machines share: WAL needs shared memory);
    either way the journal mode is only changed when it differs, since changing it needs the file to itself."""
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
        migrate(db)
    except sqlite3.DatabaseError as e:
        raise DatabaseError(f"cannot open results database {p}: {e}") from None
    return db


def migrate(db: sqlite_utils.Database) -> None:
    """Create missing tables and add missing columns; refuse a database from a newer benchctl."""
    with db.atomic():
        if "meta" in db.table_names():
            row = db.execute("select value from meta where key = 'schema_version'").fetchone()
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise DatabaseError(
                    f"results database has schema version {row[0]}, newer than this benchctl ({SCHEMA_VERSION}); "
                    "upgrade benchctl or use another --db"
                )
        for name, spec in _SCHEMA.items():
            table = db[name]
            if not table.exists():
                table.create(
                    spec["columns"],
                    pk=spec["pk"],
                    foreign_keys=spec.get("foreign_keys"),
                    not_null=spec.get("not_null"),
                    defaults=spec.get("defaults"),
                    if_not_exists=True,
                )
            else:
                have = set(table.columns_dict)
                for col, tp in spec["columns"].items():
                    if col not in have:
                        table.add_column(col, tp)
                        if (name, col) in _BACKFILL:
                            db.execute(_BACKFILL[name, col])
        db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")
    _ensure_indexes(db)


def _ensure_indexes(db: sqlite_utils.Database) -> None:
    for table, cols in (
        ("runs", ["arch", "preset", "seed"]),
        ("samples", ["run_id"]),
        ("judge_grades", ["judge_model", "prompt_hash"]),
        ("eval_results", ["task"]),
    ):
        db[table].create_index(cols, if_not_exists=True)


def schema_columns(table: str) -> list[str]:
    return list(_SCHEMA[table]["columns"])


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
# Small helpers, one per table, used by the stages.


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


def get_run(db: sqlite_utils.Database, run_id: str) -> dict[str, Any] | None:
    rows = list(db.query("select * from runs where id = ?", [run_id]))
    return rows[0] if rows else None


def update_run(db: sqlite_utils.Database, run_id: str, **values: Any) -> None:
    values["updated_at"] = now()
    with db.atomic():
        db["runs"].update(run_id, values)


def finished_runs(
    db: sqlite_utils.Database,
    *,
    run_ids: Iterable[str] | None = None,
    archs: Iterable[str] | None = None,
    preset: str | None = None,
    bad_selection: type[BenchctlError] = ConfigError,
    none_left: type[BenchctlError] = CheckpointError,
    purpose: str = "to use",
) -> list[dict[str, Any]]:
    """The finished runs a stage works on (sample, judge, eval), in registry order of architecture, then seed.

    `run_ids` must all exist and be finished, `archs` must all be registered (`bad_selection` otherwise); an empty
    result is `none_left`. Each command picks the error classes, so their exit codes stay theirs.
    """
    import architectures

    run_ids, archs = list(dict.fromkeys(run_ids or [])), list(archs or [])
    for a in archs:
        try:
            architectures.get(a)
        except architectures.UnknownArchitectureError as e:
            raise bad_selection(f"--archs: {e}") from None
    if run_ids:
        found = {r["id"]: r for r in runs(db, ids=run_ids)}
        unknown = [r for r in run_ids if r not in found]
        if unknown:
            raise bad_selection(f"unknown run id(s): {', '.join(unknown)}; list them with 'benchctl runs'")
        unfinished = [f"{i} ({found[i]['status']})" for i in run_ids if found[i]["status"] != "done"]
        if unfinished:
            raise bad_selection(f"run(s) not finished: {', '.join(unfinished)}; finish them with "
                                "'benchctl train-all' first")
    rows = runs(db, status="done", preset=preset, ids=run_ids)
    if archs:
        rows = [r for r in rows if r["arch"] in archs]
    if not rows:
        scope = ([f"preset '{preset}'"] if preset else []) + ([f"architectures {', '.join(archs)}"] if archs else [])
        where = f" for {' and '.join(scope)}" if scope else ""
        raise none_left(f"no finished runs{where} {purpose} in results.db; run 'benchctl train-all' first")
    order = {n: i for i, n in enumerate(architectures.names())}
    return sorted(rows, key=lambda r: (order.get(r["arch"], len(order)), r["arch"], r["preset"], r["seed"], r["id"]))


def runs(db: sqlite_utils.Database, *, status: str | None = None, preset: str | None = None,
         ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
    where, params = [], []
    if status:
        where.append("status = ?")
        params.append(status)
    if preset:
        where.append("preset = ?")
        params.append(preset)
    ids = list(ids or [])
    if ids:
        where.append(f"id in ({','.join('?' * len(ids))})")
        params += ids
    sql = "select * from runs" + (" where " + " and ".join(where) if where else "") + " order by created_at, id"
    return list(db.query(sql, params))


# --------------------------------------------------------------------------------------------------------------------
# Writes: runs, metrics, checkpoints (train)


def start_run(db: sqlite_utils.Database, run: dict[str, Any], *, new: bool, resume_step: int) -> None:
    """A run starts (or restarts) training: its row marked running, and in the same transaction every metric row
    past the checkpoint it resumes from deleted (they belong to a future this run recomputes). A run starting from
    step 0 also forgets any earlier checkpoint rows."""
    rid, stamp = run["id"], now()
    values = {**run, "started_at": stamp, "updated_at": stamp}
    variant = values.pop("variant", None) or run.get("arch")
    with db.atomic():
        if new:
            db["runs"].insert({**values, "variant": variant, "created_at": stamp, "step": 0, "tokens_seen": 0},
                              alter=True)
        else:
            db["runs"].update(rid, values, alter=True)
            _keep_first_variant(db, rid, variant)
        _truncate_metrics_after(db, rid, resume_step)
        if resume_step == 0:
            db.execute("delete from metrics where run_id = ?", [rid])
            db.execute("delete from checkpoints where run_id = ?", [rid])


def _truncate_metrics_after(db: sqlite_utils.Database, run_id: str, step: int) -> None:
    db.execute("delete from metrics where run_id = ? and step > ?", [run_id, step])


def record_metrics(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """Metric rows keyed by (run, step, name): rewriting a step after a resume replaces, never duplicates."""
    if rows:
        with db.atomic():
            db["metrics"].upsert_all(rows, pk=("run_id", "step", "name"))


def record_initial_loss(db: sqlite_utils.Database, run_id: str, value: float, metrics: list[dict[str, Any]]) -> None:
    """The step-0 evaluation: its metric rows and the run's initial loss together."""
    with db.atomic():
        if metrics:
            db["metrics"].upsert_all(metrics, pk=("run_id", "step", "name"))
        db["runs"].update(run_id, {"initial_val_loss": value, "updated_at": now()})


def record_checkpoint(db: sqlite_utils.Database, run_id: str, *, step: int, path: str, size: int,
                      metrics: list[dict[str, Any]], run_values: dict[str, Any]) -> None:
    """A checkpoint was written: the metrics up to it, its row (one per path: the file is overwritten in place) and
    the run's progress and telemetry, in one transaction, so a kill never leaves a checkpoint without its rows."""
    stamp = now()
    with db.atomic():
        if metrics:
            db["metrics"].upsert_all(metrics, pk=("run_id", "step", "name"))
        db["checkpoints"].delete_where("run_id = ? and path = ?", [run_id, path])
        db["checkpoints"].insert({"run_id": run_id, "step": step, "path": path, "bytes": size, "created_at": stamp},
                                 replace=True)
        db["runs"].update(run_id, {"step": step, "updated_at": stamp, **run_values})


def finish_run(db: sqlite_utils.Database, run_id: str, *, final_val_loss: float,
               initial_val_loss: float | None) -> None:
    stamp = now()
    with db.atomic():
        db["runs"].update(run_id, {
            "status": "done", "final_val_loss": final_val_loss, "finished_at": stamp, "updated_at": stamp,
            "initial_val_loss": initial_val_loss, "pid": None,
        }, alter=True)


def fail_run(db: sqlite_utils.Database, run_id: str, error: str) -> None:
    """The run stopped with an error (or was interrupted): it is no longer owned by a live process."""
    update_run(db, run_id, status="failed", error=error[:2000], pid=None)



# --------------------------------------------------------------------------------------------------------------------
# Writes: prompts and samples (sample)


def insert_prompts(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> int:
    """Store a prompt set's rows, keeping any already stored (a set is written once and reused); returns how many
    were new, in one transaction."""
    if not rows:
        return 0
    return retry_locked(_insert_counted, db, "prompts", rows)


def insert_samples(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> int:
    """Store one generated batch in one transaction, keeping rows already there (a batch cut short earlier keeps
    what it wrote); returns how many rows were new."""
    if not rows:
        return 0
    return retry_locked(_insert_counted, db, "samples", rows)


def _insert_counted(db: sqlite_utils.Database, table: str, rows: list[dict[str, Any]]) -> int:
    with db.atomic():
        before = db.execute("select total_changes()").fetchone()[0]
        db[table].insert_all(rows, pk="id", ignore=True)
        return db.execute("select total_changes()").fetchone()[0] - before


def sample_ids(db: sqlite_utils.Database, run_id: str, settings_hash: str, prompt_set: str) -> set[str]:
    """Ids of the samples already stored for a run, settings and prompt set (what a rerun skips)."""
    return {r["id"] for r in db.query(
        "select id from samples where run_id = ? and settings_hash = ? and prompt_set = ?",
        [run_id, settings_hash, prompt_set])}


def sample_stats(db: sqlite_utils.Database, run_id: str, prompt_set: str, settings_hash: str
                 ) -> tuple[int, float | None, float | None]:
    """(samples stored, mean new tokens, share that ended the story) for a run, prompt set and settings."""
    r = next(iter(db.query(
        "select count(*) as n, avg(n_tokens) as mean_tokens, avg(finish_reason = 'eos') as eos_share from samples "
        "where run_id = ? and prompt_set = ? and settings_hash = ?", [run_id, prompt_set, settings_hash])))
    return r["n"], r["mean_tokens"], r["eos_share"]


def first_sample(db: sqlite_utils.Database, run_id: str, settings_hash: str, prompt_set: str
                 ) -> dict[str, Any] | None:
    """The stored sample of the set's first prompt, with the prompt's text (completion, finish_reason, n_tokens,
    text), or None."""
    return next(iter(db.query(
        "select s.completion, s.finish_reason, s.n_tokens, p.text from samples s join prompts p on p.id = s.prompt_id "
        "where s.run_id = ? and s.settings_hash = ? and s.prompt_set = ? order by p.idx limit 1",
        [run_id, settings_hash, prompt_set])), None)


# --------------------------------------------------------------------------------------------------------------------
# Writes: judge requests and grades (judge)

_JUDGE_GRADE_PK = ("sample_id", "judge_model", "prompt_hash", "repeat")
# judge_requests columns that add up over every run that called the service for a key, so retrying a failed key
# never hides tokens (or calls) that were already paid for.
_JUDGE_ACCUMULATED = ("attempts", "prompt_tokens", "output_tokens", "thinking_tokens", "total_tokens")


def judge_samples(db: sqlite_utils.Database, run_ids: Iterable[str] | None = None,
                  limit: int | None = None) -> list[dict[str, Any]]:
    """Samples to judge, each with its run's architecture and preset and the prompt text (`beginning`).

    Ordered by prompt index first, so `limit` takes the same first prompts from every run rather than all of one run.
    """
    ids = list(run_ids or [])
    where = f"where s.run_id in ({','.join('?' * len(ids))})" if ids else ""
    params: list[Any] = list(ids)
    sql = (
        "select s.id as sample_id, s.run_id, r.arch, coalesce(r.variant, r.arch) as variant, r.preset, "
        "p.idx as prompt_idx, p.text as beginning, s.completion "
        "from samples s join runs r on r.id = s.run_id join prompts p on p.id = s.prompt_id "
        f"{where} order by p.idx, r.arch, s.run_id, s.id"
    )
    if limit is not None:
        sql += " limit ?"
        params.append(limit)
    return list(db.query(sql, params))


def judge_status(db: sqlite_utils.Database, judge_model: str, prompt_hash: str) -> dict[tuple[str, int], str]:
    """(sample id, repeat) -> status ('ok' or 'failed') of every stored grade of this judge model and prompt."""
    rows = db.query(
        "select sample_id, repeat, status from judge_grades where judge_model = ? and prompt_hash = ?",
        [judge_model, prompt_hash],
    )
    return {(r["sample_id"], r["repeat"]): r["status"] for r in rows}


def judge_grades(db: sqlite_utils.Database, judge_model: str, prompt_hash: str,
                 sample_ids: Iterable[str]) -> list[dict[str, Any]]:
    """Every judge_grades row of this judge model and prompt for the given samples."""
    return _judge_rows(db, "judge_grades", judge_model, prompt_hash, sample_ids)


def judge_requests(db: sqlite_utils.Database, judge_model: str, prompt_hash: str,
                   sample_ids: Iterable[str]) -> list[dict[str, Any]]:
    """Every judge_requests row of this judge model and prompt for the given samples."""
    return _judge_rows(db, "judge_requests", judge_model, prompt_hash, sample_ids)


def _judge_rows(db: sqlite_utils.Database, table: str, judge_model: str, prompt_hash: str,
                sample_ids: Iterable[str]) -> list[dict[str, Any]]:
    ids = list(sample_ids)
    rows: list[dict[str, Any]] = []
    for start in range(0, len(ids), 500):  # SQLite limits the number of ? parameters in one statement
        chunk = ids[start : start + 500]
        rows += db.query(
            f"select * from {table} where judge_model = ? and prompt_hash = ? "
            f"and sample_id in ({','.join('?' * len(chunk))})",
            [judge_model, prompt_hash, *chunk],
        )
    return rows


def record_judge_answer(db: sqlite_utils.Database, request: dict[str, Any], grade: dict[str, Any]) -> None:
    """Store one key's request row and grade row together, in one transaction, as soon as the answer arrives.

    `request` carries this run's attempts and tokens; the stored row adds those of earlier runs for the same key
    and keeps the first call's `created_at`. A killed run keeps every key it finished, never a request without
    its grade.
    """

    def write() -> None:
        stamp = now()
        with db.atomic():
            prev = next(iter(db.query("select * from judge_requests where key = ?", [request["key"]])), None) or {}
            row = {**request, "created_at": prev.get("created_at") or stamp, "updated_at": stamp}
            for col in _JUDGE_ACCUMULATED:
                row[col] = (prev.get(col) or 0) + (request[col] or 0)
            db["judge_requests"].upsert(row, pk="key")
            db["judge_grades"].upsert({**grade, "created_at": stamp}, pk=_JUDGE_GRADE_PK)

    retry_locked(write)


# --------------------------------------------------------------------------------------------------------------------
# Writes: lm-eval results (eval)


def replace_eval_results(db: sqlite_utils.Database, rows: list[dict[str, Any]], keys: set[tuple[str, str]],
                         n_recur: int, limit_n: int) -> None:
    """Replace every row of the (run, task) pairs in `keys` at (n_recur, limit_n) by `rows`, in one transaction: a
    task that now reports fewer metrics leaves none of its old ones behind."""

    def write() -> None:
        with db.atomic():
            for run_id, task in keys:
                db.conn.execute(
                    "delete from eval_results where run_id = ? and task = ? and n_recur = ? and limit_n = ?",
                    [run_id, task, n_recur, limit_n])
            if rows:
                db["eval_results"].insert_all(rows, pk=("run_id", "task", "metric", "n_recur", "limit_n"),
                                              replace=True)

    retry_locked(write)


def eval_task_versions(db: sqlite_utils.Database, run_id: str, n_recur: int, limit_n: int
                       ) -> dict[str, set[str | None]]:
    """task -> task versions already stored for (run, n_recur, limit)."""
    out: dict[str, set[str | None]] = {}
    for r in db.query("select task, task_version from eval_results where run_id = ? and n_recur = ? and limit_n = ?",
                      [run_id, n_recur, limit_n]):
        out.setdefault(r["task"], set()).add(r["task_version"])
    return out


def eval_results(db: sqlite_utils.Database, run_id: str, n_recur: int, limit_n: int) -> list[dict[str, Any]]:
    """Every stored eval_results row of (run, n_recur, limit), by task then metric."""
    query = "select * from eval_results where run_id = ? and n_recur = ? and limit_n = ? order by task, metric"
    return retry_locked(lambda: list(db.query(query, [run_id, n_recur, limit_n])))


# --------------------------------------------------------------------------------------------------------------------
# Writes: benchmark rows (bench)


def record_bench_rows(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """One `benchctl bench` invocation's rows, all or none."""
    with db.atomic():
        db["bench"].insert_all(rows, alter=False)


# ---- test-time depth (depth_results)

_DEPTH_PK = ("run_id", "n_recur", "exit_rule", "threshold", "extrapolate", "windows")


def depth_keys(db: sqlite_utils.Database, run_id: str) -> set[tuple[Any, ...]]:
    """(n_recur, exit_rule, threshold, extrapolate, windows) of every depth_results row stored for a run."""
    return {tuple(r[k] for k in _DEPTH_PK[1:]) for r in db.query("select * from depth_results where run_id = ?",
                                                                 [run_id])}


def record_depth_result(db: sqlite_utils.Database, row: dict[str, Any]) -> None:
    """One measured (run, setting) row, written as soon as it is measured; an existing key is kept."""

    def write() -> None:
        with db.atomic():
            db["depth_results"].insert({"created_at": now(), **row}, pk=_DEPTH_PK, ignore=True)

    retry_locked(write)


def depth_results(db: sqlite_utils.Database) -> list[dict[str, Any]]:
    """Every depth_results row with its run's architecture, preset, seed and trained depth (`trained_n_recur`)."""
    if "depth_results" not in db.table_names():
        return []
    return list(db.query(
        "select d.*, r.arch, r.preset, r.seed, json_extract(r.config_json, '$.model.n_recur') as trained_n_recur "
        "from depth_results d join runs r on r.id = d.run_id order by r.arch, r.seed, d.exit_rule, d.threshold desc, "
        "d.n_recur"))


def sample_mean_depth(db: sqlite_utils.Database, run_id: str, prompt_set: str, settings_hash: str) -> float | None:
    """Mean of the stored samples' mean exit depths for a run, prompt set and settings (None without an exit)."""
    r = next(iter(db.query("select avg(mean_depth) as d from samples where run_id = ? and prompt_set = ? and "
                           "settings_hash = ?", [run_id, prompt_set, settings_hash])))
    return r["d"]


# --------------------------------------------------------------------------------------------------------------------
# ---- retrofit: runs whose weights were converted from a finished run


def retrofit_parent(db: sqlite_utils.Database, ref: str, preset: str | None = None) -> dict[str, Any]:
    """The finished run a retrofit starts from: `ref` is a run id, or an architecture/variant name matched against
    the finished runs (of `preset` when given), which must then be unique."""
    row = get_run(db, ref)
    if row is None:
        # a variant name (when runs record one) or an architecture name
        by_variant = "variant" in db["runs"].columns_dict
        named = "(variant = ? or arch = ?)" if by_variant else "arch = ?"
        sql = f"select * from runs where status = 'done' and {named}" + (" and preset = ?" if preset else "")
        params = [ref] * (2 if by_variant else 1) + ([preset] if preset else [])
        rows = list(db.query(sql + " order by created_at, id", params))
        if not rows:
            raise ConfigError(f"--from {ref!r}: no run with that id and no finished run of that name"
                              + (f" at preset '{preset}'" if preset else "") + "; list them with 'benchctl runs'")
        if len(rows) > 1:
            raise ConfigError(f"--from {ref!r} matches {len(rows)} finished runs ({', '.join(r['id'] for r in rows)}); "
                              "pass one run id")
        row = rows[0]
    if row["status"] != "done":
        raise ConfigError(f"--from {row['id']}: the run is {row['status']}, not done; finish it first")
    return row


def retrofit_runs(db: sqlite_utils.Database) -> list[dict[str, Any]]:
    """Every run that started from converted weights, oldest first."""
    return list(db.query("select * from runs where parent_run_id is not null order by created_at, id"))


def last_metric(db: sqlite_utils.Database, run_id: str, name: str) -> float | None:
    """The value of a run's metric at its latest step (None when it never recorded it)."""
    row = db.execute("select value from metrics where run_id = ? and name = ? order by step desc limit 1",
                     [run_id, name]).fetchone()
    return None if row is None else float(row[0])


# --------------------------------------------------------------------------------------------------------------------
# ---- plans: run variants and the runs each plan trained

# A column added to an existing table that has a value to derive for the rows already there: runs stored before
# plans existed are named after their architecture, as runs trained without a plan still are.
_BACKFILL = {("runs", "variant"): "update runs set variant = arch where variant is null"}


def _keep_first_variant(db: sqlite_utils.Database, run_id: str, variant: str | None) -> None:
    """A run keeps the variant name it was first trained under; one without a name (an older row) takes this one."""
    if variant:
        db.execute("update runs set variant = ? where id = ? and variant is null", [variant, run_id])


def record_plan_runs(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """Which run each (plan, variant, preset, seed) trained, in one transaction. A run reached under a second
    variant name keeps its first in `runs.variant`; this table is how a plan still finds it under its own name."""
    if not rows:
        return
    stamp = now()

    def write() -> None:
        with db.atomic():
            for row in rows:
                prev = next(iter(db.query(
                    "select created_at from plan_runs where plan = ? and variant = ? and preset = ? and seed = ?",
                    [row["plan"], row["variant"], row["preset"], row["seed"]])), None)
                created = prev["created_at"] if prev else stamp
                db["plan_runs"].upsert({**row, "created_at": created, "updated_at": stamp},
                                       pk=("plan", "variant", "preset", "seed"))
                _keep_first_variant(db, row["run_id"], row["variant"])

    retry_locked(write)


def plan_runs(db: sqlite_utils.Database, plan: str | None = None) -> list[dict[str, Any]]:
    """Every plan_runs row (of one plan), by plan, preset, seed and variant."""
    where, params = ("where plan = ?", [plan]) if plan else ("", [])
    return list(db.query(f"select * from plan_runs {where} order by plan, preset, seed, variant", params))


# --------------------------------------------------------------------------------------------------------------------
# ---- precision and GPU telemetry (train)


def record_gpu_telemetry_note(db: sqlite_utils.Database, run_id: str, note: str | None) -> None:
    """Why some GPU readings of the run are absent (None: all present, or not a GPU run)."""
    with db.atomic():
        db["runs"].update(run_id, {"gpu_telemetry_note": note, "updated_at": now()})


# --------------------------------------------------------------------------------------------------------------------
# ---- executors: processes writing at once, and a run trained into its own file


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


# Every table training (benchctl.stages.train.engine.train_run) writes, parents first; a new one must be listed here so runs
# trained on other machines bring it along (a test trains a run and checks).
RUN_TABLES = ("runs", "metrics", "checkpoints")


def copy_run_rows(src: sqlite_utils.Database, dst: sqlite_utils.Database, run_id: str) -> int:
    """Make `dst` hold exactly `src`'s training rows of `run_id` (RUN_TABLES), in one transaction: how the driver
    of a Ray study takes in a run a worker trained into its own file, and hands a run's history to the worker that
    resumes it. The run row is updated in place (rows of other stages that point at it stay), keeping the first
    variant name `dst` knew it by. Returns the rows copied (0 when `src` does not have the run)."""
    run = get_run(src, run_id)
    if run is None:
        return 0
    copied = 1
    with dst.atomic():
        known = get_run(dst, run_id)
        if known is not None and known.get("variant"):
            run["variant"] = known["variant"]
        dst["runs"].upsert(run, pk="id", alter=True)
        for table in RUN_TABLES[1:]:
            rows = list(src[table].rows_where("run_id = ?", [run_id]))
            dst[table].delete_where("run_id = ?", [run_id])
            if rows:
                dst[table].insert_all(rows, alter=True)
            copied += len(rows)
    return copied


# ---- cost telemetry: what `study --bench` checks before benchmarking again


def bench_configs(db: sqlite_utils.Database, preset: str, device: str) -> list[dict[str, Any]]:
    """(arch, impl, device_name, config_json) of every bench row of a preset on a device type, newest first."""
    return list(db.query("select arch, impl, device_name, config_json from bench where preset = ? and device = ? "
                         "order by created_at desc, id desc", [preset, device]))
