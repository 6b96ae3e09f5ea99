"""Talking to Gemini: the API key, the request, the retry policy, and reading the answer into a `Grade`.

- google-genai's async client (`client.aio.models.generate_content`) with structured output (the pydantic `Grade`
  schema, or `AssessedGrade` — an `assessment` text first — under the `assess` protocol), at most `concurrency`
  requests in flight (an asyncio.Semaphore; the SDK has no limit of its own).
- The SDK's own retries are switched off (`HttpRetryOptions(attempts=1)` also disables its implicit retry on
  connection errors); benchctl retries 429, 5xx and transport errors with exponential backoff and jitter, honouring
  the server's RetryInfo `retryDelay` (which the SDK does not), up to `max_attempts` calls. Other 4xx fail the key at
  once; an invalid key, a refused permission or an unknown model stop the whole job (`Job.refused`).
- The answer is parsed here, not through `response.parsed` (silently None on bad JSON): unparseable, truncated
  (finishReason MAX_TOKENS), blocked (promptFeedback.blockReason or a non-STOP finish reason), incomplete or
  out-of-range answers become failures with the raw text and finish reason — never a score.
- Token usage is read per response; cost is estimated from a small price table (unknown model -> None).

The google-genai SDK is imported only when a request is built, so a dry run and the summary never load it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pydantic
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from benchctl.core.errors import JudgeError

CRITERIA = ("grammar", "creativity", "consistency", "plot")
SCORE_MIN, SCORE_MAX = 1, 10

API_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
# Thinking: off (budget 0) on the models that allow turning it off; other models keep their default (not sent).
# The budget actually sent is stored with every request.
_THINKING_OFF_MODELS = ("gemini-2.5-flash", "gemini-2.5-flash-lite")

# The json answer is ~25 tokens; an assessment adds a paragraph (~100–300 tokens), so its limit leaves several times
# that. Thinking tokens count towards the output limit, so leave room when thinking is on.
MAX_OUTPUT_NO_THINKING = 1024
MAX_OUTPUT_ASSESS_NO_THINKING = 2048
MAX_OUTPUT_THINKING = 8192

# Dry-run estimate: Gemini tokenizes English at roughly 4 characters per token; the JSON answer is ~25–35 tokens,
# one with an assessment ~250.
CHARS_PER_TOKEN = 4.0
OUTPUT_TOKENS_ESTIMATE = 40
ASSESS_OUTPUT_TOKENS_ESTIMATE = 250

# USD per million tokens, paid tier, prompts up to 200k tokens (ai.google.dev/gemini-api/docs/pricing, 2025).
# Output price applies to candidates and thinking tokens alike. Models not listed have no cost estimate.
PRICES_USD_PER_M: dict[str, tuple[float, float]] = {
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-pro": (1.25, 10.00),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.0-flash-lite": (0.075, 0.30),
}


class Grade(pydantic.BaseModel):
    """The judge's answer: four integer scores 1..10 (the structured-output schema sent to Gemini)."""

    grammar: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    creativity: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    consistency: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    plot: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)

    @property
    def average(self) -> float:
        return (self.grammar + self.creativity + self.consistency + self.plot) / 4


class AssessedGrade(pydantic.BaseModel):
    """The `assess` protocol's answer: the general assessment first (so it is written before the grades — field
    order is generation order in structured output), then the same four scores."""

    assessment: str = pydantic.Field(min_length=1)
    grammar: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    creativity: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    consistency: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)
    plot: int = pydantic.Field(ge=SCORE_MIN, le=SCORE_MAX)

    @property
    def average(self) -> float:
        return (self.grammar + self.creativity + self.consistency + self.plot) / 4


def answer_schema(protocol: str) -> type[pydantic.BaseModel]:
    """The structured-output schema of a protocol."""
    return AssessedGrade if protocol == "assess" else Grade


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
    text: str | None, finish_reason: str | None, block_reason: str | None = None, protocol: str = "json"
) -> tuple[Grade | AssessedGrade | None, str | None]:
    """(grade, None) for a complete, valid answer; (None, why) otherwise. Under `assess` the answer must also carry
    a non-empty `assessment` string, and the grade returned is an AssessedGrade holding it."""
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
    if protocol == "assess":
        text_ = obj.get("assessment")
        if not isinstance(text_, str) or not text_.strip():
            problems.insert(0, "no assessment" if text_ is None else f"assessment={text_!r} is not a non-empty text")
    if problems:
        return None, "; ".join(problems)
    if protocol == "assess":
        return AssessedGrade(assessment=obj["assessment"].strip(), **{c: obj[c] for c in CRITERIA}), None
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


