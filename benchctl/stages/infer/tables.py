"""The tables `benchctl infer` writes (inference_results, inference_latents) and the functions that write and query
them."""

from __future__ import annotations

import json
from typing import Any

import sqlite_utils

from benchctl.core.db import now, retry_locked
from benchctl.core.tables import Column, Table
from benchctl.stages.train.tables import model_label

INFERENCE_RESULTS = Table(
    "inference_results",
    "Inference cost",
    "What generation costs per (run, inference setting) on the same prompts, from `benchctl infer`: decode speed at "
    "batch 1 and at a batch, KV-cache bytes, FLOPs spent per generated token, mean depth, the teacher-forced "
    "validation loss under the setting and the agreement of its greedy continuations with full depth.",
    (
        Column("run_id", str, "the measured run (runs.id)"),
        Column("setting", str, "the inference setting's label (full depth, exit threshold and KV strategy, or draft)"),
        Column("prompts", int, "prompts generated as one batch (the batch-1 numbers use the first `single` of them)"),
        Column("single", int, "prompts generated one at a time for the batch-1 numbers"),
        Column("prompt_tokens", int, "tokens per prompt (the start of a validation window)", "tokens"),
        Column("new_tokens", int, "greedy tokens generated per prompt at most", "tokens"),
        Column("windows", int, "validation windows of the teacher-forced loss (the first N of the fixed set)"),
        Column("kind", str, "plain (one generation per call) or speculative (drafted, verified at full depth)"),
        Column("n_recur", int, "maximum depth (the trained depth unless the setting fixes one)"),
        Column("exit_rule", str, "kl or latent (empty: no exit)"),
        Column("exit_threshold", float, "exit threshold (0: no token exits)"),
        Column("kv", str, "KV strategy: full, last, budget:K or first"),
        Column("warm_start", int, "1: a token's state starts from the previous token's final state"),
        Column("draft_n_recur", int, "speculative: depth of the draft (0 for plain settings)"),
        Column("spec_k", int, "speculative: tokens drafted per verification (0 for plain settings)"),
        Column("device", str, "device type the row was measured on"),
        Column("threads", int, "torch CPU threads"),
        Column("tokens_per_s_1", float, "decode tokens per second at batch 1 (prefill excluded)", "tokens/s"),
        Column("prefill_tokens_per_s_1", float, "prefill prompt tokens per second at batch 1", "tokens/s"),
        Column(
            "tokens_per_s_batch",
            float,
            "decode tokens per second at batch `prompts`, prefill excluded (speculative: the prompts one by one)",
            "tokens/s",
        ),
        Column("prefill_tokens_per_s_batch", float, "prefill prompt tokens per second at batch `prompts`", "tokens/s"),
        Column(
            "peak_mem_bytes", int, "peak memory of the batched generation (CUDA: allocated; CPU: process RSS)", "bytes"
        ),
        Column(
            "peak_mem_source",
            str,
            "what peak_mem_bytes measures: cuda-allocated, process-rss (since the generation began) or "
            "process-rss-lifetime (where the kernel cannot reset the peak)",
        ),
        Column(
            "kv_bytes",
            int,
            "peak KV-cache bytes the batched generation held (speculative: prompts one at a time, the largest)",
            "bytes",
        ),
        Column("kv_bytes_per_1k", float, "KV-cache bytes the setting holds per 1,000 cached tokens of a row", "bytes"),
        Column("flops_per_token", float, "forward FLOPs spent per generated token (batched generation)", "FLOPs/token"),
        Column(
            "mean_depth",
            float,
            "mean iterations computed per generated token (speculative: drafts and verifications together)",
        ),
        Column(
            "mean_exit_depth",
            float,
            "mean iteration a generated token's state froze at (= mean_depth except under kv full, which computes "
            "an exited token's later iterations too)",
        ),
        Column(
            "val_loss",
            float,
            "teacher-forced validation loss under the setting (budget:K: fed one token at a time, as generated)",
            "nats/token",
        ),
        Column("val_flops_per_token", float, "forward FLOPs spent per token of the teacher-forced loss", "FLOPs/token"),
        Column("val_mean_depth", float, "mean iterations per token of the teacher-forced loss"),
        Column("agreement", float, "share of greedy tokens equal to the run's full-depth greedy continuation", "0-1"),
        Column("proposed", int, "speculative: draft tokens proposed", "tokens"),
        Column("accepted", int, "speculative: draft tokens accepted", "tokens"),
        Column("acceptance_rate", float, "speculative: accepted / proposed", "0-1"),
        Column("tokens_json", str, "JSON: the batched generation's greedy tokens per prompt (agreement's reference)"),
        Column("seconds", float, "wall time of the row's measurements, warm-up included", "s"),
        Column("created_at", str, "when it was measured (UTC)"),
        # added after the first databases were written: at the end, where adding them to such a file puts them
        Column("repeats", int, "timed generations per speed; each speed is their median"),
        Column("tokens_per_s_1_min", float, "slowest repeat of tokens_per_s_1", "tokens/s"),
        Column("tokens_per_s_1_max", float, "fastest repeat of tokens_per_s_1", "tokens/s"),
        Column("tokens_per_s_batch_min", float, "slowest repeat of tokens_per_s_batch", "tokens/s"),
        Column("tokens_per_s_batch_max", float, "fastest repeat of tokens_per_s_batch", "tokens/s"),
        Column(
            "speedup_1",
            float,
            "decode tokens/s at batch 1 over full depth's, timed beside it in each repeat: the median ratio "
            "(empty: full depth itself, or measured without --paired)",
            "ratio",
        ),
        Column("speedup_1_min", float, "smallest repeat's speedup_1", "ratio"),
        Column("speedup_1_max", float, "largest repeat's speedup_1", "ratio"),
        Column(
            "speedup_batch",
            float,
            "as speedup_1 at batch `prompts` (speculative: its prompts one by one against full depth's batch)",
            "ratio",
        ),
        Column("speedup_batch_min", float, "smallest repeat's speedup_batch", "ratio"),
        Column("speedup_batch_max", float, "largest repeat's speedup_batch", "ratio"),
        Column("speedups_json", str, 'JSON {"single": [...], "batch": [...]}: every repeat\'s speed-up ratio'),
        # What the timings were measured under (empty in rows measured before they were recorded)
        Column("load_avg", float, "mean 1-minute load average of the machine while the row's generations were timed"),
        Column("cores", int, "logical CPU cores of the machine that measured the row (what load_avg is read against)"),
        Column(
            "cpu_share",
            float,
            "process CPU time of the timed generations over their wall time times `threads`: near 1 when every "
            "thread ran the whole time, lower when the process waited for a core (or for the GPU)",
            "share",
        ),
    ),
    pk=("run_id", "setting", "prompts", "single", "prompt_tokens", "new_tokens", "windows"),
    foreign_keys=(("run_id", "runs", "id"),),
    not_null=("val_loss",),
    facets=("kind", "kv", "exit_threshold"),
    report_skip=("tokens_json",),
    report_sort=("run_id", "kind", "exit_threshold", "kv", "draft_n_recur", "setting"),
)

