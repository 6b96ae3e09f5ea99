"""What every judge backend shares: the answer's schema and its strict parser, the retry policy, and the job that
grades keys concurrently. The backends (`gemini.py`, `openai_chat.py`) only build a request, send it through their
SDK and read the answer; everything that decides what a grade is, how often to retry and how many requests fly at
once is here, once.

- Structured output: the pydantic `Grade` schema, or `AssessedGrade` — an `assessment` text first — under the
  `assess` protocol, sent as each backend's structured-output schema.
- At most `concurrency` requests in flight (an asyncio.Semaphore; neither SDK has a limit of its own).
- The SDKs' own retries are switched off; benchctl retries 429, 5xx and transport errors with exponential backoff
  and jitter, honouring the delay the server asks for (Gemini's RetryInfo `retryDelay`, a `Retry-After` header), up
  to `max_attempts` calls. Other 4xx fail the key at once; an invalid key, a refused permission, an unknown model or
  a setting the service rejects stop the whole job (`Job.refused`): every other request would fail the same way.
- The answer is parsed here, never through an SDK's own parsing (google-genai's `response.parsed` is silently None
  on bad JSON): blocked, refused, truncated, unparseable, incomplete or out-of-range answers become failures with
  the raw text and finish reason — never a score.
- Token usage is read per response; cost is estimated from a small price table (unknown judge -> None).

No SDK is imported here: a dry run and the summary never load one.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pydantic

CRITERIA = ("grammar", "creativity", "consistency", "plot")
SCORE_MIN, SCORE_MAX = 1, 10

# The json answer is ~25 tokens; an assessment adds a paragraph (~100–300 tokens), so its limit leaves several times
# that. Thinking tokens count towards the output limit, so leave room when thinking is on (or may be: a model of an
# OpenAI-compatible server may reason before it answers, and its reasoning counts towards the limit too).
MAX_OUTPUT_NO_THINKING = 1024
MAX_OUTPUT_ASSESS_NO_THINKING = 2048
MAX_OUTPUT_THINKING = 8192

# Dry-run estimate: current tokenizers (Gemini's, OpenAI's) take English at roughly 4 characters per token; the JSON
# answer is ~25–35 tokens, one with an assessment ~250.
CHARS_PER_TOKEN = 4.0
OUTPUT_TOKENS_ESTIMATE = 40
ASSESS_OUTPUT_TOKENS_ESTIMATE = 250

# USD per million tokens (input, output), keyed by the judge's stored name, so a price applies only to the service
# that charges it: the same model name served by a local server (openai:<model>@host) has no price.
# Gemini: paid tier, prompts up to 200k tokens (ai.google.dev/gemini-api/docs/pricing, 2025); the output price
# applies to candidates and thinking tokens alike. OpenAI: standard tier (openai.com/api/pricing, 2025); reasoning
# tokens are billed as output. Judges not listed have no cost estimate.
PRICES_USD_PER_M: dict[str, tuple[float, float]] = {
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-pro": (1.25, 10.00),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.0-flash-lite": (0.075, 0.30),
    "openai:gpt-4.1": (2.00, 8.00),
    "openai:gpt-4.1-mini": (0.40, 1.60),
    "openai:gpt-4.1-nano": (0.10, 0.40),
    "openai:gpt-4o": (2.50, 10.00),
    "openai:gpt-4o-mini": (0.15, 0.60),
}


class Grade(pydantic.BaseModel):
    """The judge's answer: four integer scores 1..10 (the structured-output schema sent to the judge)."""

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


def _bare_model(model: str) -> str:
    return model.removeprefix("models/")


def estimate_cost(model: str, prompt_tokens: int, output_tokens: int) -> float | None:
    """USD for `prompt_tokens` in and `output_tokens` out (candidates + thinking) of the judge stored as `model`;
    None for a judge not in the table."""
    price = PRICES_USD_PER_M.get(_bare_model(model))
    if price is None:
        return None
    return (prompt_tokens * price[0] + output_tokens * price[1]) / 1e6


@dataclass
class Usage:
    prompt_tokens: int = 0
    output_tokens: int = 0  # Gemini candidatesTokenCount; OpenAI completion_tokens less reasoning_tokens
    thinking_tokens: int = 0  # Gemini thoughtsTokenCount; OpenAI completion_tokens_details.reasoning_tokens
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


