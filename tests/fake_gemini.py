"""A local HTTP server that speaks the Gemini REST protocol, for tests without the internet.

The real google-genai client is pointed at it (`HttpOptions(base_url=server.url)` or env `GOOGLE_GEMINI_BASE_URL`).
It answers `POST /{v1,v1beta}/models/{model}:generateContent`, checks the `x-goog-api-key` header like the real
service (a wrong key gets 400 INVALID_ARGUMENT / API_KEY_INVALID), and replies in the service's camelCase JSON:

    {"candidates": [{"content": {"role": "model", "parts": [{"text": "..."}]}, "finishReason": "STOP"}],
     "usageMetadata": {"promptTokenCount": 180, "candidatesTokenCount": 24, "thoughtsTokenCount": 0,
                       "totalTokenCount": 204}}

Errors use the google.rpc shape, with a RetryInfo detail when a retry delay is given:

    {"error": {"code": 429, "message": "...", "status": "RESOURCE_EXHAUSTED",
               "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2s"}]}}

Scripting: each request takes the next `Reply` from a queue (`server.push(...)`), else asks `script(request)` (a
function returning a `Reply`), else answers with `default_grade` (deterministic scores from the prompt's hash, after
a short assessment when the request's response schema has an `assessment` field).
The server records every request (path, model, headers, JSON body, time) and the largest number of requests that were
being handled at the same time (`max_in_flight`), so tests can check concurrency limits and that nothing was sent.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_PATH = re.compile(r"^/(v1|v1beta)/models/([^/:]+):generateContent$")


@dataclass
class Request:
    """One request as the server saw it."""

    path: str
    api_version: str
    model: str
    headers: dict[str, str]
    body: dict[str, Any]
    received_at: float

    @property
    def prompt(self) -> str:
        """The text of the user turn (all text parts joined)."""
        parts = self.body.get("contents", [{}])[0].get("parts", [])
        return "".join(p.get("text", "") for p in parts)

    @property
    def generation_config(self) -> dict[str, Any]:
        return self.body.get("generationConfig", {})

    @property
    def schema_fields(self) -> list[str]:
        """The answer fields the request's structured-output schema asks for, in the requested order."""
        schema = self.generation_config.get("responseSchema") or self.generation_config.get("responseJsonSchema") or {}
        return list(schema.get("propertyOrdering") or schema.get("properties") or [])

    @property
    def wants_assessment(self) -> bool:
        """True for the `assess` protocol: the schema has an `assessment` field before the grades."""
        return "assessment" in self.schema_fields


@dataclass
class Reply:
    """What the server does with one request: answer `status` + `body`, after `delay` seconds.

    `drop=True` closes the connection without an answer; `hang` (an Event) blocks until it is set (or the server
    closes), which is how tests simulate a request that never finishes.
    """

    status: int = 200
    body: dict[str, Any] | str | None = None
    delay: float = 0.0
    drop: bool = False
    hang: threading.Event | None = None
    headers: dict[str, str] = field(default_factory=dict)


def usage(prompt_tokens: int = 180, output_tokens: int = 24, thinking_tokens: int = 0) -> dict[str, int]:
    meta = {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": output_tokens,
        "totalTokenCount": prompt_tokens + output_tokens + thinking_tokens,
    }
    if thinking_tokens:
        meta["thoughtsTokenCount"] = thinking_tokens
    return meta


def text(
    content: str,
    *,
    finish_reason: str = "STOP",
    prompt_tokens: int = 180,
    output_tokens: int = 24,
    thinking_tokens: int = 0,
    delay: float = 0.0,
) -> Reply:
    """A 200 answer whose single candidate says `content`."""
    body = {
        "candidates": [
            {"content": {"role": "model", "parts": [{"text": content}]}, "finishReason": finish_reason, "index": 0}
        ],
        "usageMetadata": usage(prompt_tokens, output_tokens, thinking_tokens),
        "modelVersion": "fake-gemini",
    }
    return Reply(200, body, delay=delay)


def grade(
    grammar: Any = 7, creativity: Any = 6, consistency: Any = 5, plot: Any = 4, *, delay: float = 0.0, **kw: Any
) -> Reply:
    """A well-formed grade (any value may be made invalid on purpose, e.g. grammar=11)."""
    obj = {"grammar": grammar, "creativity": creativity, "consistency": consistency, "plot": plot}
    return text(json.dumps(obj), delay=delay, **kw)


def assessed(
    assessment: Any = "A simple story with a clear ending.",
    grammar: Any = 7,
    creativity: Any = 6,
    consistency: Any = 5,
    plot: Any = 4,
    *,
    delay: float = 0.0,
    **kw: Any,
) -> Reply:
    """A well-formed answer of the `assess` protocol: the assessment first, then the grades."""
    obj = {
        "assessment": assessment,
        "grammar": grammar,
        "creativity": creativity,
        "consistency": consistency,
        "plot": plot,
    }
    return text(json.dumps(obj), delay=delay, output_tokens=90, **kw)


def blocked(reason: str = "SAFETY", prompt_tokens: int = 180) -> Reply:
    """The prompt itself was blocked: no candidates, `promptFeedback.blockReason` set."""
    body = {
        "promptFeedback": {"blockReason": reason},
        "usageMetadata": {"promptTokenCount": prompt_tokens, "totalTokenCount": prompt_tokens},
        "modelVersion": "fake-gemini",
    }
    return Reply(200, body)


