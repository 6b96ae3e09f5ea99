"""A local HTTP server that speaks the OpenAI chat-completions protocol, for tests without the internet.

The real `openai` client is pointed at it (`base_url=server.url`, which ends in `/v1` as vLLM's, Ollama's and
OpenAI's own do). It answers `POST /v1/chat/completions`, checks `Authorization: Bearer <key>` when it is given a key
(a wrong or missing key gets 401 `invalid_api_key`, as OpenAI answers; a server started without a key accepts any, as
a local vLLM or Ollama does), and replies with a `chat.completion` object:

    {"id": "chatcmpl-1", "object": "chat.completion", "created": 1764000000, "model": "...",
     "system_fingerprint": "fp_fake0001",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "...", "refusal": null},
                  "finish_reason": "stop", "logprobs": null}],
     "usage": {"prompt_tokens": 180, "completion_tokens": 24, "total_tokens": 204,
               "completion_tokens_details": {"reasoning_tokens": 0}}}

Errors use OpenAI's shape: `{"error": {"message": "...", "type": "...", "param": null, "code": "..."}}`, with a
`Retry-After` header when a delay is given.

Scripting as in fake_gemini: each request takes the next `Reply` from a queue (`server.push(...)`), else asks
`script(request)`, else answers with `default_grade` (deterministic scores from the prompt's hash, after a short
assessment when the request's json_schema has an `assessment` field, or the prompt asks for one). With
`honour_response_format=False` the server ignores `response_format` the way a server without structured output
does: the default answer then follows only the prompt's wording (`answer_style`: plain JSON, or JSON in a markdown
fence as chat models often write it).
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from fake_gemini import Reply, _Server  # the same reply script and threaded server

__all__ = ["FakeOpenAI", "Reply", "Request"]

_PATH = re.compile(r"^/v1/chat/completions$")
FINGERPRINT = "fp_fake0001"


@dataclass
class Request:
    """One request as the server saw it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    received_at: float

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))

    @property
    def prompt(self) -> str:
        """The text of the user messages, joined."""
        out = []
        for m in self.body.get("messages", []):
            if m.get("role") == "user":
                c = m.get("content")
                out.append(c if isinstance(c, str) else "".join(p.get("text", "") for p in c or []))
        return "".join(out)

    @property
    def json_schema(self) -> dict[str, Any] | None:
        rf = self.body.get("response_format") or {}
        return (rf.get("json_schema") or {}).get("schema") if rf.get("type") == "json_schema" else None

    @property
    def wants_assessment(self) -> bool:
        schema = self.json_schema
        if schema is not None:
            return "assessment" in (schema.get("properties") or {})
        return '"assessment"' in self.prompt  # without a schema, the prompt's wording says what to write


def completion(
    content: str | None,
    *,
    finish_reason: str | None = "stop",
    refusal: str | None = None,
    prompt_tokens: int = 180,
    completion_tokens: int = 24,
    reasoning_tokens: int = 0,
    fingerprint: str | None = FINGERPRINT,
    model: str = "fake-model",
    delay: float = 0.0,
) -> Reply:
    """A 200 answer whose single choice says `content` (or refuses with `refusal`)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1764000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        },
    }
    if fingerprint is not None:
        body["system_fingerprint"] = fingerprint
    return Reply(200, body, delay=delay)


def grade(grammar: Any = 7, creativity: Any = 6, consistency: Any = 5, plot: Any = 4, **kw: Any) -> Reply:
    obj = {"grammar": grammar, "creativity": creativity, "consistency": consistency, "plot": plot}
    return completion(json.dumps(obj), **kw)


def assessed(assessment: Any = "A simple story with a clear ending.", *scores: Any, **kw: Any) -> Reply:
    g, c, k, p = scores or (7, 6, 5, 4)
    obj = {"assessment": assessment, "grammar": g, "creativity": c, "consistency": k, "plot": p}
    return completion(json.dumps(obj), **{"completion_tokens": 90, **kw})


def error(
    status: int, message: str, type_: str, code: str | None = None, *, param: str | None = None, retry_after=None
) -> Reply:
    """An error in OpenAI's shape, with a Retry-After header (seconds) when `retry_after` is given."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return Reply(status, body, headers=headers)


