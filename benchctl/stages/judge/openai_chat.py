"""The OpenAI-compatible backend: any server of the chat-completions protocol, through the official `openai` SDK.

OpenAI itself, and vLLM, SGLang, Ollama, llama.cpp's server, LM Studio or a hosted provider at another base URL.
The request is one user message (the filled grading prompt) with the answer's schema as
`response_format: {"type": "json_schema", ...}` (strict), the temperature, the sampling seed and an output limit
(`max_completion_tokens` for OpenAI's own service, which wants it; `max_tokens` elsewhere, which every compatible
server reads). A server that ignores `response_format` is fine as long as its model follows the prompt, which asks
for the same JSON: its text goes through the same strict parser.

- The SDK's own retries are off (`max_retries=0`); the shared job retries 429, 5xx, connection errors and a body
  that is not JSON, honouring `retry-after-ms` / `Retry-After`. 401, 403, 404 (unknown model) and a 400 naming one
  of the request's settings (a temperature or seed the model does not take, a schema it cannot follow) refuse the
  whole job: every other request would fail the same way.
- An answer fails when the model refused (`message.refusal`; the refusal is stored as the raw text), was cut off
  (`finish_reason` "length"), filtered ("content_filter") or called a tool, and when the body is not a chat
  completion at all; otherwise its text is parsed strictly.
- Tokens: `completion_tokens` less `completion_tokens_details.reasoning_tokens` as output, the reasoning tokens as
  thinking tokens (both billed as output). `system_fingerprint` is stored where the server reports one.

The key is OPENAI_API_KEY: required for OpenAI's own service; for another base URL it is sent if set (a hosted
provider needs its key there) and a placeholder otherwise (a local server checks none; the SDK insists on one). A
real key is sent over https or to this machine only, unless the user allows otherwise (`judges.check_key_transport`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from benchctl.core.errors import JudgeError
from benchctl.stages.judge.client import (
    Answer,
    CallFailed,
    Settings,
    Timeouts,
    Usage,
    WorkItem,
    answer_schema,
    retry_after,
    retryable,
)
from benchctl.stages.judge.judges import OPENAI_KEY_VAR, JudgeSpec, check_key_transport

NO_KEY = "not-needed"  # sent to a server at another base URL when OPENAI_API_KEY is not set
# Request fields that are the same in every request: a 400 naming one of them would fail every other request too.
_SETTINGS = {"model", "temperature", "seed", "max_tokens", "max_completion_tokens", "response_format"}
_JOB_CODES = {"unsupported_parameter", "unsupported_value", "invalid_api_key", "model_not_found"}
# Finish reasons of an answer that did not end as an answer: cut off, filtered, or a tool call instead of text.
_PROBLEMS = {
    "length": "truncated: finish_reason length",
    "content_filter": "blocked: finish_reason content_filter",
    "tool_calls": "not an answer: finish_reason tool_calls",
    "function_call": "not an answer: finish_reason function_call",
}


# --------------------------------------------------------------------------------------------------------------------
# Keys.


def api_key() -> str | None:
    value = os.environ.get(OPENAI_KEY_VAR, "").strip()
    return value or None


def has_key(spec: JudgeSpec) -> bool:
    """True when a job can be sent: a key is set, or the server is not OpenAI's own (which needs none of ours)."""
    return api_key() is not None or not spec.official


def require_key(spec: JudgeSpec, allow_insecure_key: bool = False) -> str:
    key = api_key()
    if key is not None:
        check_key_transport(spec, OPENAI_KEY_VAR, allow_insecure_key)
        return key
    if not spec.official:
        return NO_KEY
    raise JudgeError(
        f"no OpenAI API key: set {OPENAI_KEY_VAR} to a key from https://platform.openai.com/api-keys, pass "
        "--base-url for another OpenAI-compatible server, or use --dry-run to count requests without sending any"
    )


def refused_hint(spec: JudgeSpec) -> str:
    """What to check when the service refuses the whole job."""
    where = "OpenAI" if spec.official else f"the server at {spec.endpoint}"
    return f"check {OPENAI_KEY_VAR} (the key {where} expects), the model name '{spec.model}' and the settings sent"


# --------------------------------------------------------------------------------------------------------------------
# The request.


def json_schema(protocol: str) -> dict[str, Any]:
    """The answer's schema in the form strict structured output takes: every field required, no other field, and
    only keywords it supports (a string's minLength is not one; the parser checks the assessment is not empty)."""
    schema = answer_schema(protocol).model_json_schema()
    props = schema["properties"]
    for prop in props.values():
        prop.pop("minLength", None)
    schema["required"] = list(props)
    schema["additionalProperties"] = False
    return schema


