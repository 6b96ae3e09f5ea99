"""The Gemini judge: grade every generated story on grammar, creativity, consistency and plot (SPEC.md §5).

Follows the study's protocol (the TinyStories paper's GPT-4 grading, adapted to Gemini): the grading prompt is the
file `judge_prompts/story_grading.md` (the study's text verbatim, plus an instruction asking for JSON), with the story
shown as the TinyStories paper shows it — the beginning, then `***`, then the model's completion. The file's sha256
(first 12 hex digits) is the prompt version, stored with every grade, so editing the prompt never mixes grades.

How a job runs (`judge_all`):
- The unit of work is a key (judge model, prompt hash, sample id, repeat). Keys that already have a grade with status
  'ok' are skipped; failed ones are retried by default, so a run that was killed or rate-limited picks up where it
  stopped and a rerun never pays twice for a good grade.
- google-genai's async client (`client.aio.models.generate_content`) with structured output (the pydantic `Grade`
  schema), at most `concurrency` requests in flight (an asyncio.Semaphore; the SDK has no limit of its own).
- The SDK's own retries are switched off (`HttpRetryOptions(attempts=1)` also disables its implicit retry on
  connection errors); benchctl retries 429, 5xx and transport errors with exponential backoff and jitter, honouring
  the server's RetryInfo `retryDelay` (which the SDK ignores, python-genai #1875), up to `max_attempts` calls. Other
  4xx fail the key at once; an invalid key, a refused permission or an unknown model stop the whole job (JudgeError).
- The answer is parsed by benchctl, not through `response.parsed` (silently None on bad JSON): unparseable,
  truncated (finishReason MAX_TOKENS), blocked (promptFeedback.blockReason or a non-STOP finish reason), incomplete or
  out-of-range answers are stored as failed grades with the raw text and finish reason — never as a score.
- Each key's request row (`judge_requests`) and grade row (`judge_grades`) are written in one transaction as soon as
  the answer arrives, so a killed run keeps everything it finished.
- Token usage is stored per request and summed; cost is estimated from a small price table (unknown model -> None).

The summary gives, per architecture, the mean of each criterion and of the average with a 95% t-interval over
samples (a sample's repeats are averaged first; fewer than two samples -> no interval), and the number of failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import pydantic
import sqlite_utils

from benchctl import db as dbm
from benchctl import paper
from benchctl.errors import ConfigError, JudgeError

CRITERIA = ("grammar", "creativity", "consistency", "plot")
SCORE_MIN, SCORE_MAX = 1, 10

PROMPT_PATH = Path(__file__).resolve().parent.parent / "judge_prompts" / "story_grading.md"
STORY_SLOT = "{story}"
STORY_SEPARATOR = "***"  # the TinyStories paper marks where the given beginning ends and the completion starts

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
DEFAULT_MODEL = "gemini-2.5-flash"
# Temperature 0 by default: each grade is the judge's most likely verdict, so a mean over samples is not blurred by
# sampling noise; `--repeats` at this temperature measures the service's residual nondeterminism. Pass a higher
# temperature to study judge variance. The value is stored with every request.
DEFAULT_TEMPERATURE = 0.0
AUTO = "auto"
# Thinking: off (budget 0) on the models that allow turning it off; other models keep their default (not sent).
# The budget actually sent is stored with every request.
_THINKING_OFF_MODELS = ("gemini-2.5-flash", "gemini-2.5-flash-lite")
# The answer is ~25 tokens of JSON; thinking tokens count towards the output limit, so leave room when thinking is on.
_MAX_OUTPUT_NO_THINKING = 1024
_MAX_OUTPUT_THINKING = 8192

# Dry-run estimate: Gemini tokenizes English at roughly 4 characters per token; the JSON answer is ~25–35 tokens.
CHARS_PER_TOKEN = 4.0
OUTPUT_TOKENS_ESTIMATE = 40

# USD per million tokens, paid tier, prompts up to 200k tokens (ai.google.dev/gemini-api/docs/pricing, 2025).
# Output price applies to candidates and thinking tokens alike. Models not listed have no cost estimate.
PRICES_USD_PER_M: dict[str, tuple[float, float]] = {
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-pro": (1.25, 10.00),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.0-flash-lite": (0.075, 0.30),
}


def _retryable(code: int | None) -> bool:
    """429 (rate limit / quota) and every 5xx; other 4xx would fail the same way again."""
    return code is not None and (code == 429 or 500 <= code < 600)


class Grade(pydantic.BaseModel):
    """The judge's answer: four integer scores 1..10 (the structured-output schema sent to Gemini)."""

    grammar: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    creativity: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    consistency: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    plot: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)

    @property
    def average(self) -> float:
        return (self.grammar + self.creativity + self.consistency + self.plot) / 4


