"""The table `benchctl accuracy` writes (accuracy_results) and the functions that write and query it."""

from __future__ import annotations

from typing import Any

import sqlite_utils

from benchctl.core.db import now, retry_locked
from benchctl.core.tables import Column, Table
from benchctl.stages.train.tables import model_label

ACCURACY_RESULTS = Table(
    "accuracy_results",
    "Task accuracy",
    "Exact-match accuracy of greedy answers on held-out problems of a reasoning task, per (run, difficulty level, "
    "test-time depth), with the teacher-forced answer loss on the same problems, from `benchctl accuracy`.",
    (
        Column("run_id", str, "the measured run (runs.id)"),
        Column("task", str, "the task the run learned"),
        Column("level", str, "difficulty level: id (in-distribution, as trained) or a harder one"),
        Column("in_distribution", int, "1 for the level the run trained on, 0 for a harder (extrapolation) level"),
        Column("n_recur", int, "test-time depth the answers were decoded at"),
        Column("trained_n_recur", int, "the depth the run was trained at"),
        Column("problems", int, "held-out problems scored (the first N of the level's test split)", "problems"),
        Column("seed", int, "seed of the test split's problems (the same problems for every run)"),
        Column("correct", int, "problems answered exactly", "problems"),
        Column("accuracy", float, "exact match: correct / problems"),
        Column("position_accuracy", float, "mean share of answer characters right, position by position"),
        Column("answer_loss", float, "teacher-forced cross-entropy of the answer and end tokens", "nats/token"),
        Column("by_difficulty", str, 'JSON {"knob=value": [problems, correct]} within the level'),
        Column("decode_path", str, "fast (static KV cache) or reference, and why when not fast"),
        Column("seconds", float, "wall time of decoding and scoring the level", "s"),
        Column("created_at", str, "when it was measured (UTC)"),
    ),
    pk=("run_id", "level", "n_recur", "problems", "seed"),
    foreign_keys=(("run_id", "runs", "id"),),
    not_null=("accuracy",),
    facets=("task", "level"),
    report_sort=("run_id", "level", "n_recur"),
)

TABLES = (ACCURACY_RESULTS,)
_PK = ACCURACY_RESULTS.pk


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query: accuracy per model, level and depth, rounded, with the run's seed."""
    if "accuracy_results" not in columns:
        return {}
    sql = (
        f"select {model_label(columns)} as model, r.seed, a.task, a.level, a.n_recur, a.trained_n_recur, a.problems, "
        "round(a.accuracy, 4) as accuracy, round(a.position_accuracy, 4) as position_accuracy, "
        "round(a.answer_loss, 4) as answer_loss, a.run_id from accuracy_results a "
        "left join runs r on r.id = a.run_id order by a.task, model, r.seed, a.level, a.n_recur"
    )
    return {
        "task_accuracy": {
            "title": "Task accuracy",
            "description": "Exact match on held-out problems per level and test-time depth, per run.",
            "sql": sql,
        }
    }


def accuracy_keys(db: sqlite_utils.Database, run_id: str) -> set[tuple[Any, ...]]:
    """(level, n_recur, problems, seed) of every accuracy_results row stored for a run."""
    return {tuple(r[k] for k in _PK[1:]) for r in db.query("select * from accuracy_results where run_id = ?", [run_id])}


def record_accuracy(db: sqlite_utils.Database, row: dict[str, Any]) -> None:
    """One measured (run, level, depth) row, written as soon as it is measured; an existing key is kept."""

    def write() -> None:
        with db.atomic():
            db["accuracy_results"].insert({"created_at": now(), **row}, pk=_PK, ignore=True)

    retry_locked(write)