def parse_answer(
    text: str | None, problem: str | None = None, protocol: str = "json"
) -> tuple[Grade | AssessedGrade | None, str | None]:
    """(grade, None) for a complete, valid answer; (None, why) otherwise. `problem` is the backend's reason the
    answer did not end normally (blocked, refused, truncated), which fails it whatever the text. Under `assess` the
    answer must also carry a non-empty `assessment` string, and the grade returned is an AssessedGrade holding it."""
    if problem:
        return None, problem
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


def parse_grade(
    text: str | None, finish_reason: str | None, block_reason: str | None = None, protocol: str = "json"
) -> tuple[Grade | AssessedGrade | None, str | None]:
    """`parse_answer` for an answer in Gemini's terms: a prompt block reason, or a finish reason other than STOP
    (MAX_TOKENS: truncated), fails it."""
    return parse_answer(text, gemini_problem(finish_reason, block_reason), protocol)


def gemini_problem(finish_reason: str | None, block_reason: str | None) -> str | None:
    """Why a Gemini answer did not end normally, or None."""
    if block_reason:
        return f"blocked: promptFeedback.blockReason {block_reason}"
    if finish_reason == "MAX_TOKENS":
        return "truncated: finishReason MAX_TOKENS"
    if finish_reason not in (None, "STOP"):
        return f"blocked or stopped early: finishReason {finish_reason}"
    return None


# --------------------------------------------------------------------------------------------------------------------
# Retry policy.


def retryable(code: int | None) -> bool:
    """429 (rate limit / quota) and every 5xx; other 4xx would fail the same way again."""
    return code is not None and (code == 429 or 500 <= code < 600)


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds a response's headers ask the client to wait: `retry-after-ms` (OpenAI's), else `Retry-After` as
    seconds or as an HTTP date; None without either (or with one that cannot be read)."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.replace(".", "", 1).isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff_delay(attempt: int, base_delay: float, max_delay: float, rng: random.Random) -> float:
    """Exponential backoff with 'equal jitter': half of min(max, base * 2^(attempt-1)) fixed, half random."""
    cap = min(max_delay, base_delay * (2 ** (attempt - 1)))
    return cap / 2 + rng.uniform(0, cap / 2)


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
    request: dict[str, Any] = field(default_factory=dict)  # what was sent, as stored in judge_requests.request_json
    system_fingerprint: str | None = None  # the served model's revision, where the service reports one


@dataclass
class Settings:
    """One job's request settings and retry policy (the same for every key).

    `judge_model` is the name grades are stored and cached under (`JudgeSpec.name`); `model` the name sent to the
    service (the same for Gemini). `seed`: the judge's sampling seed; repeat k of every sample is sent seed + k, so a
    rerun asks for the same grades and repeats still differ. None: no seed sent."""

    judge_model: str
    prompt_hash: str
    temperature: float
    thinking_budget: int | None
    max_output_tokens: int
    max_attempts: int
    base_delay: float
    max_delay: float
    protocol: str = "json"
    backend: str = "gemini"
    model: str = ""
    endpoint: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            self.model = self.judge_model

    def seed_for(self, item: WorkItem) -> int | None:
        return self.seed_for_repeat(item.repeat)

    def seed_for_repeat(self, repeat: int) -> int | None:
        return None if self.seed is None else self.seed + repeat


@dataclass(frozen=True)
class Timeouts:
    """How long one call waits to connect, then for each read of the answer (seconds); the backends hand both to
    their HTTP client, so neither phase falls back to the other's limit."""

    connect_s: float
    read_s: float


@dataclass
class Answer:
    """What a backend read from one answered call (HTTP 200): the stored response, the answer's text, the finish
    reason as the service reported it, why the answer did not end normally (`problem`: blocked, refused, truncated —
    None if it did), the tokens, and the served model's fingerprint where the service reports one."""

    response_json: Any
    text: str | None
    finish_reason: str | None
    problem: str | None
    usage: Usage
    system_fingerprint: str | None = None


class CallFailed(Exception):
    """A call that produced no answer: an HTTP error, a body that is not JSON, a dropped connection.

    `retryable`: a passing fault (429, 5xx, transport), worth another call; `refuses_job`: every other request would
    fail the same way (bad key, unknown model, a setting the service rejects); `retry_delay`: seconds the server
    asked to wait, if it said."""

    def __init__(
        self,
        error: str,
        *,
        http_status: int | None = None,
        response_json: Any = None,
        retryable: bool,
        refuses_job: bool = False,
        retry_delay: float | None = None,
        unanswered: bool = False,
    ):
        super().__init__(error)
        self.error = error
        self.http_status = http_status
        self.response_json = response_json
        self.retryable = retryable
        self.refuses_job = refuses_job
        self.retry_delay = retry_delay
        self.unanswered = unanswered  # no HTTP response at all: refused, dropped or timed out on the wire