INFERENCE_LATENTS = Table(
    "inference_latents",
    "Latent trajectories",
    "The recurrent state of a few validation windows after each iteration, from `benchctl infer`: per-position "
    "convergence and a 2-D PCA projection of a few tokens' states (what the report's latent view draws).",
    (
        Column("run_id", str, "the traced run (runs.id)"),
        Column("sequence", int, "index of the validation window in the run's fixed set"),
        Column("n_recur", int, "iterations traced (the trained depth)"),
        Column("tokens", int, "positions in the window", "tokens"),
        Column("token_ids_json", str, "JSON: the window's token ids"),
        Column(
            "convergence_json",
            str,
            "JSON [iteration][position]: ||s_i - s_(i-1)|| / ||s_i|| for iterations i = 1..n_recur",
        ),
        Column("positions_json", str, "JSON: the positions whose states are projected"),
        Column(
            "pca_json", str, "JSON [position][iteration 0..n_recur]: the state's [x, y] on the first two components"
        ),
        Column("explained", str, "JSON: share of variance the two components explain"),
        Column("created_at", str, "when it was traced (UTC)"),
    ),
    pk=("run_id", "sequence", "n_recur"),
    foreign_keys=(("run_id", "runs", "id"),),
    not_null=("convergence_json",),
)

TABLES = (INFERENCE_RESULTS, INFERENCE_LATENTS)

_RESULT_PK = INFERENCE_RESULTS.pk
_LATENT_PK = INFERENCE_LATENTS.pk


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query: every inference_results row with its run's model and seed, the generated tokens
    left out and the measurements rounded (the exit threshold, which names a setting, as stored)."""
    if "inference_results" not in columns or "run_id" not in columns["inference_results"]:
        return {}
    shown = [c for c in columns["inference_results"] if c != "tokens_json"]
    cols = INFERENCE_RESULTS.browse_select("i", shown, exact=("exit_threshold",))
    return {
        "inference_results": {
            "title": "Inference cost",
            "description": "Decode speed, KV cache, FLOPs spent, loss and agreement per run and inference setting.",
            "sql": (
                f"select {model_label(columns)} as model, r.preset, r.seed, {cols} from inference_results i "
                "left join runs r on r.id = i.run_id order by model, r.preset, r.seed, i.kind, i.setting"
            ),
        }
    }


def result_keys(db: sqlite_utils.Database, run_id: str) -> set[tuple[Any, ...]]:
    """The key (past run_id) of every inference_results row stored for a run."""
    return {
        tuple(r[k] for k in _RESULT_PK[1:])
        for r in db.query("select * from inference_results where run_id = ?", [run_id])
    }


def stored_tokens(db: sqlite_utils.Database, run_id: str, key: tuple[Any, ...]) -> list[list[int]] | None:
    """The greedy tokens a stored row generated (None: no such row)."""
    where = " and ".join(f"{k} = ?" for k in _RESULT_PK)
    for r in db.query(f"select tokens_json from inference_results where {where}", [run_id, *key]):
        return None if r["tokens_json"] is None else json.loads(r["tokens_json"])
    return None


def latent_keys(db: sqlite_utils.Database, run_id: str) -> set[tuple[int, int]]:
    return {
        (r["sequence"], r["n_recur"]) for r in db.query("select * from inference_latents where run_id = ?", [run_id])
    }


def record_inference_result(db: sqlite_utils.Database, row: dict[str, Any]) -> None:
    """One measured (run, setting) row, written as soon as it is measured; an existing key is kept."""

    def write() -> None:
        with db.atomic():
            db["inference_results"].insert({"created_at": now(), **row}, pk=_RESULT_PK, ignore=True)

    retry_locked(write)


def record_latents(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """One run's traced windows in one transaction: a run's latent view is stored whole or not at all."""

    def write() -> None:
        with db.atomic():
            db["inference_latents"].insert_all([{"created_at": now(), **r} for r in rows], pk=_LATENT_PK, ignore=True)

    retry_locked(write)