# --------------------------------------------------------------------------------------------------------------------
# The prompt template.


@dataclass(frozen=True)
class Template:
    text: str
    hash: str  # sha256 of the file bytes, first 12 hex digits
    path: Path

    def fill(self, beginning: str, completion: str) -> str:
        # str.replace, not str.format: stories may contain braces.
        return self.text.replace(STORY_SLOT, format_story(beginning, completion))


def format_story(beginning: str, completion: str) -> str:
    """The story as the judge sees it: the given beginning, then `***`, then the model's completion."""
    return f"{beginning.strip()} {STORY_SEPARATOR} {completion.strip()}"


def load_template(path: str | os.PathLike | None = None) -> Template:
    p = Path(path) if path is not None else PROMPT_PATH
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the judge prompt {p}: {e.strerror}; pass an existing template file") from None
    text = raw.decode("utf-8")
    n = text.count(STORY_SLOT)
    if n != 1:
        raise ConfigError(f"judge prompt {p} must contain the slot {STORY_SLOT} exactly once (found {n})")
    return Template(text=text, hash=hashlib.sha256(raw).hexdigest()[:12], path=p)


# --------------------------------------------------------------------------------------------------------------------
# Keys, settings, prices.


def api_key() -> str | None:
    for var in API_KEY_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value
    return None


def has_api_key() -> bool:
    """True if GEMINI_API_KEY or GOOGLE_API_KEY is set (non-empty)."""
    return api_key() is not None


def require_api_key() -> str:
    key = api_key()
    if key is None:
        raise JudgeError(
            "no Gemini API key: set GEMINI_API_KEY (or GOOGLE_API_KEY) to a key from "
            "https://aistudio.google.com/apikey, or use --dry-run to count requests without sending any"
        )
    return key


def default_thinking_budget(model: str) -> int | None:
    """0 (thinking off) for models that allow it; None (the model's default, not sent) otherwise."""
    return 0 if _bare_model(model) in _THINKING_OFF_MODELS else None


def _bare_model(model: str) -> str:
    return model.removeprefix("models/")


def estimate_cost(model: str, prompt_tokens: int, output_tokens: int) -> float | None:
    """USD for `prompt_tokens` in and `output_tokens` out (candidates + thinking); None for a model not in the table."""
    price = PRICES_USD_PER_M.get(_bare_model(model))
    if price is None:
        return None
    return (prompt_tokens * price[0] + output_tokens * price[1]) / 1e6


@dataclass
class Usage:
    prompt_tokens: int = 0
    output_tokens: int = 0  # candidatesTokenCount
    thinking_tokens: int = 0  # thoughtsTokenCount
    total_tokens: int = 0

    def __iadd__(self, other: Usage) -> Usage:
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        self.thinking_tokens += other.thinking_tokens
        self.total_tokens += other.total_tokens
        return self

    def cost(self, model: str) -> float | None:
        return estimate_cost(model, self.prompt_tokens, self.output_tokens + self.thinking_tokens)


# --------------------------------------------------------------------------------------------------------------------
# Parsing an answer (pure; never turns a bad answer into a score).


def parse_grade(
    text: str | None, finish_reason: str | None, block_reason: str | None = None
) -> tuple[Grade | None, str | None]:
    """(grade, None) for a complete, valid answer; (None, why) otherwise."""
    if block_reason:
        return None, f"blocked: promptFeedback.blockReason {block_reason}"
    if finish_reason == "MAX_TOKENS":
        return None, "truncated: finishReason MAX_TOKENS"
    if finish_reason not in (None, "STOP"):
        return None, f"blocked or stopped early: finishReason {finish_reason}"
    if not text or not text.strip():
        return None, "empty answer"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"unparseable JSON: {e.msg} at char {e.pos}"
    if not isinstance(obj, dict):
        return None, f"answer is JSON {type(obj).__name__}, not an object"
    missing = [c for c in CRITERIA if c not in obj]
    if missing:
        return None, f"missing field(s): {', '.join(missing)}"
    problems = []
    for c in CRITERIA:
        v = obj[c]
        # Only JSON integers count: 7.5, "7" and true are not scores on a 1..10 integer scale.
        if isinstance(v, bool) or not isinstance(v, int):
            problems.append(f"{c}={v!r} is not an integer")
        elif not SCORE_MIN <= v <= SCORE_MAX:
            problems.append(f"{c}={v} out of range {SCORE_MIN}..{SCORE_MAX}")
    if problems:
        return None, "; ".join(problems)
    return Grade(**{c: obj[c] for c in CRITERIA}), None


