"""The table `benchctl depth` writes (depth_results) and the functions that write and query it."""

from __future__ import annotations

from typing import Any

import sqlite_utils

from benchctl.core.db import now, retry_locked
from benchctl.core.tables import Column, Table
from benchctl.stages.train.tables import model_label

DEPTH_RESULTS = Table(
    "depth_results",
    "Test-time depth",
    "Validation loss per (run, inference depth or adaptive-exit setting, extrapolation rule, windows), from `benchctl "
    "depth`.",
    (
        Column("run_id", str, "the measured run (runs.id)"),
        Column("n_recur", int, "inference depth (maximum depth with an exit rule)"),
        Column("exit_rule", str, "kl or latent (empty for a fixed depth: part of the key, so never NULL)"),
        Column("threshold", float, "exit threshold (0 for a fixed depth)"),
        Column("extrapolate", str, "rule for iterations past the trained depth (empty: the arch has none)"),
        Column("windows", int, "validation windows measured (the first N of the fixed set)"),
        Column("val_loss", float, "mean next-token cross-entropy"),
        Column("mean_depth", float, "mean exit iteration over tokens (= n_recur at a fixed depth)"),
        Column("tokens", int, "tokens measured", "tokens"),
        Column("seconds", float, "wall time of the measurement", "s"),
        Column(
            "flops_per_token",
            float,
            "forward FLOPs per token at n_recur (at the mean depth for exit rows)",
            "FLOPs/token",
        ),
        Column("depth_hist", str, "JSON {depth: tokens} of per-token exit depths"),
        Column("created_at", str, "when it was measured (UTC)"),
    ),
    pk=("run_id", "n_recur", "exit_rule", "threshold", "extrapolate", "windows"),
    foreign_keys=(("run_id", "runs", "id"),),
    not_null=("val_loss",),
    report_sort=("run_id", "exit_rule", "threshold", "extrapolate", "windows", "n_recur"),
)

TABLES = (DEPTH_RESULTS,)


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query: every depth_results row, labelled with its run's model and seed when the file's
    table is keyed by run, its measurements rounded."""
    if "depth_results" not in columns:
        return {}
    cols = DEPTH_RESULTS.browse_select("d", columns["depth_results"])
    if "run_id" in columns["depth_results"]:
        sql = (
            f"select {model_label(columns)} as model, r.preset, r.seed, {cols} from depth_results d "
            "left join runs r on r.id = d.run_id order by model, r.preset, r.seed"
        )
    else:
        sql = f"select {cols} from depth_results d"
    return {
        "depth_results": {
            "title": "Depth results",
            "description": "Results at each test-time depth, per run.",
            "sql": sql,
        }
    }


_DEPTH_PK = DEPTH_RESULTS.pk


def depth_keys(db: sqlite_utils.Database, run_id: str) -> set[tuple[Any, ...]]:
    """(n_recur, exit_rule, threshold, extrapolate, windows) of every depth_results row stored for a run."""
    return {
        tuple(r[k] for k in _DEPTH_PK[1:]) for r in db.query("select * from depth_results where run_id = ?", [run_id])
    }


def record_depth_result(db: sqlite_utils.Database, row: dict[str, Any]) -> None:
    """One measured (run, setting) row, written as soon as it is measured; an existing key is kept."""

    def write() -> None:
        with db.atomic():
            db["depth_results"].insert({"created_at": now(), **row}, pk=_DEPTH_PK, ignore=True)

    retry_locked(write)