def error(code: int, status: str, message: str = "", *, retry_delay: str | None = None, delay: float = 0.0) -> Reply:
    """An error in the google.rpc shape, optionally with a RetryInfo `retryDelay` like "0.3s"."""
    err: dict[str, Any] = {"code": code, "message": message or status, "status": status}
    if retry_delay is not None:
        err["details"] = [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay}]
    return Reply(code, {"error": err}, delay=delay)


def rate_limited(retry_delay: str | None = "0.3s") -> Reply:
    return error(429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota).", retry_delay=retry_delay)


def server_error(code: int = 500) -> Reply:
    status = {500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}.get(code, "INTERNAL")
    return error(code, status, "An internal error has occurred.")


def default_grade(request: Request) -> Reply:
    """Deterministic, valid scores derived from the prompt, so end-to-end tests get varied but repeatable grades;
    with an assessment first when the request's schema asks for one (the `assess` protocol)."""
    h = hashlib.sha256(request.prompt.encode()).digest()
    g, c, k, p = (1 + b % 10 for b in h[:4])
    if request.wants_assessment:
        return assessed(
            f"Assessment {h[:4].hex()}: grammar {g}, creativity {c}, consistency {k}, plot {p}.", g, c, k, p
        )
    return grade(g, c, k, p)


class _Server(ThreadingHTTPServer):
    # A deep accept queue: with the default of 5, concurrent connects overflow it, the kernel drops the SYNs and the
    # client retransmits them only after ~1 s.
    request_queue_size = 128
    daemon_threads = True


class FakeGemini:
    """Threaded Gemini REST server on 127.0.0.1 (a free port). Use as a context manager or call close()."""

    def __init__(
        self,
        script: Callable[[Request], Reply] | None = None,
        *,
        api_key: str | None = "test-key",
        latency: float = 0.0,
        port: int = 0,  # 0 = any free port (tests); a fixed one for runs by hand
        bind: str = "127.0.0.1",  # another of this machine's addresses: a server reached by a name, not 127.0.0.1
    ):
        self.script = script
        self.api_key = api_key
        self.latency = latency  # seconds every request takes before its reply (to make requests overlap)
        self.requests: list[Request] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._queue: collections.deque[Reply] = collections.deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd = _Server((bind, port), self._handler_class())
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-gemini", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}"

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def push(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order."""
        with self._lock:
            self._queue.extend(replies)

    def close(self) -> None:
        self._closing.set()  # releases hanging handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeGemini:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------------------------
    def _next_reply(self, request: Request) -> Reply:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        if self.script is not None:
            return self.script(request)
        return default_grade(request)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
                return

            def _send(self, status: int, body: dict[str, Any] | str | None, headers: dict[str, str]) -> None:
                data = (body if isinstance(body, str) else json.dumps(body or {})).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                m = _PATH.match(self.path.split("?", 1)[0])
                if not m:
                    err = {"code": 404, "message": f"no route {self.path}", "status": "NOT_FOUND"}
                    self._send(404, {"error": err}, {})
                    return
                request = Request(
                    path=self.path,
                    api_version=m.group(1),
                    model=m.group(2),
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
                if server.api_key is not None and request.headers.get("x-goog-api-key") != server.api_key:
                    self._send(
                        400,
                        {
                            "error": {
                                "code": 400,
                                "message": "API key not valid. Please pass a valid API key.",
                                "status": "INVALID_ARGUMENT",
                                "details": [
                                    {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}
                                ],
                            }
                        },
                        {},
                    )
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
                    self.close_connection = True  # no answer at all: the client sees a disconnect
                    return
                self._send(reply.status, reply.body, reply.headers)

        return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted, for trying `benchctl judge` by hand without the internet:

        python tests/fake_gemini.py --port 8765 &
        GEMINI_API_KEY=test-key GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:8765 benchctl judge --repeats 2

    `--noise` adds a seeded ±1 jitter to each criterion, so repeated grades of one sample differ as a real judge's
    would at temperature > 0; `--garbage-every N` answers every N-th request with text that is not a grade (it must
    be stored as a failure and regraded on the next run)."""
    import argparse
    import random

    ap = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--api-key", default="test-key")
    ap.add_argument("--noise", action="store_true")
    ap.add_argument("--garbage-every", type=int, default=0)
    args = ap.parse_args(argv)
    rng, counter, lock = random.Random(0), [0], threading.Lock()

    def script(request: Request) -> Reply:
        with lock:
            counter[0] += 1
            n, jitter = counter[0], [rng.choice((-1, 0, 0, 1)) if args.noise else 0 for _ in range(4)]
        if args.garbage_every and n % args.garbage_every == 0:
            return text("Sorry, I cannot grade this story.")
        body = json.loads(default_grade(request).body["candidates"][0]["content"]["parts"][0]["text"])
        g, c, k, p = (
            min(10, max(1, body[f] + j)) for f, j in zip(("grammar", "creativity", "consistency", "plot"), jitter)
        )
        return assessed(body["assessment"], g, c, k, p) if request.wants_assessment else grade(g, c, k, p)

    server = FakeGemini(script, api_key=args.api_key, port=args.port)
    print(f"fake Gemini at {server.url} (key {args.api_key!r}); Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
