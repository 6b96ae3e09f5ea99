"""Which judge grades: the backend a `--model` names, the model sent to it, the service it is sent to, and the name
its grades are stored under. Cheap to import: no SDK is loaded here.

Two backends, chosen by the model name's prefix:

- `gemini` (no prefix, or `gemini:`): Google's Gemini API through google-genai. The base URL only routes requests
  (a proxy, a gateway): only Google serves Gemini models, so grades are stored under the bare model name whatever
  the base URL, as they always were.
- `openai` (`openai:<model>`): any server of the OpenAI chat-completions protocol through the official `openai` SDK —
  OpenAI itself, or vLLM, SGLang, Ollama, llama.cpp's server, LM Studio or a hosted provider at `--base-url`. Here
  the base URL picks the server, hence the weights, so it is part of the judge: grades from OpenAI's own endpoint
  are stored as `openai:<model>`, from any other as `openai:<model>@<host:port/path>`. The same samples graded by
  two servers are two judges, cached apart and compared in the report, never mixed.

The stored name carries the base URL's host, port and path only: never a scheme's credentials, query or fragment,
and never the key (which goes in a header).

A key travels only where nobody between can read it: over https, or over plain http to this machine (a loopback
address: 127.0.0.0/8, ::1, localhost). Any other http URL is refused before a request is sent
(`check_key_transport`) unless the user says the network between is trusted (`--allow-insecure-key`).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from benchctl.core.errors import ConfigError, JudgeError

GEMINI, OPENAI = "gemini", "openai"
BACKENDS = (GEMINI, OPENAI)

GEMINI_DEFAULT_URL = "https://generativelanguage.googleapis.com"
GEMINI_BASE_URL_VAR = "GOOGLE_GEMINI_BASE_URL"  # read by google-genai itself when no base URL is passed
OPENAI_DEFAULT_URL = "https://api.openai.com/v1"
OPENAI_BASE_URL_VAR = "OPENAI_BASE_URL"  # read by the openai SDK itself; read here too, so the judge's name follows it
OPENAI_KEY_VAR = "OPENAI_API_KEY"
GEMINI_KEY_VARS = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
# Thinking: off (budget 0) on the Gemini models that allow turning it off; other models keep their default (not
# sent). The budget actually sent is stored with every request.
_THINKING_OFF_MODELS = ("gemini-2.5-flash", "gemini-2.5-flash-lite")


@dataclass(frozen=True)
class JudgeSpec:
    """One judge: `backend` ("gemini" or "openai"), `model` (the name sent to the service), `base_url` (where requests
    go; None = google-genai's own choice), `endpoint` (host[:port][/path] of the base URL, for the tables and the
    report), `name` (what its grades and requests are stored and cached under: `judge_model`) and `url` (the URL
    requests really go to, scheme included: the base URL, else the backend's variable, else its service)."""

    backend: str
    model: str
    base_url: str | None
    endpoint: str
    name: str
    url: str = ""

    @property
    def official(self) -> bool:
        """True when the requests go to the backend's own service (so its key and prices apply)."""
        default = GEMINI_DEFAULT_URL if self.backend == GEMINI else OPENAI_DEFAULT_URL
        return self.endpoint == endpoint_of(default)


def has_key(spec: JudgeSpec) -> bool:
    """True when a job with this judge can be sent: its key is set, or it needs none (an OpenAI-compatible server
    other than OpenAI's own). Read from the environment alone: a study without a key never loads a judge's SDK,
    which takes seconds."""
    if spec.backend == GEMINI:
        return any(os.environ.get(var, "").strip() for var in GEMINI_KEY_VARS)
    return bool(os.environ.get(OPENAI_KEY_VAR, "").strip()) or not spec.official


def split_model(model: str) -> tuple[str, str]:
    """(backend, model name) of a `--model` value; a ConfigError naming `--model` for an unknown or empty one."""
    text = model.strip()
    if not text:
        raise ConfigError("--model must name a judge model, e.g. gemini-2.5-flash or openai:gpt-4.1-mini")
    prefix, sep, rest = text.partition(":")
    if not sep:
        return GEMINI, text
    if prefix not in BACKENDS:
        raise ConfigError(
            f"--model {model!r}: unknown judge backend {prefix!r}; name a Gemini model (gemini-2.5-flash) or any "
            f"model of an OpenAI-compatible server as openai:<model> (e.g. openai:{text})"
        )
    if not rest.strip():
        raise ConfigError(f"--model {model!r} names no model after '{prefix}:', e.g. {prefix}:gpt-4.1-mini")
    return prefix, rest.strip()


def endpoint_of(url: str) -> str:
    """host[:port][/path] of a base URL: no scheme, credentials, query or fragment, no trailing slash."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{host}{port}{parts.path.rstrip('/')}"


def check_base_url(url: str) -> None:
    """A ConfigError naming `--base-url` unless `url` is an http(s) URL with a host."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as e:
        raise ConfigError(f"--base-url {url!r} is not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"--base-url {url!r} must be an http:// or https:// URL with a host, e.g. http://localhost:8000/v1"
        )


def resolve(model: str, base_url: str | None = None) -> JudgeSpec:
    """The judge `model` names, sent to `base_url` (else the backend's environment variable, else its service)."""
    backend, name = split_model(model)
    env_var, default = (
        (GEMINI_BASE_URL_VAR, GEMINI_DEFAULT_URL) if backend == GEMINI else (OPENAI_BASE_URL_VAR, OPENAI_DEFAULT_URL)
    )
    url = base_url or os.environ.get(env_var, "").strip() or None
    if url is not None:
        check_base_url(url)
    endpoint = endpoint_of(url or default)
    if backend == GEMINI:
        # google-genai reads the variable itself when given no base URL: pass only what the user passed
        return JudgeSpec(GEMINI, name, base_url, endpoint, name, url or default)
    stored = f"openai:{name}" if endpoint == endpoint_of(OPENAI_DEFAULT_URL) else f"openai:{name}@{endpoint}"
    return JudgeSpec(OPENAI, name, url or OPENAI_DEFAULT_URL, endpoint, stored, url or default)


def is_loopback(host: str) -> bool:
    """Whether `host` (a URL's hostname) names this machine: localhost, or an address in 127.0.0.0/8 or ::1 (an
    IPv4-mapped one included). Any other name may resolve anywhere, so it is not."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_key_transport(spec: JudgeSpec, key_var: str, allow_insecure: bool) -> None:
    """A JudgeError, before anything is sent, when a key (from `key_var`) would cross the network in clear text: a
    plain-http URL to another machine. A bearer token or an x-goog-api-key header on such a URL can be read, and
    reused, by anyone on the path; `allow_insecure` is the user saying that path is trusted."""
    parts = urlsplit(spec.url)
    if allow_insecure or parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return
    raise JudgeError(
        f"refusing to send {key_var} in clear text to http://{spec.endpoint}: use an https:// URL, a server on this "
        "machine (localhost, 127.0.0.1, ::1), or pass --allow-insecure-key if the network between is trusted"
    )


def default_thinking_budget(model: str) -> int | None:
    """0 (thinking off) for the Gemini models that allow it; None (the model's default, not sent) otherwise."""
    return 0 if model.removeprefix("models/") in _THINKING_OFF_MODELS else None