def rate_limited(retry_after: float | str | None = 0.3) -> Reply:
    return error(429, "Rate limit reached for requests.", "requests", "rate_limit_exceeded", retry_after=retry_after)


def server_error(status: int = 500) -> Reply:
    return error(status, "The server had an error while processing your request.", "server_error")


def _scores(request: Request) -> tuple[int, int, int, int]:
    h = hashlib.sha256(request.prompt.encode()).digest()
    g, c, k, p = (1 + b % 10 for b in h[:4])
    return g, c, k, p


def default_grade(request: Request) -> Reply:
    """Deterministic, valid scores derived from the prompt (the same as fake_gemini's for the same prompt)."""
    g, c, k, p = _scores(request)
    if request.wants_assessment:
        h = hashlib.sha256(request.prompt.encode()).digest()[:4].hex()
        return assessed(f"Assessment {h}: grammar {g}, creativity {c}, consistency {k}, plot {p}.", g, c, k, p)
    return grade(g, c, k, p)


class FakeOpenAI:
    """Threaded chat-completions server on 127.0.0.1 (a free port). Use as a context manager or call close()."""

    def __init__(
        self,
        script: Callable[[Request], Reply] | None = None,
        *,
        api_key: str | None = None,
        honour_response_format: bool = True,
        answer_style: str = "plain",  # without response_format: "plain" JSON or "fenced" in ```json ... ```
        latency: float = 0.0,
        port: int = 0,
        bind: str = "127.0.0.1",  # another of this machine's addresses: a server reached by a name, not 127.0.0.1
    ):
        self.script = script
        self.api_key = api_key
        self.honour_response_format = honour_response_format
        self.answer_style = answer_style
        self.latency = latency
        self.requests: list[Request] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._queue: collections.deque[Reply] = collections.deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd = _Server((bind, port), self._handler_class())
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}/v1"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_port}"

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def push(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    def close(self) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _next_reply(self, request: Request) -> Reply:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        if self.script is not None:
            return self.script(request)
        reply = default_grade(request)
        if not self.honour_response_format and self.answer_style == "fenced":
            body = reply.body
            assert isinstance(body, dict)
            message = body["choices"][0]["message"]
            message["content"] = f"Here are my grades:\n```json\n{message['content']}\n```"
        return reply

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def _send(self, status: int, body: dict[str, Any] | str | None, headers: dict[str, str]) -> None:
                data = (body if isinstance(body, str) else json.dumps(body or {})).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not _PATH.match(self.path.split("?", 1)[0]):
                    body = {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}}
                    self._send(404, body, {})
                    return
                request = Request(
                    path=self.path,
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=json.loads(raw or b"{}"),
                    received_at=time.monotonic(),
                )
                with server._lock:
                    server.requests.append(request)
                    server._in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server._in_flight)
                try:
                    self._answer(request)
                finally:
                    with server._lock:
                        server._in_flight -= 1

            def _answer(self, request: Request) -> None:
                if server.api_key is not None and request.headers.get("authorization") != f"Bearer {server.api_key}":
                    msg = "Incorrect API key provided. You can find your API key at https://platform.openai.com."
                    self._send(401, error(401, msg, "invalid_request_error", "invalid_api_key").body, {})
                    return
                reply = server._next_reply(request)
                wait = server.latency + reply.delay
                if wait:
                    server._closing.wait(wait)
                if reply.hang is not None:
                    while not (reply.hang.is_set() or server._closing.is_set()):
                        reply.hang.wait(0.05)
                    self.close_connection = True
                    return
                if reply.drop:
                    self.close_connection = True
                    return
                self._send(reply.status, reply.body, reply.headers)

        return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted, for trying `benchctl judge --model openai:...` by hand without a model server:

    python tests/fake_openai.py --port 8766 &
    benchctl judge --model openai:fake-model --base-url http://127.0.0.1:8766/v1
    """
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--ignore-response-format", action="store_true")
    args = ap.parse_args(argv)
    server = FakeOpenAI(api_key=args.api_key, honour_response_format=not args.ignore_response_format, port=args.port)
    print(f"fake OpenAI-compatible server at {server.url}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
