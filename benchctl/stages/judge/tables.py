"""The tables the judge owns (judge_requests, judge_grades) and every function that writes them.

`benchctl.stages.judge.storage` turns the judge's objects into these rows; the SQL is here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlite_utils

from benchctl.core.db import now, retry_locked
from benchctl.core.tables import Column, Table
from benchctl.stages.train.tables import model_label

_PROTOCOL = "json (grades only) or assess (a general assessment first); empty: made before protocols existed, i.e. json"
_JUDGE_MODEL = (
    "the judge the grade is stored and cached under: a Gemini model (gemini-2.5-flash), or openai:<model> for "
    "OpenAI's service and openai:<model>@<host:port/path> for another OpenAI-compatible server"
)
# Who graded, named fully. Rows stored before these columns existed were all Gemini's: backend and model are filled
# in for them; where they were sent and which revision answered were not recorded.
_JUDGE_COLUMNS = (
    Column("backend", str, "the judge's backend: gemini (google-genai) or openai (an OpenAI-compatible server)"),
    Column("model", str, "the model name sent to the service"),
    Column("endpoint", str, "host (and path) of the service's base URL, never a key; empty: not recorded"),
    Column(
        "model_revision",
        str,
        "the served model's revision as the service reported it: system_fingerprint (OpenAI-compatible servers "
        "that report one), modelVersion (Gemini); empty: not reported",
    ),
)


def _judge_backfill(table: str) -> dict[str, str]:
    return {
        "backend": f"update {table} set backend = 'gemini' where backend is null",
        "model": f"update {table} set model = judge_model where model is null",
    }


JUDGE_REQUESTS = Table(
    "judge_requests",
    "Judge requests",
    "Cache of every request to the judge and its answer, with tokens, attempts and latency, keyed by (judge, prompt "
    "hash, sample, repeat).",
    (
        Column("key", str, "'<judge_model>|<prompt_hash>|<sample_id>|<repeat>'"),
        Column("judge_model", str, _JUDGE_MODEL),
        Column("prompt_hash", str, "hash of the judge prompt template (and protocol, for assess)"),
        Column("sample_id", str, "the graded completion (samples.id)"),
        Column("repeat", int, "repeat index of the same request"),
        Column("request_json", str, "the request sent"),
        Column("response_json", str, "the latest answer received"),
        Column("http_status", int, "HTTP status of the latest answer"),
        # attempts and tokens add up over every call made for the key, across runs
        Column("attempts", int, "calls made for this key, retries included"),
        Column("prompt_tokens", int, "input tokens billed, over every call", "tokens"),
        Column("output_tokens", int, "output tokens billed, over every call", "tokens"),
        Column("thinking_tokens", int, "thinking tokens billed, over every call", "tokens"),
        Column("total_tokens", int, "all tokens billed, over every call", "tokens"),
        Column("latency_s", float, "latency of the latest call", "s"),
        Column("status", str, "ok or failed (of the latest answer)"),
        Column("finish_reason", str, "the model's finish reason, e.g. STOP, MAX_TOKENS"),
        Column("error", str, "why the request failed"),
        Column("temperature", float, "judge sampling temperature"),
        Column("thinking_budget", int, "thinking budget sent (empty = the model's default)", "tokens"),
        Column("max_output_tokens", int, "output limit sent", "tokens"),
        Column("protocol", str, _PROTOCOL),
        Column("created_at", str, "first request (UTC)"),
        Column("updated_at", str, "latest answer (UTC)"),
        Column("seed", int, "the judge's sampling seed sent (repeat k: the job's seed + k); empty: none sent"),
        *_JUDGE_COLUMNS,
    ),
    pk="key",
    foreign_keys=(("sample_id", "samples", "id"),),
    backfill=_judge_backfill("judge_requests"),
    report_skip=("request_json", "response_json"),
)

JUDGE_GRADES = Table(
    "judge_grades",
    "Judge grades",
    "Parsed grades (1-10 per criterion) or failures, per (sample, judge, prompt hash, repeat). Failed rows are never "
    "scores.",
    (
        Column("sample_id", str, "the graded completion (samples.id)"),
        Column("judge_model", str, _JUDGE_MODEL),
        Column("prompt_hash", str, "hash of the judge prompt template (and protocol, for assess)"),
        Column("repeat", int, "repeat index"),
        Column("status", str, "ok or failed; failed rows carry no grades"),
        Column("grammar", int, "grammar grade", "1-10"),
        Column("creativity", int, "creativity grade", "1-10"),
        Column("consistency", int, "consistency grade", "1-10"),
        Column("plot", int, "plot grade", "1-10"),
        Column("average", float, "mean of the four grades", "1-10"),
        Column("finish_reason", str, "the judge's finish reason"),
        Column("raw_text", str, "the judge's raw answer"),
        Column("error", str, "why parsing failed"),
        Column("protocol", str, _PROTOCOL),
        Column(
            "assessment",
            str,
            "the judge's general assessment of the story, written before the grades (protocol assess)",
        ),
        Column("prompt_tokens", int, "input tokens of the call", "tokens"),
        Column("output_tokens", int, "output tokens of the call", "tokens"),
        Column("thinking_tokens", int, "thinking tokens of the call", "tokens"),
        Column("total_tokens", int, "all tokens of the call", "tokens"),
        Column("created_at", str, "when it was graded (UTC)"),
        *_JUDGE_COLUMNS,
    ),
    pk=("sample_id", "judge_model", "prompt_hash", "repeat"),
    foreign_keys=(("sample_id", "samples", "id"),),
    not_null=("status",),
    backfill=_judge_backfill("judge_grades"),
    indexes=(("judge_model", "prompt_hash"),),
    facets=("judge_model", "backend", "status"),
    report_skip=("raw_text",),
)

TABLES = (JUDGE_REQUESTS, JUDGE_GRADES)


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query over the grades, for a file that has them and the samples they grade."""
    if "judge_grades" not in columns or "samples" not in columns:
        return {}
    return {
        "judge_grades_by_model": {
            "title": "Judge grades by model and criterion",
            "description": "Mean grade (1-10) per criterion for each model, judge model and judge prompt; failed "
            "gradings are counted, never scored.",
            "sql": f"""select {model_label(columns)} as model, r.preset, g.judge_model, g.prompt_hash,
  count(distinct r.seed) as n_seeds, sum(g.status = 'ok') as n_graded, sum(g.status != 'ok') as n_failed,
  round(avg(g.grammar), 2) as grammar, round(avg(g.creativity), 2) as creativity,
  round(avg(g.consistency), 2) as consistency, round(avg(g.plot), 2) as plot, round(avg(g.average), 2) as average
from judge_grades g join samples s on s.id = g.sample_id join runs r on r.id = s.run_id
group by model, r.preset, g.judge_model, g.prompt_hash order by g.judge_model, r.preset, avg(g.average) desc""",
        }
    }


