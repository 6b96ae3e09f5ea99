"""The tables sampling owns (prompts, samples) and every function that writes them.

The judge and the depth stage read samples through the queries here; only this module writes these tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlite_utils

from benchctl.core.db import retry_locked
from benchctl.core.tables import Column, Table

PROMPTS = Table(
    "prompts",
    "Story beginnings",
    "The versioned validation-story beginnings every model completes for the judge.",
    (
        Column("id", str, "'<prompt_set>:<idx>'"),
        Column("prompt_set", str, "version of the set: hash of source fingerprint, selection rule and count"),
        Column("idx", int, "position in the set"),
        Column("text", str, "the story beginning"),
        Column("source_story", int, "index of the validation story it was taken from"),
        Column("rule", str, "selection rule and its version, e.g. opening-sentences-v1"),
        Column("data_fingerprint", str, "the prepared data the validation stories came from"),
        Column("created_at", str, "when it was created (UTC)"),
    ),
    pk="id",
    not_null=("prompt_set", "idx", "text"),
    report_skip=("text",),
)

SAMPLES = Table(
    "samples",
    "Completions",
    "Generated completions of the story beginnings, with every sampling setting.",
    (
        Column("id", str, "hash of (run, prompt, settings)"),
        Column("run_id", str, "the model that wrote it (runs.id)"),
        Column("prompt_id", str, "the story beginning (prompts.id)"),
        Column("prompt_set", str, "version of the prompt set"),
        Column("completion", str, "the generated continuation"),
        Column("settings_json", str, "every sampling setting, as JSON"),
        Column("settings_hash", str, "hash of the settings"),
        Column("temperature", float, "sampling temperature"),
        Column("top_k", int, "top-k cut-off (0 = none)"),
        Column("top_p", float, "nucleus cut-off (1 = none)"),
        Column("max_new_tokens", int, "generation limit of this sample (default: what the context leaves)", "tokens"),
        Column("seed", int, "sampling seed"),
        Column("n_recur", int, "test-time recurrence that ran (the run's trained one unless overridden)"),
        Column("batch_size", int, "generation batch size (fixes three-part's random initial states)"),
        Column("device", str, "device type it ran on (samples reproduce on the same type)"),
        Column(
            "dtype",
            str,
            "precision the forward ran in: the weights' dtype (before sampler v2: the run's rule on that device, "
            "bfloat16 autocast or float32)",
        ),
        Column("n_tokens", int, "new tokens, end-of-story token excluded", "tokens"),
        Column("finish_reason", str, "eos or length"),
        Column("created_at", str, "when it was generated (UTC)"),
        Column(
            "extrapolate", str, "rule for passes past the trained depth (empty: none applied, or the arch has none)"
        ),
        Column("exit_rule", str, "adaptive exit rule, kl or latent (empty: fixed depth)"),
        Column("exit_threshold", float, "adaptive exit threshold"),
        Column("mean_depth", float, "mean exit iteration over the positions processed (adaptive exit)"),
        Column(
            "dtype_reason",
            str,
            "why that precision: set by --precision, or measured fastest by bench --decode on the device (which "
            "measurement), or float32 for want of one",
        ),
        Column(
            "decode", str, "the generation path that ran: fast compiled, fast eager, or reference, and why if not fast"
        ),
    ),
    pk="id",
    foreign_keys=(("run_id", "runs", "id"), ("prompt_id", "prompts", "id")),
    not_null=("run_id", "prompt_id", "completion"),
    indexes=(("run_id",),),
    facets=("finish_reason",),
    report_skip=("completion", "settings_json"),
)

TABLES = (PROMPTS, SAMPLES)


# --------------------------------------------------------------------------------------------------------------------
# Writes


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


# --------------------------------------------------------------------------------------------------------------------
# Queries


def sample_ids(db: sqlite_utils.Database, run_id: str, settings_hash: str, prompt_set: str) -> set[str]:
    """Ids of the samples already stored for a run, settings and prompt set (what a rerun skips)."""
    return {
        r["id"]
        for r in db.query(
            "select id from samples where run_id = ? and settings_hash = ? and prompt_set = ?",
            [run_id, settings_hash, prompt_set],
        )
    }


def sample_stats(
    db: sqlite_utils.Database, run_id: str, prompt_set: str, settings_hash: str
) -> tuple[int, float | None, float | None]:
    """(samples stored, mean new tokens, share that ended the story) for a run, prompt set and settings."""
    r = next(
        iter(
            db.query(
                "select count(*) as n, avg(n_tokens) as mean_tokens, avg(finish_reason = 'eos') as eos_share "
                "from samples "
                "where run_id = ? and prompt_set = ? and settings_hash = ?",
                [run_id, prompt_set, settings_hash],
            )
        )
    )
    return r["n"], r["mean_tokens"], r["eos_share"]


def sample_mean_depth(db: sqlite_utils.Database, run_id: str, prompt_set: str, settings_hash: str) -> float | None:
    """Mean of the stored samples' mean exit depths for a run, prompt set and settings (None without an exit)."""
    r = next(
        iter(
            db.query(
                "select avg(mean_depth) as d from samples where run_id = ? and prompt_set = ? and settings_hash = ?",
                [run_id, prompt_set, settings_hash],
            )
        )
    )
    return r["d"]


def first_sample(db: sqlite_utils.Database, run_id: str, settings_hash: str, prompt_set: str) -> dict[str, Any] | None:
    """The stored sample of the set's first prompt, with the prompt's text (completion, finish_reason, n_tokens,
    text), or None."""
    return next(
        iter(
            db.query(
                "select s.completion, s.finish_reason, s.n_tokens, p.text "
                "from samples s join prompts p on p.id = s.prompt_id "
                "where s.run_id = ? and s.settings_hash = ? and s.prompt_set = ? order by p.idx limit 1",
                [run_id, settings_hash, prompt_set],
            )
        ),
        None,
    )


def judge_samples(
    db: sqlite_utils.Database, run_ids: Iterable[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
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