def _enum_str(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "value", value))


def _response_text(response: Any) -> tuple[str | None, str | None, str | None]:
    """(answer text without thought parts, finish reason, prompt block reason) of a GenerateContentResponse."""
    block = _enum_str(getattr(response.prompt_feedback, "block_reason", None)) if response.prompt_feedback else None
    if not response.candidates:
        return None, None, block
    cand = response.candidates[0]
    parts = (cand.content.parts or []) if cand.content else []
    text = "".join(p.text for p in parts if p.text is not None and not p.thought)
    return (text if parts else None), _enum_str(cand.finish_reason), block


def _usage(response: Any) -> Usage:
    um = response.usage_metadata
    if um is None:
        return Usage()
    return Usage(
        prompt_tokens=um.prompt_token_count or 0,
        output_tokens=um.candidates_token_count or 0,
        thinking_tokens=um.thoughts_token_count or 0,
        total_tokens=um.total_token_count or 0,
    )


# --------------------------------------------------------------------------------------------------------------------
# Retry policy.


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)s\s*$")


def server_retry_delay(error: Any) -> float | None:
    """Seconds the server asked us to wait: google.rpc.RetryInfo `retryDelay` ("2s", "0.3s"), else Retry-After."""
    body = getattr(error, "details", None)
    err = body.get("error", body) if isinstance(body, dict) else None
    for detail in (err or {}).get("details", []) if isinstance(err, dict) else []:
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            m = _DURATION.match(str(detail.get("retryDelay", "")))
            if m:
                return float(m.group(1))
    headers = getattr(getattr(error, "response", None), "headers", None)
    if headers is not None:
        value = headers.get("Retry-After")
        if value is not None and value.strip().replace(".", "", 1).isdigit():
            return float(value)
    return None


def backoff_delay(attempt: int, base_delay: float, max_delay: float, rng: random.Random) -> float:
    """Exponential backoff with 'equal jitter': half of min(max, base * 2^(attempt-1)) fixed, half random."""
    cap = min(max_delay, base_delay * (2 ** (attempt - 1)))
    return cap / 2 + rng.uniform(0, cap / 2)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of whichever HTTP stack the SDK uses (aiohttp, httpx2 or httpx)."""
    errs: list[type[BaseException]] = [asyncio.TimeoutError, ConnectionError]
    try:
        import aiohttp

        errs.append(aiohttp.ClientError)
    except ImportError:
        pass
    for mod in ("httpx2", "httpx"):
        try:
            errs.append(__import__(mod).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errs)


def _refuses_job(code: int, message: str) -> bool:
    """Errors that every other request would hit too: bad key, no permission, unknown model."""
    return code in (401, 403, 404) or (code == 400 and "api key" in message.lower())


# --------------------------------------------------------------------------------------------------------------------
# Work items and results.


@dataclass(frozen=True)
class WorkItem:
    sample_id: str
    run_id: str
    arch: str
    repeat: int
    prompt: str  # the filled template

    def key(self, judge_model: str, prompt_hash: str) -> str:
        return f"{judge_model}|{prompt_hash}|{self.sample_id}|{self.repeat}"


@dataclass
class Outcome:
    """The result of one key after all attempts."""

    item: WorkItem
    grade: Grade | None
    error: str | None
    finish_reason: str | None = None
    raw_text: str | None = None
    http_status: int | None = None
    response_json: Any = None
    attempts: int = 0
    usage: Usage = field(default_factory=Usage)  # of the response that produced this outcome
    billed: Usage = field(default_factory=Usage)  # over every answered call for this key in this run
    latency_s: float = 0.0


@dataclass
class CriterionStat:
    mean: float | None  # None without any value
    ci_low: float | None  # None when n < 2
    ci_high: float | None


@dataclass
class ArchSummary:
    arch: str
    preset: str
    label: str  # the architecture, with the preset when the scope mixes presets
    n_samples: int  # samples with at least one ok grade
    n_grades: int  # ok grades (samples x repeats)
    n_failed: int  # keys whose current grade is 'failed'
    n_pending: int  # keys never answered (e.g. the job was stopped)
    stats: dict[str, CriterionStat]  # criterion or "average" -> mean and 95% CI over samples


@dataclass
class JudgeSummary:
    judge_model: str
    prompt_hash: str
    prompt_path: str
    dry_run: bool
    temperature: float
    thinking_budget: int | None
    repeats: int
    n_samples: int  # samples in scope
    n_keys: int  # samples x repeats
    n_cached: int  # keys skipped because they already have an ok grade (or a failed one with retry_failed=False)
    n_todo: int  # keys this invocation graded (or, with dry_run, would grade)
    n_requests: int  # HTTP calls made by this invocation (retries included); 0 for a dry run
    n_ok: int  # keys graded ok by this invocation
    n_failed: int  # keys that failed in this invocation
    failures: list[dict[str, Any]]  # this invocation's failures: sample_id, repeat, arch, error
    usage: Usage  # tokens billed by this invocation
    cost_usd: float | None
    usage_total: Usage  # tokens billed for every key in scope, over all invocations
    cost_total_usd: float | None
    estimated_prompt_tokens: int = 0  # dry run only: chars/4 of each filled prompt
    estimated_output_tokens: int = 0  # dry run only: OUTPUT_TOKENS_ESTIMATE (+ thinking budget) per request
    estimated_cost_usd: float | None = None
    per_arch: list[ArchSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------------------------
# Statistics (pure). TODO(lead): fold into benchctl/stats.py once it exists.


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> CriterionStat:
    """Mean and two-sided t-interval; no interval (None) with fewer than two values."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return CriterionStat(None, None, None)
    m = sum(values) / n
    if n < 2:
        return CriterionStat(m, None, None)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return CriterionStat(m, m - half, m + half)