_JUDGE_GRADE_PK = ("sample_id", "judge_model", "prompt_hash", "repeat")
# judge_requests columns that add up over every run that called the service for a key, so retrying a failed key
# never hides tokens (or calls) that were already paid for.
_JUDGE_ACCUMULATED = ("attempts", "prompt_tokens", "output_tokens", "thinking_tokens", "total_tokens")


def judge_status(db: sqlite_utils.Database, judge_model: str, prompt_hash: str) -> dict[tuple[str, int], str]:
    """(sample id, repeat) -> status ('ok' or 'failed') of every stored grade of this judge model and prompt."""
    rows = db.query(
        "select sample_id, repeat, status from judge_grades where judge_model = ? and prompt_hash = ?",
        [judge_model, prompt_hash],
    )
    return {(r["sample_id"], r["repeat"]): r["status"] for r in rows}


def judge_grades(
    db: sqlite_utils.Database, judge_model: str, prompt_hash: str, sample_ids: Iterable[str]
) -> list[dict[str, Any]]:
    """Every judge_grades row of this judge model and prompt for the given samples."""
    return _judge_rows(db, "judge_grades", judge_model, prompt_hash, sample_ids)


def judge_requests(
    db: sqlite_utils.Database, judge_model: str, prompt_hash: str, sample_ids: Iterable[str]
) -> list[dict[str, Any]]:
    """Every judge_requests row of this judge model and prompt for the given samples."""
    return _judge_rows(db, "judge_requests", judge_model, prompt_hash, sample_ids)


def _judge_rows(
    db: sqlite_utils.Database, table: str, judge_model: str, prompt_hash: str, sample_ids: Iterable[str]
) -> list[dict[str, Any]]:
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
