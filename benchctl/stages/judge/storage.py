"""What the judge reads from and writes to results.db, as judge objects; the queries themselves live in the tables
modules (benchctl.stages.judge.tables, and sample's and train's for what the judge reads).

The unit of work is a key (judge, prompt hash, sample id, repeat); the prompt hash covers the protocol too, and the
judge's stored name (`judge_model`) its backend and, for an OpenAI-compatible server, the base URL's host.
Each key's request row (`judge_requests`, with what was sent, the raw response, tokens and attempts summed over every
run) and grade row (`judge_grades`, the four scores or the failure, and the assessment under the `assess` protocol)
are written together as soon as the answer arrives.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from benchctl.core.errors import ConfigError
from benchctl.stages.judge import tables as judge_tables
from benchctl.stages.judge.client import CRITERIA, Outcome, Settings
from benchctl.stages.sample import tables as sample_tables
from benchctl.stages.train import tables as train_tables

# A results.db connection as benchctl.stages.connect returns it; the judge only ever hands it to the tables modules.
Database = Any


def select_samples(
    db: Database, run_ids: Sequence[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Samples to judge (all, or those of `run_ids`; the first `limit` prompts of each run), with their run's
    architecture and preset and the prompt text. An unknown run id is a ConfigError."""
    if run_ids:
        known = {r["id"] for r in train_tables.runs(db, ids=run_ids)}
        unknown = [r for r in run_ids if r not in known]
        if unknown:
            raise ConfigError(f"unknown run id(s): {', '.join(unknown)}; list them with 'benchctl runs'")
    return sample_tables.judge_samples(db, run_ids, limit)


def existing_status(db: Database, judge_model: str, prompt_hash: str) -> dict[tuple[str, int], str]:
    """(sample id, repeat) -> 'ok' or 'failed' for every key already graded with this model and prompt."""
    return judge_tables.judge_status(db, judge_model, prompt_hash)


def record(db: Database, o: Outcome, s: Settings) -> None:
    """Write one key's request/response and grade, in one transaction (a killed run keeps every finished key)."""
    status = "ok" if o.grade is not None else "failed"
    req_row = {
        "key": o.item.key(s.judge_model, s.prompt_hash),
        "judge_model": s.judge_model,
        "prompt_hash": s.prompt_hash,
        "sample_id": o.item.sample_id,
        "repeat": o.item.repeat,
        "request_json": json.dumps(o.request),
        "response_json": json.dumps(o.response_json) if o.response_json is not None else None,
        "http_status": o.http_status,
        "attempts": o.attempts,  # this run's; judge.tables adds earlier runs' calls and tokens for the key
        "prompt_tokens": o.billed.prompt_tokens,
        "output_tokens": o.billed.output_tokens,
        "thinking_tokens": o.billed.thinking_tokens,
        "total_tokens": o.billed.total_tokens,
        "latency_s": o.latency_s,
        "status": status,
        "finish_reason": o.finish_reason,
        "error": o.error,
        "temperature": s.temperature,
        "thinking_budget": s.thinking_budget,
        "max_output_tokens": s.max_output_tokens,
        "protocol": s.protocol,
        "seed": s.seed_for(o.item),
        **_judge_columns(o, s),
    }
    g = o.grade
    grade_row = {
        "sample_id": o.item.sample_id,
        "judge_model": s.judge_model,
        "prompt_hash": s.prompt_hash,
        "repeat": o.item.repeat,
        "status": status,
        **{c: (getattr(g, c) if g else None) for c in CRITERIA},
        "average": g.average if g else None,
        "finish_reason": o.finish_reason,
        "raw_text": o.raw_text,
        "error": o.error,
        "protocol": s.protocol,
        "assessment": getattr(g, "assessment", None),
        # The tokens of the answer this grade came from (judge_requests holds the sum over every call).
        "prompt_tokens": o.usage.prompt_tokens,
        "output_tokens": o.usage.output_tokens,
        "thinking_tokens": o.usage.thinking_tokens,
        "total_tokens": o.usage.total_tokens,
        **_judge_columns(o, s),
    }
    judge_tables.record_judge_answer(db, req_row, grade_row)


def _judge_columns(o: Outcome, s: Settings) -> dict[str, Any]:
    """Who graded, named fully: the backend, the model as sent, where it was sent (host and path, never a key), and
    the served model's revision where the service reported one."""
    return {"backend": s.backend, "model": s.model, "endpoint": s.endpoint, "model_revision": o.system_fingerprint}


def grades_in_scope(db: Database, s: Settings, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Stored grades (ok or failed) of this model and prompt for the given samples, every repeat."""
    return judge_tables.judge_grades(db, s.judge_model, s.prompt_hash, sample_ids)


def requests_in_scope(db: Database, s: Settings, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Stored request rows (tokens summed over every call, settings used) for the given samples, every repeat."""
    return judge_tables.judge_requests(db, s.judge_model, s.prompt_hash, sample_ids)
