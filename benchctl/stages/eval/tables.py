"""The table lm-eval results go to (eval_results) and every function that writes it."""

from __future__ import annotations

from typing import Any

import sqlite_utils

from benchctl.core.db import retry_locked
from benchctl.core.tables import Column, Table
from benchctl.stages.train.tables import model_label

EVAL_RESULTS = Table(
    "eval_results",
    "lm-eval results",
    "One row per (run, task, metric, test-time recurrence, document limit).",
    (
        Column("run_id", str, "the evaluated run (runs.id)"),
        Column("task", str, "lm-eval task, e.g. tinystories_ppl"),
        Column("metric", str, "acc, acc_norm, bits_per_byte, word_perplexity, ..."),
        Column("n_recur", int, "test-time recurrence used (the run's trained one unless overridden)"),
        Column("limit_n", int, "lm-eval --limit (0 = every document)", "documents"),
        Column("value", float, "the metric's value"),
        Column("stderr", float, "its standard error (empty when lm-eval gives none)"),
        Column("n_samples", int, "documents evaluated", "documents"),
        Column("task_version", str, "'<task version>+<hash of the documents>'"),
        Column("batch_size", int, "requests per forward pass (padding can move scores)"),
        Column("lm_eval_version", str, "lm-eval version"),
        Column("created_at", str, "when it was computed (UTC)"),
        Column(
            "dtype",
            str,
            "precision the forward ran in: the weights' dtype (before dtype_reason was recorded: the run's training "
            "rule on that device, as autocast; empty: not recorded)",
        ),
        Column(
            "dtype_reason",
            str,
            "why that precision: set by --precision, or measured fastest by bench --decode on the device (which "
            "measurement), or float32 for want of one",
        ),
    ),
    pk=("run_id", "task", "metric", "n_recur", "limit_n"),
    foreign_keys=(("run_id", "runs", "id"),),
    indexes=(("task",),),
    # results stored before the weights were cast once ran under the run's training rule, as autocast
    backfill={
        "dtype_reason": "update eval_results set dtype_reason = 'autocast: the run''s training precision rule "
        "(stored before eval cast the weights once)' where dtype is not null"
    },
    facets=("task", "metric"),
)

TABLES = (EVAL_RESULTS,)


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query over the lm-eval results, for a file that has them."""
    if "eval_results" not in columns:
        return {}
    return {
        "eval_results_by_model": {
            "title": "lm-eval results by model",
            "description": "Mean over seeds of every lm-eval metric per model, task, test-time recurrence and "
            "document limit (0 = all), with the mean standard error.",
            "sql": f"""select {model_label(columns)} as model, r.preset, e.task, e.metric, e.n_recur, e.limit_n,
  count(*) as n_runs, round(avg(e.value), 4) as mean_value, round(avg(e.stderr), 4) as mean_stderr,
  max(e.n_samples) as n_samples
from eval_results e join runs r on r.id = e.run_id
group by model, r.preset, e.task, e.metric, e.n_recur, e.limit_n
order by e.task, e.metric, r.preset, model, e.n_recur""",
        }
    }


def replace_eval_results(
    db: sqlite_utils.Database, rows: list[dict[str, Any]], keys: set[tuple[str, str]], n_recur: int, limit_n: int
) -> None:
    """Replace every row of the (run, task) pairs in `keys` at (n_recur, limit_n) by `rows`, in one transaction: a
    task that now reports fewer metrics leaves none of its old ones behind."""

    def write() -> None:
        with db.atomic():
            for run_id, task in keys:
                db.conn.execute(
                    "delete from eval_results where run_id = ? and task = ? and n_recur = ? and limit_n = ?",
                    [run_id, task, n_recur, limit_n],
                )
            if rows:
                db["eval_results"].insert_all(rows, pk=("run_id", "task", "metric", "n_recur", "limit_n"), replace=True)

    retry_locked(write)


def eval_task_versions(
    db: sqlite_utils.Database, run_id: str, n_recur: int, limit_n: int
) -> dict[str, set[str | None]]:
    """task -> task versions already stored for (run, n_recur, limit)."""
    out: dict[str, set[str | None]] = {}
    for r in db.query(
        "select task, task_version from eval_results where run_id = ? and n_recur = ? and limit_n = ?",
        [run_id, n_recur, limit_n],
    ):
        out.setdefault(r["task"], set()).add(r["task_version"])
    return out


def eval_results(db: sqlite_utils.Database, run_id: str, n_recur: int, limit_n: int) -> list[dict[str, Any]]:
    """Every stored eval_results row of (run, n_recur, limit), by task then metric."""
    query = "select * from eval_results where run_id = ? and n_recur = ? and limit_n = ? order by task, metric"
    return retry_locked(lambda: list(db.query(query, [run_id, n_recur, limit_n])))
