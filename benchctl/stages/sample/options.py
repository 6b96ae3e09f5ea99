"""What `benchctl sample` (and the study's sample stage) can be asked for: one frozen `SampleOptions`, its defaults,
and the part of it that decides what a sample is (`to_dict`, hashed into every sample's id).

Cheap to import: the command line reads the defaults when it is built (`benchctl --help`), long before any model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from benchctl.core.config import is_smoke
from benchctl.core.errors import ConfigError
from benchctl.stages import RunSelection
from benchctl.stages.depth.options import check_extrapolate, check_test_depth
from benchctl.stages.train.executors import parse_jobs

# Bump when the generation procedure changes what a given seed produces. v2: weights cast once to the inference
# precision (by default float32 on a CPU, where v1 ran under the training rule's bf16 autocast), the decode path.
SAMPLER = "benchctl-sample-v2"

# Defaults, recorded with every sample. temperature 1.0 / top-k 300: llama2.c's sample.py. New tokens: by default
# (None) what the model's context leaves after each prompt, so no completion runs past the window the model was
# trained on (see `context_limit`). 50 prompts per model: the study's scale for a judged comparison.
DEFAULT_N_PROMPTS = 50
# A smoke run (the tiny preset) completes a few prompts per model: enough to run generation, storage and the judge.
SMOKE_N_PROMPTS = 4
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 300
DEFAULT_MAX_NEW_TOKENS: int | None = None
PRECISIONS = ("auto", "float32", "bfloat16", "float16")
DEFAULT_SEED = 0
DEFAULT_BATCH_SIZE = 64
DEFAULT_EXIT_THRESHOLD = 5e-4  # Huginn's default for its KL exit

# The options that decide what a sample is, besides the run and the prompt: recorded with every sample (its
# settings_json) and hashed into its id. The others (which runs, how many prompts, where, how many processes) do not
# change a sample's text.
SETTINGS = (
    "temperature",
    "top_k",
    "top_p",
    "max_new_tokens",
    "seed",
    "n_recur",
    "batch_size",
    "extrapolate",
    "exit_rule",
    "exit_threshold",
    "precision",
)
# absent when None (precision: when "auto"), so default samples keep their hash
_ONLY_WHEN_SET = ("extrapolate", "exit_rule", "exit_threshold", "precision")


@dataclass(frozen=True, kw_only=True)
class SampleOptions:
    """Everything one `benchctl sample` decides; checked when built, each error naming its flag."""

    select: RunSelection = field(default_factory=RunSelection)
    n_prompts: int = DEFAULT_N_PROMPTS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = DEFAULT_TOP_K  # None (or 0) = no top-k filter
    top_p: float | None = None  # None = no nucleus filter
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None = what the context leaves after each prompt
    seed: int = DEFAULT_SEED
    n_recur: int | None = None  # None = each run's trained recurrence
    batch_size: int = DEFAULT_BATCH_SIZE
    extrapolate: str | None = None  # None = each architecture's default rule past the trained depth
    exit_rule: str | None = None  # kl | latent: per-token adaptive exit, n_recur = maximum depth
    exit_threshold: float | None = None  # None with an exit rule = DEFAULT_EXIT_THRESHOLD
    precision: str = "auto"  # weights' dtype for generation; auto = the fastest bench --decode measured here
    compile: bool = False  # compile the decode step (torch.compile); does not change what is sampled
    device: str = "auto"
    jobs: int | str = 1  # runs sampled at once, each share in its own process (a number or "auto")
    yes: bool = False  # start work estimated at over an hour without asking (never part of a sample's settings)

    def __post_init__(self) -> None:
        if self.exit_rule is not None and self.exit_threshold is None:
            object.__setattr__(self, "exit_threshold", DEFAULT_EXIT_THRESHOLD)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", None)
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 1 (or 0 for no top-k filter), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.n_recur is not None and self.n_recur < 1:
            raise ConfigError(f"--n-recur must be >= 1, got {self.n_recur}")
        if self.n_recur is not None:
            check_test_depth(self.n_recur, "--n-recur")
        if self.exit_rule is not None and self.exit_rule not in ("kl", "latent"):
            raise ConfigError(f"--exit: unknown rule '{self.exit_rule}'; choose kl or latent")
        check_extrapolate(self.extrapolate)  # even where no selected run would apply it
        if self.exit_threshold is not None and self.exit_rule is None:
            raise ConfigError("--threshold needs --exit kl or --exit latent")
        if self.exit_threshold is not None and not self.exit_threshold >= 0:
            raise ConfigError(f"--threshold must be >= 0, got {self.exit_threshold}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.n_prompts < 1:
            raise ConfigError(f"--n-prompts must be >= 1, got {self.n_prompts}")
        parse_jobs(self.jobs)

    def to_dict(self) -> dict[str, Any]:
        """The settings a sample records (see SETTINGS), with the stop rule and the sampler's version."""
        d = {k: getattr(self, k) for k in SETTINGS if not (k in _ONLY_WHEN_SET and getattr(self, k) in (None, "auto"))}
        return {**d, "stop": "bos,eos", "sampler": SAMPLER}

    def new_token_limit(self, prompt_len: int, max_seq_len: int) -> int:
        """New tokens a prompt of `prompt_len` tokens may get: `max_new_tokens` when set, else `context_limit`."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return context_limit(prompt_len, max_seq_len)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]


def study_n_prompts(preset: str | None, given: int | None = None) -> int:
    """Story beginnings the study completes per model: `given` (--n-prompts), else the preset's default."""
    if given is not None:
        return given
    return SMOKE_N_PROMPTS if is_smoke(preset) else DEFAULT_N_PROMPTS


def context_limit(prompt_len: int, max_seq_len: int) -> int:
    """New tokens the context leaves after a prompt: every token is then predicted from at most `max_seq_len`
    tokens (the last new token is never fed back), so the prompt and its completion fill at most `max_seq_len` + 1
    positions. At least 1 (a prompt longer than the context gets one token, predicted from its last window)."""
    return max(1, max_seq_len + 1 - prompt_len)