class Backend(Protocol):
    """One judge service, behind its SDK: what `Job` needs of it."""

    def request_record(self, item: WorkItem) -> dict[str, Any]:
        """What is sent for `item`, as stored in judge_requests.request_json."""
        ...

    async def send(self, item: WorkItem) -> Answer:
        """One call; raises CallFailed when the service gives no answer."""
        ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------------------------------------------------
# Grading one key, with retries.


# Calls without any answer, before the first answered one, after which a job stops (see Job._count): enough that one
# dropped connection on a flaky network does not end a job, few enough that a dead service costs a few timeouts in
# all rather than every key's attempts.
UNANSWERED_CALLS = 3


class Job:
    """Grades keys through one backend with a concurrency limit, retry policy and jitter RNG; counts the calls."""

    def __init__(self, backend: Backend, s: Settings, concurrency: int, seed: int | None):
        self.backend = backend
        self.s = s
        self.sem = asyncio.Semaphore(concurrency)
        self.refused: str | None = None  # set when the service refuses the whole job
        self.unreachable: str | None = None  # set when no call of the job has had any answer, UNANSWERED_CALLS times
        self.answered = False  # some call got an HTTP response (any status): the service is there
        self.n_unanswered = 0
        self.n_requests = 0
        self.rng = random.Random(seed)

    async def grade(self, item: WorkItem) -> Outcome | None:
        """All attempts for one key; None if the job was refused before this key was sent."""
        async with self.sem:  # at most `concurrency` keys (hence HTTP requests) in flight
            out = Outcome(item, None, None, request=self.backend.request_record(item))
            started = time.monotonic()
            while True:
                if self.refused is not None or self.unreachable is not None:
                    return out if out.attempts else None
                out.attempts += 1
                self.n_requests += 1
                delay: float | None = None
                try:
                    answer = await self.backend.send(item)
                except CallFailed as f:
                    out.http_status, out.response_json, out.error = f.http_status, f.response_json, f.error
                    self._count(f)
                    if self.unreachable is not None:
                        out.error = (
                            f"gave up after {out.attempts} attempts: the service answered none of the job's "
                            f"{self.n_unanswered} calls; last: {out.error}"
                        )
                        break
                    if not f.retryable:
                        if f.refuses_job:
                            self.refused = out.error
                        break  # other 4xx: retrying cannot help
                    delay = f.retry_delay
                    if delay is not None:
                        delay += self.rng.uniform(0, 0.1 * delay)  # spread the herd a little beyond the hint
                else:
                    self.answered = True
                    _read_answer(out, answer, self.s.protocol)
                    break
                if out.attempts >= self.s.max_attempts:
                    out.error = f"gave up after {out.attempts} attempts; last: {out.error}"
                    break
                if delay is None:
                    delay = backoff_delay(out.attempts, self.s.base_delay, self.s.max_delay, self.rng)
                await asyncio.sleep(delay)
            out.latency_s = time.monotonic() - started
            return out

    def _count(self, f: CallFailed) -> None:
        """A service that has not answered one call of this job, UNANSWERED_CALLS times over (a dead host, one that
        accepts and never answers, a wrong --base-url), stops the job: retrying every key against it would cost
        each key all its attempts of connect or read timeout. Once any call was answered, the service is there and
        a call without an answer is a passing fault, retried as usual."""
        if not f.unanswered:
            self.answered = True
            return
        self.n_unanswered += 1
        if not self.answered and self.n_unanswered >= UNANSWERED_CALLS:
            self.unreachable = f.error


def _read_answer(out: Outcome, answer: Answer, protocol: str) -> None:
    """Fill `out` from an answered call: the stored response, its tokens, and the grade or why there is none."""
    out.http_status = 200
    out.response_json = answer.response_json
    out.usage = answer.usage
    out.billed += answer.usage
    out.raw_text, out.finish_reason = answer.text, answer.finish_reason
    out.system_fingerprint = answer.system_fingerprint
    out.grade, out.error = parse_answer(answer.text, answer.problem, protocol)