def _retryable(code: int | None) -> bool:
    """429 (rate limit / quota) and every 5xx; other 4xx would fail the same way again."""
    return code is not None and (code == 429 or 500 <= code < 600)


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
        import aiohttp  # optional: one of the HTTP stacks the SDK may use

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
# Work items, settings and results.


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
    grade: Grade | AssessedGrade | None
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
class Settings:
    """One job's request settings and retry policy (the same for every key)."""

    judge_model: str
    prompt_hash: str
    temperature: float
    thinking_budget: int | None
    max_output_tokens: int
    max_attempts: int
    base_delay: float
    max_delay: float
    protocol: str = "json"


def request_record(item: WorkItem, s: Settings) -> dict[str, Any]:
    """What is sent, as stored in judge_requests.request_json (the SDK turns it into the REST body).

    Mirrors `_gen_config`: the two must change together.
    """
    return {
        "model": s.judge_model,
        "contents": item.prompt,
        "generation_config": {
            "temperature": s.temperature,
            "max_output_tokens": s.max_output_tokens,
            "thinking_budget": s.thinking_budget,
            "response_mime_type": "application/json",
            "response_schema": answer_schema(s.protocol).model_json_schema(),
        },
    }


def _gen_config(s: Settings) -> Any:
    thinking = None if s.thinking_budget is None else types.ThinkingConfig(thinking_budget=s.thinking_budget)
    return types.GenerateContentConfig(
        response_mime_type="application/json",
        response_schema=answer_schema(s.protocol),
        temperature=s.temperature,
        max_output_tokens=s.max_output_tokens,
        thinking_config=thinking,
    )


def make_client(key: str, base_url: str | None, timeout_s: float) -> Any:
    http_options = types.HttpOptions(
        base_url=base_url,  # None -> the SDK uses $GOOGLE_GEMINI_BASE_URL, else the public endpoint
        timeout=int(timeout_s * 1000),  # milliseconds
        # attempts=1: no SDK retries at all (with retry_options unset the SDK still retries connection errors
        # once after a 1–10 s sleep); benchctl owns the retry policy.
        retry_options=types.HttpRetryOptions(attempts=1),
    )
    return genai.Client(api_key=key, http_options=http_options)


# --------------------------------------------------------------------------------------------------------------------
# Grading one key, with retries.


class Job:
    """Grades keys with a shared client, concurrency limit, retry policy and jitter RNG; counts the calls made."""

    def __init__(self, aclient: Any, s: Settings, concurrency: int, seed: int | None):
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
                    if not _retryable(e.code):
                        if _refuses_job(e.code or 0, e.message or ""):
                            self.refused = out.error
                        break  # other 4xx: retrying cannot help
                    delay = server_retry_delay(e)
                    if delay is not None:
                        delay += self.rng.uniform(0, 0.1 * delay)  # spread the herd a little beyond the hint
                except self.transport_errors as e:
                    out.http_status, out.response_json = None, None
                    out.error = f"connection error: {type(e).__name__}: {e}".strip()
                except json.JSONDecodeError as e:
                    # a body labelled JSON that is not (a proxy's or gateway's HTML error page, whatever its status):
                    # the client cannot even read the status out of it; a passing fault, retried, else a failed grade
                    out.http_status, out.response_json = None, None
                    out.error = f"the service answered with a body that is not JSON ({e.msg} at character {e.pos})"
                else:
                    _read_answer(out, resp, self.s.protocol)
                    break
                if out.attempts >= self.s.max_attempts:
                    out.error = f"gave up after {out.attempts} attempts; last: {out.error}"
                    break
                if delay is None:
                    delay = backoff_delay(out.attempts, self.s.base_delay, self.s.max_delay, self.rng)
                await asyncio.sleep(delay)
            out.latency_s = time.monotonic() - started
            return out


def _read_answer(out: Outcome, resp: Any, protocol: str) -> None:
    """Fill `out` from an answered call: the stored response, its tokens, and the grade or why there is none."""
    out.http_status = 200
    out.response_json = resp.model_dump(
        mode="json",
        exclude_none=True,
        exclude={"sdk_http_response", "automatic_function_calling_history", "parsed"},
    )
    out.usage = _usage(resp)
    out.billed += out.usage
    out.raw_text, out.finish_reason, block = _response_text(resp)
    out.grade, out.error = parse_grade(out.raw_text, out.finish_reason, block, protocol)
