"""The Gemini backend: the API key, the request, the errors and the answer in google-genai's terms.

- google-genai's async client (`client.aio.models.generate_content`) with structured output (the answer's pydantic
  schema as `response_schema`), temperature, the sampling seed, and a thinking budget where the model allows one.
- Requests go through an httpx client of benchctl's own, not the stack the SDK would pick (aiohttp where it is
  installed, else httpx): its transport sets the connect and read timeouts apart, which the SDK's single timeout
  cannot, and every install reads errors the same way (an HTML error page keeps its HTTP status).
- The SDK's own retries are switched off (`HttpRetryOptions(attempts=1)` also disables its implicit retry on
  connection errors); the shared job (client.Job) retries, honouring the server's RetryInfo `retryDelay` (which the
  SDK does not). An invalid key, a refused permission or an unknown model refuse the whole job.
- An answer fails when the prompt was blocked (promptFeedback.blockReason), truncated (finishReason MAX_TOKENS) or
  stopped for any other reason than STOP; its text is then parsed by the shared strict parser.

Only loaded when a request is built: a dry run and the summary never import google-genai.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

import httpx
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from benchctl.core.errors import JudgeError
from benchctl.stages.judge.client import (
    Answer,
    CallFailed,
    Settings,
    Timeouts,
    Usage,
    WorkItem,
    answer_schema,
    gemini_problem,
    retry_after,
    retryable,
)
from benchctl.stages.judge.judges import GEMINI_KEY_VARS, JudgeSpec, check_key_transport

API_KEY_VARS = GEMINI_KEY_VARS


# --------------------------------------------------------------------------------------------------------------------
# Keys and settings.


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


def _key_var() -> str:
    """The variable the key was read from, as the refusal to send it names it."""
    return next((var for var in API_KEY_VARS if os.environ.get(var, "").strip()), API_KEY_VARS[0])


def has_key(spec: JudgeSpec) -> bool:
    return has_api_key()


def require_key(spec: JudgeSpec, allow_insecure_key: bool = False) -> str:
    """The key, sent with every request (whatever the base URL: a proxy or gateway gets it too), so over https or to
    this machine only unless the user allows otherwise."""
    key = require_api_key()
    check_key_transport(spec, _key_var(), allow_insecure_key)
    return key


def refused_hint(spec: JudgeSpec) -> str:
    """What to check when the service refuses the whole job."""
    return f"check the key in GEMINI_API_KEY / GOOGLE_API_KEY and the model name '{spec.model}'"


# --------------------------------------------------------------------------------------------------------------------
# Reading an answer.


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


def _answer(resp: Any) -> Answer:
    text, finish, block = _response_text(resp)
    return Answer(
        response_json=resp.model_dump(
            mode="json",
            exclude_none=True,
            exclude={"sdk_http_response", "automatic_function_calling_history", "parsed"},
        ),
        text=text,
        finish_reason=finish,
        problem=gemini_problem(finish, block),
        usage=_usage(resp),
        # Gemini reports the model's version (modelVersion), not a fingerprint: a revision of the same sort
        system_fingerprint=getattr(resp, "model_version", None),
    )


# --------------------------------------------------------------------------------------------------------------------
# Errors.


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
    return retry_after(getattr(getattr(error, "response", None), "headers", None))


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
# The request.


def request_record(item: WorkItem, s: Settings) -> dict[str, Any]:
    """What is sent, as stored in judge_requests.request_json (the SDK turns it into the REST body).

    Mirrors `_gen_config`: the two must change together.
    """
    return {
        "model": s.model,
        "contents": item.prompt,
        "generation_config": {
            "temperature": s.temperature,
            "seed": s.seed_for(item),
            "max_output_tokens": s.max_output_tokens,
            "thinking_budget": s.thinking_budget,
            "response_mime_type": "application/json",
            "response_schema": answer_schema(s.protocol).model_json_schema(),
        },
    }


def _gen_config(s: Settings, item: WorkItem) -> Any:
    thinking = None if s.thinking_budget is None else types.ThinkingConfig(thinking_budget=s.thinking_budget)
    return types.GenerateContentConfig(
        response_mime_type="application/json",
        response_schema=answer_schema(s.protocol),
        temperature=s.temperature,
        seed=s.seed_for(item),
        max_output_tokens=s.max_output_tokens,
        thinking_config=thinking,
    )


class _Timeouts(httpx.AsyncBaseTransport):
    """An HTTP transport that gives every request benchctl's connect and read timeouts. google-genai gives a request
    one number for every phase (its `timeout`), so without this a host that never accepts would hold each attempt as
    long as the slowest answer may take."""

    def __init__(self, timeouts: Timeouts):
        self.inner = httpx.AsyncHTTPTransport()
        self.timeout = httpx.Timeout(timeouts.read_s, connect=timeouts.connect_s).as_dict()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions = {**request.extensions, "timeout": self.timeout}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_client(key: str, base_url: str | None, http: httpx.AsyncClient, timeouts: Timeouts) -> Any:
    http_options = types.HttpOptions(
        base_url=base_url,  # None -> the SDK uses $GOOGLE_GEMINI_BASE_URL, else the public endpoint
        # milliseconds; the SDK also tells the server (X-Server-Timeout) how long the client waits for the answer
        timeout=int(timeouts.read_s * 1000),
        # attempts=1: no SDK retries at all (with retry_options unset the SDK still retries connection errors
        # once after a 1–10 s sleep); benchctl owns the retry policy.
        retry_options=types.HttpRetryOptions(attempts=1),
        httpx_async_client=http,  # ours: its transport sets the connect and read timeouts apart
    )
    return genai.Client(api_key=key, http_options=http_options)


class GeminiBackend:
    """The Gemini API behind google-genai's async client (one per job)."""

    def __init__(self, spec: JudgeSpec, key: str, s: Settings, timeouts: Timeouts):
        self.s = s
        self.http = httpx.AsyncClient(transport=_Timeouts(timeouts))
        self.client = make_client(key, spec.base_url, self.http, timeouts)
        self.transport_errors = _transport_errors()

    def request_record(self, item: WorkItem) -> dict[str, Any]:
        return request_record(item, self.s)

    async def send(self, item: WorkItem) -> Answer:
        try:
            resp = await self.client.aio.models.generate_content(
                model=self.s.model, contents=item.prompt, config=_gen_config(self.s, item)
            )
        except genai_errors.APIError as e:
            error = f"HTTP {e.code} {e.status or ''}: {e.message or ''}".strip()
            ok_to_retry = retryable(e.code)
            raise CallFailed(
                error,
                http_status=e.code,
                response_json=e.details,
                retryable=ok_to_retry,
                refuses_job=not ok_to_retry and _refuses_job(e.code or 0, e.message or ""),
                retry_delay=server_retry_delay(e) if ok_to_retry else None,
            ) from None
        except self.transport_errors as e:
            raise CallFailed(
                f"connection error: {type(e).__name__}: {e}".strip(), retryable=True, unanswered=True
            ) from None
        except json.JSONDecodeError as e:
            # a body labelled JSON that is not (a proxy's or gateway's HTML error page, whatever its status): the
            # client cannot even read the status out of it; a passing fault, retried, else a failed grade
            raise CallFailed(
                f"the service answered with a body that is not JSON ({e.msg} at character {e.pos})", retryable=True
            ) from None
        return _answer(resp)

    async def aclose(self) -> None:
        await self.client.aio.aclose()
        await self.http.aclose()  # the SDK leaves a client it was given to its owner


def make_backend(spec: JudgeSpec, key: str, s: Settings, timeouts: Timeouts) -> GeminiBackend:
    return GeminiBackend(spec, key, s, timeouts)
