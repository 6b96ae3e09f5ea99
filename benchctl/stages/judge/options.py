"""What `benchctl judge` (and the study's judge stage) can be asked for: one frozen `JudgeOptions`, checked when built,
each error naming its flag, and the judge's defaults.

Cheap to import: the command line is built from it (`benchctl --help`); the Gemini client takes a second to load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from benchctl.core.errors import ConfigError
from benchctl.stages import RunSelection

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


@dataclass(frozen=True, kw_only=True)
class JudgeOptions:
    """Everything one `benchctl judge` decides: grade the selected runs' samples (the first `limit` prompts of each
    run) `repeats` times with `judge_model`.

    concurrency: requests in flight at most. thinking_budget: "auto" = 0 on the 2.5-flash models, the model's
    default elsewhere; None = never send one; an int = that budget. max_output_tokens None = 1024 with thinking off,
    8192 otherwise. retry_failed: regrade keys whose stored grade failed (True) or keep them (False).
    max_attempts / base_delay / max_delay (seconds): the retry policy for 429, 5xx and connection errors.
    base_url: the service root (default: $GOOGLE_GEMINI_BASE_URL, else Google's endpoint). seed: the jitter RNG.
    protocol: "assess" (the judge writes its general assessment, stored in judge_grades.assessment, then the grades;
    output limit 2048 with thinking off) or "json" (grades only). Each protocol is its own prompt version (hash), so
    a grade cached under one is never reused for the other. dry_run: count the requests and estimate their tokens
    and cost, send nothing."""

    select: RunSelection = field(default_factory=RunSelection)
    judge_model: str = DEFAULT_MODEL
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
    # the service, the retry delays and the prompt file: the command line leaves them at these defaults
    base_url: str | None = None
    base_delay: float = 1.0
    max_delay: float = 60.0
    timeout_s: float = 120.0
    prompt_path: str | os.PathLike | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.judge_model or not self.judge_model.strip():
            raise ConfigError("--model must name a Gemini model, e.g. gemini-2.5-flash")
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
        if not 0 <= self.temperature <= 2:  # the range Gemini accepts
            raise ConfigError(f"--temperature must be in [0, 2], got {self.temperature}")
        budget = self.thinking_budget
        if isinstance(budget, int) and budget < -1:  # -1 is Gemini's "dynamic"
            raise ConfigError(f"--thinking-budget must be -1 (dynamic), 0 (off) or a number of tokens, got {budget}")