def request_body(item: WorkItem, s: Settings, official: bool) -> dict[str, Any]:
    """The chat-completions request for `item`, as sent and as stored in judge_requests.request_json."""
    schema = {"name": answer_schema(s.protocol).__name__, "schema": json_schema(s.protocol), "strict": True}
    body: dict[str, Any] = {
        "model": s.model,
        "messages": [{"role": "user", "content": item.prompt}],
        "temperature": s.temperature,
        ("max_completion_tokens" if official else "max_tokens"): s.max_output_tokens,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    seed = s.seed_for(item)
    if seed is not None:
        body["seed"] = seed
    return body


# --------------------------------------------------------------------------------------------------------------------
# Errors and answers.


def _error_body(e: openai.APIStatusError) -> Any:
    """The error response as the server sent it: its JSON, else its text."""
    try:
        return e.response.json()
    except (ValueError, UnicodeDecodeError):
        return e.response.text


def _failed(e: openai.APIStatusError) -> CallFailed:
    status = e.status_code
    body = e.body if isinstance(e.body, dict) else {}
    message = body.get("message") if isinstance(body.get("message"), str) else None
    if message is None:  # not an error object: an HTML page or plain text, shown cut short
        text = e.body if isinstance(e.body, str) else ""
        message = " ".join(text.split())[:200] or "no message"
    ok_to_retry = retryable(status)
    refuses = status in (401, 403, 404) or (
        status == 400 and (body.get("param") in _SETTINGS or body.get("code") in _JOB_CODES)
    )
    return CallFailed(
        f"HTTP {status}: {message}",
        http_status=status,
        response_json=_error_body(e),
        retryable=ok_to_retry,
        refuses_job=not ok_to_retry and refuses,
        retry_delay=retry_after(e.response.headers) if ok_to_retry else None,
    )


def _usage(resp: Any) -> Usage:
    u = getattr(resp, "usage", None)
    if u is None:
        return Usage()
    completion = u.completion_tokens or 0
    details = getattr(u, "completion_tokens_details", None)
    reasoning = (getattr(details, "reasoning_tokens", None) or 0) if details is not None else 0
    return Usage(
        prompt_tokens=u.prompt_tokens or 0,
        output_tokens=max(0, completion - reasoning),
        thinking_tokens=reasoning,
        total_tokens=u.total_tokens or 0,
    )


def read_answer(resp: Any) -> Answer:
    """The answer of a 200 response, whatever the server put in it."""
    if not isinstance(resp, ChatCompletion):  # JSON, but not an object: nothing to read
        return Answer(resp, None, None, f"not a chat completion: the body is JSON {type(resp).__name__}", Usage())
    stored = resp.model_dump(mode="json", exclude_none=True)
    fingerprint = getattr(resp, "system_fingerprint", None)
    if not resp.choices:
        return Answer(stored, None, None, "not a chat completion: no choices", _usage(resp), fingerprint)
    choice = resp.choices[0]
    message = getattr(choice, "message", None)
    content = getattr(message, "content", None)
    refusal = getattr(message, "refusal", None)
    finish = getattr(choice, "finish_reason", None)
    problem = f"refused: {refusal}" if refusal else _PROBLEMS.get(str(finish)) if finish is not None else None
    text = content if content is not None else refusal
    return Answer(stored, text, finish, problem, _usage(resp), fingerprint)


class OpenAIBackend:
    """A chat-completions server behind the openai SDK's async client (one per job)."""

    def __init__(self, spec: JudgeSpec, key: str, s: Settings, timeouts: Timeouts):
        self.s = s
        self.official = spec.official
        # read (and write, and waiting for a pooled connection) limited by read_s, connecting by connect_s; the
        # SDK's own Timeout, which is httpx's or its fork's, whichever HTTP library this openai release is built on
        timeout = openai.Timeout(timeouts.read_s, connect=timeouts.connect_s)
        # max_retries=0: benchctl owns the retry policy (the SDK's own would retry behind its back and hide calls)
        self.client = openai.AsyncOpenAI(api_key=key, base_url=spec.base_url, timeout=timeout, max_retries=0)

    def request_record(self, item: WorkItem) -> dict[str, Any]:
        return request_body(item, self.s, self.official)

    async def send(self, item: WorkItem) -> Answer:
        try:
            resp = await self.client.chat.completions.create(**self.request_record(item))
        except openai.APIStatusError as e:
            raise _failed(e) from None
        except openai.APIConnectionError as e:  # refused, dropped, timed out
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            raise CallFailed(
                f"connection error: {type(e).__name__}: {e}{cause}", retryable=True, unanswered=True
            ) from None
        except json.JSONDecodeError as e:
            # a body that is not JSON on a success status (a proxy's page, a server that crashed mid-answer): no
            # answer was read; a passing fault, retried, else a failed grade
            raise CallFailed(
                f"the service answered with a body that is not JSON ({e.msg} at character {e.pos})", retryable=True
            ) from None
        return read_answer(resp)

    async def aclose(self) -> None:
        await self.client.close()


def make_backend(spec: JudgeSpec, key: str, s: Settings, timeouts: Timeouts) -> OpenAIBackend:
    return OpenAIBackend(spec, key, s, timeouts)
