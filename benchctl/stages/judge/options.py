"""What `benchctl judge` (and the study's judge stage) can be asked for: one frozen `JudgeOptions`, checked when built,
each error naming its flag, and the judge's defaults.

Cheap to import: the command line is built from it (`benchctl --help`); the Gemini client takes a second to load.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from benchctl.core.errors import ConfigError
from benchctl.stages import RunSelection
from benchctl.stages.judge.judges import GEMINI, check_base_url, split_model

DEFAULT_MODEL = "gemini-2.5-flash"
# Temperature 0 by default: each grade is the judge's most likely verdict, so a mean over samples is not blurred by
# sampling noise; `--repeats` at this temperature measures the service's residual nondeterminism. Pass a higher
# temperature to study judge variance. The value is stored with every request.
DEFAULT_TEMPERATURE = 0.0
AUTO = "auto"
# Protocols: `json` asks for the four grades only; `assess` (the default, the study's wording) has the judge write its
# general assessment of the story first, in an `assessment` field ahead of the grades, as the grading text asks.
PROTOCOLS = ("json", "assess")
DEFAULT_PROTOCOL = "assess"
# The judge's sampling seed, sent with every request (repeat k of a sample gets DEFAULT_SEED + k) and stored: a rerun
# asks for the same grades, and services that honour a seed (vLLM, Ollama, OpenAI on a best-effort basis) give them.
DEFAULT_SEED = 0
# How long one call may wait. Connecting: a server that is up accepts within a second even across the world, so a
# connection not made in 10 s is a host that is down or unreachable, and each attempt on it costs 10 s, not the whole
# answer's time. Reading: the answer comes in one piece (no streaming), so the read timeout must cover the slowest
# answer the judge may write: up to 8192 tokens when it may think (MAX_OUTPUT_THINKING), which takes under 2 minutes
# at the ~70 tokens/s a hosted model or a GPU-served 8B model decodes; 120 s is also what every call had before the
# two were told apart. A slower server (a large model on one GPU, a CPU) needs --read-timeout raised; a server that
# accepts and never answers is found out after --read-timeout, so lower it to find one sooner.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class JudgeOptions:
    """Everything one `benchctl judge` decides: grade the selected runs' samples (the first `limit` prompts of each
    run) `repeats` times with `judge_model` (a Gemini model, or `openai:<model>` for any OpenAI-compatible server;
    see benchctl.stages.judge.judges).

    concurrency: requests in flight at most. thinking_budget (Gemini only): "auto" = 0 on the 2.5-flash models, the
    model's default elsewhere; None = never send one; an int = that budget. max_output_tokens None = 1024 with
    thinking off, 8192 otherwise (an OpenAI-compatible judge may reason: 8192). retry_failed: regrade keys whose
    stored grade failed (True) or keep them (False). max_attempts / base_delay / max_delay (seconds): the retry
    policy for 429, 5xx and connection errors. base_url: the service root (default: $GOOGLE_GEMINI_BASE_URL or
    $OPENAI_BASE_URL, else the backend's own service). judge_seed: the sampling seed sent (repeat k: judge_seed + k;
    None: none sent). seed: the retry jitter's RNG. connect_timeout_s / read_timeout_s: how long one call waits for
    the connection, and then for the answer, before it fails (a transport error, retried). allow_insecure_key: send
    the key over plain http to another machine (refused otherwise, before any request).
    protocol: "assess" (the judge writes its general assessment, stored in judge_grades.assessment, then the grades;
    output limit 2048 with thinking off) or "json" (grades only). Each protocol is its own prompt version (hash), so
    a grade cached under one is never reused for the other. dry_run: count the requests and estimate their tokens
    and cost, send nothing."""

    select: RunSelection = field(default_factory=RunSelection)
    judge_model: str = DEFAULT_MODEL  # a Gemini model, or openai:<model> for an OpenAI-compatible server
    concurrency: int = 8
    repeats: int = 1
    limit: int | None = None
    dry_run: bool = False
    temperature: float = DEFAULT_TEMPERATURE
    thinking_budget: int | None | str = AUTO
    max_output_tokens: int | None = None
    retry_failed: bool = True
    max_attempts: int = 6
    protocol: str = DEFAULT_PROTOCOL
    judge_seed: int | None = DEFAULT_SEED
    base_url: str | None = None
    # the retry delays and the prompt file: the command line leaves them at these defaults
    base_delay: float = 1.0
    max_delay: float = 60.0
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    allow_insecure_key: bool = False
    prompt_path: str | os.PathLike | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        backend, _ = split_model(self.judge_model or "")
        if backend != GEMINI and self.thinking_budget not in (AUTO, None):
            raise ConfigError(
                "--thinking-budget applies to Gemini models only; an OpenAI-compatible server has no such setting "
                "(leave it out, and raise --max-output-tokens if the model reasons before it answers)"
            )
        if self.base_url is not None:
            check_base_url(self.base_url)
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be at least 1, got {self.repeats}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be at least 1, got {self.limit}")
        if self.max_attempts < 1:
            raise ConfigError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        if not 0 <= self.temperature <= 2:  # the range Gemini and OpenAI accept
            raise ConfigError(f"--temperature must be in [0, 2], got {self.temperature:g}")
        budget = self.thinking_budget
        if isinstance(budget, int) and budget < -1:  # -1 is Gemini's "dynamic"
            raise ConfigError(f"--thinking-budget must be -1 (dynamic), 0 (off) or a number of tokens, got {budget}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ConfigError(f"--max-output-tokens must be at least 1, got {self.max_output_tokens}")
        if self.judge_seed is not None and self.judge_seed < 0:
            raise ConfigError(f"--seed must be 0 or more, got {self.judge_seed}")
        for flag, value in (("--connect-timeout", self.connect_timeout_s), ("--read-timeout", self.read_timeout_s)):
            if not 0 < value < math.inf:  # NaN fails this too
                raise ConfigError(f"{flag} must be a number of seconds above 0, got {value:g}")