# --------------------------------------------------------------------------------------------------------------------
# Database access.


def select_samples(
    db: sqlite_utils.Database, run_ids: Sequence[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Samples to judge, with their run's architecture and the prompt text.

    Ordered by prompt index first, so `limit` takes the same first prompts from every run rather than all of one run.
    """
    where, params = "", []
    if run_ids:
        marks = ",".join("?" * len(run_ids))
        known = {r["id"] for r in db.query(f"select id from runs where id in ({marks})", list(run_ids))}
        unknown = [r for r in run_ids if r not in known]
        if unknown:
            raise ConfigError(
                f"unknown run id(s): {', '.join(unknown)}; see the ids with "
                "'sqlite-utils query results/results.db \"select id, arch from runs\"'"
            )
        where = f"where s.run_id in ({marks})"
        params = list(run_ids)
    sql = (
        "select s.id as sample_id, s.run_id, r.arch, r.preset, p.idx as prompt_idx, p.text as beginning, s.completion "
        "from samples s join runs r on r.id = s.run_id join prompts p on p.id = s.prompt_id "
        f"{where} order by p.idx, r.arch, s.run_id, s.id"
    )
    if limit is not None:
        sql += " limit ?"
        params.append(limit)
    return list(db.query(sql, params))


def _existing_status(db: sqlite_utils.Database, judge_model: str, prompt_hash: str) -> dict[tuple[str, int], str]:
    rows = db.query(
        "select sample_id, repeat, status from judge_grades where judge_model = ? and prompt_hash = ?",
        [judge_model, prompt_hash],
    )
    return {(r["sample_id"], r["repeat"]): r["status"] for r in rows}


def _record(
    db: sqlite_utils.Database, o: Outcome, *, judge_model: str, prompt_hash: str, request: dict[str, Any]
) -> None:
    """Write one key's request/response and grade, in one transaction (a killed run keeps every finished key)."""
    key = o.item.key(judge_model, prompt_hash)
    prev = next(iter(db.query("select * from judge_requests where key = ?", [key])), None)
    # Token and attempt columns of judge_requests accumulate over every run that called the service for this key,
    # so retrying a failed key never hides tokens that were already paid for.
    billed = Usage(
        (prev or {}).get("prompt_tokens") or 0,
        (prev or {}).get("output_tokens") or 0,
        (prev or {}).get("thinking_tokens") or 0,
        (prev or {}).get("total_tokens") or 0,
    )
    billed += o.billed
    created = now = dbm.now()
    if prev and prev.get("created_at"):
        created = prev["created_at"]
    status = "ok" if o.grade is not None else "failed"
    req_row = {
        "key": key,
        "judge_model": judge_model,
        "prompt_hash": prompt_hash,
        "sample_id": o.item.sample_id,
        "repeat": o.item.repeat,
        "request_json": json.dumps(request),
        "response_json": json.dumps(o.response_json) if o.response_json is not None else None,
        "http_status": o.http_status,
        "attempts": ((prev or {}).get("attempts") or 0) + o.attempts,
        "prompt_tokens": billed.prompt_tokens,
        "output_tokens": billed.output_tokens,
        "thinking_tokens": billed.thinking_tokens,
        "total_tokens": billed.total_tokens,
        "latency_s": o.latency_s,
        "status": status,
        "finish_reason": o.finish_reason,
        "error": o.error,
        "temperature": request["generation_config"]["temperature"],
        "thinking_budget": request["generation_config"].get("thinking_budget"),
        "max_output_tokens": request["generation_config"]["max_output_tokens"],
        "created_at": created,
        "updated_at": now,
    }
    g = o.grade
    grade_row = {
        "sample_id": o.item.sample_id,
        "judge_model": judge_model,
        "prompt_hash": prompt_hash,
        "repeat": o.item.repeat,
        "status": status,
        **{c: (getattr(g, c) if g else None) for c in CRITERIA},
        "average": g.average if g else None,
        "finish_reason": o.finish_reason,
        "raw_text": o.raw_text,
        "error": o.error,
        "prompt_tokens": o.usage.prompt_tokens,
        "output_tokens": o.usage.output_tokens,
        "thinking_tokens": o.usage.thinking_tokens,
        "total_tokens": o.usage.total_tokens,
        "created_at": now,
    }

    def write() -> None:
        with db.conn:
            db["judge_requests"].upsert(req_row, pk="key")
            db["judge_grades"].upsert(grade_row, pk=("sample_id", "judge_model", "prompt_hash", "repeat"))

    dbm.retry_locked(write)


# --------------------------------------------------------------------------------------------------------------------
# The job.


@dataclass
class _Settings:
    judge_model: str
    prompt_hash: str
    temperature: float
    thinking_budget: int | None
    max_output_tokens: int
    max_attempts: int
    base_delay: float
    max_delay: float


def _request_record(item: WorkItem, s: _Settings) -> dict[str, Any]:
    """What is sent, as stored in judge_requests.request_json (the SDK turns it into the REST body)."""
    return {
        "model": s.judge_model,
        "contents": item.prompt,
        "generation_config": {
            "temperature": s.temperature,
            "max_output_tokens": s.max_output_tokens,
            "thinking_budget": s.thinking_budget,
            "response_mime_type": "application/json",
            "response_schema": Grade.model_json_schema(),
        },
    }


def _gen_config(s: _Settings) -> Any:
    from google.genai import types

    thinking = None if s.thinking_budget is None else types.ThinkingConfig(thinking_budget=s.thinking_budget)
    return types.GenerateContentConfig(
        response_mime_type="application/json",
        response_schema=Grade,
        temperature=s.temperature,
        max_output_tokens=s.max_output_tokens,
        thinking_config=thinking,
    )


class _Job:
    def __init__(self, aclient: Any, s: _Settings, concurrency: int, seed: int | None):
        self.aclient = aclient
        self.s = s
        self.config = _gen_config(s)
        self.sem = asyncio.Semaphore(concurrency)
        self.refused: str | None = None  # set when the service refuses the whole job
        self.n_requests = 0
        self.rng = random.Random(seed)
        self.transport_errors = _transport_errors()

    async def grade(self, item: WorkItem) -> Outcome | None:
        """All attempts for one key; None if the job was refused before this key was sent."""
        from google.genai import errors as genai_errors

        async with self.sem:  # at most `concurrency` keys (hence HTTP requests) in flight
            out = Outcome(item, None, None)
            started = time.monotonic()
            while True:
                if self.refused is not None:
                    return out if out.attempts else None
                out.attempts += 1
                self.n_requests += 1
                delay: float | None = None
                try:
                    resp = await self.aclient.models.generate_content(
                        model=self.s.judge_model, contents=item.prompt, config=self.config
                    )
                except genai_errors.APIError as e:
                    out.http_status, out.response_json = e.code, e.details
                    out.error = f"HTTP {e.code} {e.status or ''}: {e.message or ''}".strip()
                    if _retryable(e.code):
                        delay = server_retry_delay(e)
                        if delay is not None:
                            delay += self.rng.uniform(0, 0.1 * delay)  # spread the herd a little beyond the hint
                    else:
                        if _refuses_job(e.code or 0, e.message or ""):
                            self.refused = out.error
                        break  # other 4xx: retrying cannot help
                except self.transport_errors as e:
                    out.http_status, out.response_json = None, None
                    out.error = f"connection error: {type(e).__name__}: {e}".strip()
                else:
                    out.http_status = 200
                    out.response_json = resp.model_dump(
                        mode="json",
                        exclude_none=True,
                        exclude={"sdk_http_response", "automatic_function_calling_history", "parsed"},
                    )
                    out.usage = _usage(resp)
                    out.billed += out.usage
                    out.raw_text, out.finish_reason, block = _response_text(resp)
                    out.grade, out.error = parse_grade(out.raw_text, out.finish_reason, block)
                    break
                if out.attempts >= self.s.max_attempts:
                    out.error = f"gave up after {out.attempts} attempts; last: {out.error}"
                    break
                if delay is None:
                    delay = backoff_delay(out.attempts, self.s.base_delay, self.s.max_delay, self.rng)
                await asyncio.sleep(delay)
            out.latency_s = time.monotonic() - started
            return out


def _make_client(key: str, base_url: str | None, timeout_s: float) -> Any:
    from google import genai
    from google.genai import types

    http_options = types.HttpOptions(
        base_url=base_url,  # None -> the SDK uses $GOOGLE_GEMINI_BASE_URL, else the public endpoint
        timeout=int(timeout_s * 1000),  # milliseconds
        # attempts=1: no SDK retries at all (with retry_options unset the SDK still retries connection errors
        # once after a 1–10 s sleep); benchctl owns the retry policy.
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    return genai.Client(api_key=key, http_options=http_options)


def _validate(judge_model: str, concurrency: int, repeats: int, limit: int | None, max_attempts: int) -> None:
    if not judge_model or not judge_model.strip():
        raise ConfigError("--model must name a Gemini model, e.g. gemini-2.5-flash")
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    if max_attempts < 1:
        raise ConfigError(f"--max-attempts must be at least 1, got {max_attempts}")


async def judge_all_async(
    db: sqlite_utils.Database,
    *,
    judge_model: str = DEFAULT_MODEL,
    concurrency: int = 8,
    repeats: int = 1,
    limit: int | None = None,
    run_ids: Sequence[str] | None = None,
    dry_run: bool = False,
    base_url: str | None = None,
    progress: bool = True,
    temperature: float = DEFAULT_TEMPERATURE,
    thinking_budget: int | None | str = AUTO,
    max_output_tokens: int | None = None,
    retry_failed: bool = True,
    max_attempts: int = 6,
    base_delay: float = 1.0,
    max_delay: float = 60.0,
    timeout_s: float = 120.0,
    prompt_path: str | os.PathLike | None = None,
    seed: int | None = None,
) -> JudgeSummary:
    """Async form of `judge_all` (same arguments), for callers that already run an event loop."""
    _validate(judge_model, concurrency, repeats, limit, max_attempts)
    key = None if dry_run else require_api_key()  # before any work, so a missing key never costs a thing
    t0 = time.monotonic()
    template = load_template(prompt_path)
    budget = default_thinking_budget(judge_model) if thinking_budget == AUTO else thinking_budget
    if max_output_tokens is None:
        max_output_tokens = _MAX_OUTPUT_NO_THINKING if budget == 0 else _MAX_OUTPUT_THINKING
    s = _Settings(
        judge_model, template.hash, temperature, budget, max_output_tokens, max_attempts, base_delay, max_delay
    )

    samples = select_samples(db, run_ids, limit)
    if not samples:
        scope = f" for run(s) {', '.join(run_ids)}" if run_ids else ""
        raise JudgeError(f"no samples to judge{scope}; run 'benchctl sample' first")
    status = _existing_status(db, judge_model, template.hash)
    skip = {"ok"} | (set() if retry_failed else {"failed"})
    todo: list[WorkItem] = []
    for row in samples:
        filled = template.fill(row["beginning"], row["completion"])
        for r in range(repeats):
            if status.get((row["sample_id"], r)) not in skip:
                todo.append(WorkItem(row["sample_id"], row["run_id"], row["arch"], r, filled))
    n_keys = len(samples) * repeats

    summary = JudgeSummary(
        judge_model=judge_model,
        prompt_hash=template.hash,
        prompt_path=str(template.path),
        dry_run=dry_run,
        temperature=temperature,
        thinking_budget=budget,
        repeats=repeats,
        n_samples=len(samples),
        n_keys=n_keys,
        n_cached=n_keys - len(todo),
        n_todo=len(todo),
        n_requests=0,
        n_ok=0,
        n_failed=0,
        failures=[],
        usage=Usage(),
        cost_usd=None,
        usage_total=Usage(),
        cost_total_usd=None,
    )

    if dry_run:
        summary.estimated_prompt_tokens = sum(math.ceil(len(it.prompt) / CHARS_PER_TOKEN) for it in todo)
        summary.estimated_output_tokens = len(todo) * (OUTPUT_TOKENS_ESTIMATE + (budget or 0))
        summary.estimated_cost_usd = estimate_cost(
            judge_model, summary.estimated_prompt_tokens, summary.estimated_output_tokens
        )
        summary.notes.append(
            f"estimate only: prompt tokens ~ characters/{CHARS_PER_TOKEN:g}, output ~ {OUTPUT_TOKENS_ESTIMATE} tokens "
            "per request" + (f" + a thinking budget of {budget}" if budget else "")
            + ("; thinking tokens not included (the model thinks by default)" if budget is None else "")
            + "; retries not included"
        )
    elif todo:
        await _run(db, todo, s, key, base_url, concurrency, progress, timeout_s, seed, summary)

    _summarize(db, samples, s, repeats, summary)
    summary.elapsed_s = time.monotonic() - t0
    return summary


async def _run(
    db: sqlite_utils.Database,
    todo: list[WorkItem],
    s: _Settings,
    key: str,
    base_url: str | None,
    concurrency: int,
    progress: bool,
    timeout_s: float,
    seed: int | None,
    summary: JudgeSummary,
) -> None:
    client = _make_client(key, base_url, timeout_s)
    job = _Job(client.aio, s, concurrency, seed)
    bar = _progress_bar(progress, len(todo), s.judge_model)
    tasks = [asyncio.create_task(job.grade(it)) for it in todo]
    try:
        for fut in asyncio.as_completed(tasks):
            o = await fut
            if o is None:
                continue
            _record(db, o, judge_model=s.judge_model, prompt_hash=s.prompt_hash, request=_request_record(o.item, s))
            summary.usage += o.billed
            if o.grade is not None:
                summary.n_ok += 1
            else:
                summary.n_failed += 1
                summary.failures.append(
                    {"sample_id": o.item.sample_id, "repeat": o.item.repeat, "arch": o.item.arch, "error": o.error}
                )
            if bar is not None:
                bar[0].update(bar[1], advance=1, description=f"judging ({summary.n_ok} ok, {summary.n_failed} failed)")
    finally:
        for t in tasks:  # only left over when interrupted: in-flight answers are dropped, their keys stay pending
            t.cancel()
        if bar is not None:
            bar[0].stop()
        await client.aio.aclose()
    summary.n_requests = job.n_requests
    if job.refused is not None:
        raise JudgeError(
            f"the judge service refused the job ({job.refused}); check the key in GEMINI_API_KEY / GOOGLE_API_KEY "
            f"and the model name '{s.judge_model}'. {summary.n_ok} grade(s) stored; rerun to continue"
        )


def _progress_bar(enabled: bool, total: int, model: str) -> tuple[Any, Any] | None:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    p = Progress(
        TextColumn(f"{model} [progress.description]{{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    p.start()
    return p, p.add_task("judging", total=total)


def _summarize(
    db: sqlite_utils.Database, samples: list[dict[str, Any]], s: _Settings, repeats: int, summary: JudgeSummary
) -> None:
    """Per-architecture means with 95% CIs over samples, failures, and token totals for the samples in scope."""
    group_of = {r["sample_id"]: (r["preset"], r["arch"]) for r in samples}
    ids = list(group_of)
    grades: dict[str, list[dict[str, Any]]] = {}
    status: dict[tuple[str, int], str] = {}
    usage_total = Usage()
    mismatched = 0
    for chunk in _chunks(ids, 500):
        marks = ",".join("?" * len(chunk))
        for g in db.query(
            f"select * from judge_grades where judge_model = ? and prompt_hash = ? and sample_id in ({marks})",
            [s.judge_model, s.prompt_hash, *chunk],
        ):
            if g["repeat"] >= repeats:
                continue  # repeats beyond the requested K belong to another job
            status[(g["sample_id"], g["repeat"])] = g["status"]
            if g["status"] == "ok":
                grades.setdefault(g["sample_id"], []).append(g)
        for r in db.query(
            f"select * from judge_requests where judge_model = ? and prompt_hash = ? and sample_id in ({marks})",
            [s.judge_model, s.prompt_hash, *chunk],
        ):
            if r["repeat"] >= repeats:
                continue
            usage_total += Usage(r["prompt_tokens"] or 0, r["output_tokens"] or 0, r["thinking_tokens"] or 0,
                                 r["total_tokens"] or 0)
            if r["status"] == "ok" and (r["temperature"] != s.temperature or r["thinking_budget"] != s.thinking_budget):
                mismatched += 1
    summary.usage_total = usage_total
    summary.cost_total_usd = usage_total.cost(s.judge_model)
    summary.cost_usd = summary.usage.cost(s.judge_model)
    if mismatched:
        summary.notes.append(
            f"{mismatched} cached grade(s) were made with another temperature or thinking budget than "
            f"temperature={s.temperature}, thinking_budget={s.thinking_budget}; see judge_requests"
        )
    if summary.cost_usd is None and not summary.dry_run:
        summary.notes.append(f"no price known for '{s.judge_model}': cost not estimated")

    per_arch: list[ArchSummary] = []
    presets = {p for p, _ in group_of.values()}
    for preset, arch in sorted(set(group_of.values()), key=_arch_order):
        arch_ids = [i for i in ids if group_of[i] == (preset, arch)]
        keys = [(i, r) for i in arch_ids for r in range(repeats)]
        per_sample = {i: grades[i] for i in arch_ids if i in grades}
        stats: dict[str, CriterionStat] = {}
        for c in (*CRITERIA, "average"):
            # A sample's repeats are averaged first: the unit of the interval is the sample, not the request.
            stats[c] = mean_ci([sum(g[c] for g in gs) / len(gs) for gs in per_sample.values()])
        per_arch.append(ArchSummary(
            arch=arch,
            preset=preset,
            label=arch if len(presets) == 1 else f"{arch} ({preset})",
            n_samples=len(per_sample),
            n_grades=sum(len(gs) for gs in per_sample.values()),
            n_failed=sum(1 for k in keys if status.get(k) == "failed"),
            n_pending=sum(1 for k in keys if k not in status),
            stats=stats,
        ))
    summary.per_arch = per_arch


def _arch_order(group: tuple[str, str]) -> tuple[str, int, str]:
    """Presets alphabetically; within one, the study's architectures in its order, then any others by name."""
    preset, arch = group
    study = list(paper.TOTAL_PARAMS)
    return preset, study.index(arch) if arch in study else len(study), arch


def _chunks(items: Sequence[str], n: int) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def judge_all(
    db: sqlite_utils.Database,
    *,
    judge_model: str = DEFAULT_MODEL,
    concurrency: int = 8,
    repeats: int = 1,
    limit: int | None = None,
    run_ids: Sequence[str] | None = None,
    dry_run: bool = False,
    base_url: str | None = None,
    progress: bool = True,
    temperature: float = DEFAULT_TEMPERATURE,
    thinking_budget: int | None | str = AUTO,
    max_output_tokens: int | None = None,
    retry_failed: bool = True,
    max_attempts: int = 6,
    base_delay: float = 1.0,
    max_delay: float = 60.0,
    timeout_s: float = 120.0,
    prompt_path: str | os.PathLike | None = None,
    seed: int | None = None,
) -> JudgeSummary:
    """Grade the samples in `db` (all, those of `run_ids`, or the first `limit`) `repeats` times with `judge_model`.

    concurrency: requests in flight at most. thinking_budget: "auto" = 0 on the 2.5-flash models, the model's
    default elsewhere; None = never send one; an int = that budget. max_output_tokens None = 1024 with thinking off,
    8192 otherwise. retry_failed: regrade keys whose stored grade failed (True) or keep them (False).
    max_attempts / base_delay / max_delay (seconds): the retry policy for 429, 5xx and connection errors.
    base_url: the service root (default: $GOOGLE_GEMINI_BASE_URL, else Google's endpoint). seed: the jitter RNG.

    Raises JudgeError without an API key (unless dry_run) before any work, when there are no samples, and when the
    service refuses the job (bad key, no permission, unknown model) — after storing what was finished.
    """
    return asyncio.run(
        judge_all_async(
            db, judge_model=judge_model, concurrency=concurrency, repeats=repeats, limit=limit, run_ids=run_ids,
            dry_run=dry_run, base_url=base_url, progress=progress, temperature=temperature,
            thinking_budget=thinking_budget, max_output_tokens=max_output_tokens, retry_failed=retry_failed,
            max_attempts=max_attempts, base_delay=base_delay, max_delay=max_delay, timeout_s=timeout_s,
            prompt_path=prompt_path, seed=seed,
        )
    )
