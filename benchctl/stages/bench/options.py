"""What `benchctl bench` (and the study's bench stage) can be asked for: one frozen `BenchOptions`, checked when
built, each error naming its flag.

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchctl.core.errors import ConfigError

INFERENCE_PRECISIONS = ("float32", "bfloat16", "float16")  # benchctl.core.runtime.INFERENCE_DTYPES (no torch here)


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """Everything one `benchctl bench` decides: which architectures' training steps are timed, how, and where."""

    preset: str = "paper"
    archs: list[str] | None = None  # None: every registered architecture
    steps: int = 10  # timed optimizer steps per repeat
    repeats: int = 3
    warmup: int = 2  # untimed steps first (compilation happens there)
    compile: bool | None = None  # None -> as train decides (train.compile; auto: runtime.resolve_compile)
    device: str = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)
    reference: bool = True  # time the eager llama2.c reference beside the control
    check_steps: int = 0  # > 0: also train control and reference this many seeded steps and compare losses
    seed: int = 0
    threads: int | None = None  # torch's intra-op threads for the measurement (None: torch's own choice)
    # --decode: time generation instead of the training step (benchctl.stages.bench.decode)
    decode: bool = False
    decode_batches: tuple[int, ...] = (1, 16)  # rows generated together
    decode_prompt_tokens: int = 16  # prompt length of every row
    decode_new_tokens: int | None = None  # None: what the context leaves after the prompt
    decode_precisions: tuple[str, ...] = ("float32", "bfloat16")  # the decode path's weights cast to each
    llama2c: Path | None = None  # a karpathy/llama2.c checkout: also time its run.c (runfast) on the llama2c export

    def __post_init__(self) -> None:
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ConfigError(f"--batches must list sizes >= 1, got {list(self.decode_batches)}")
        if self.decode_prompt_tokens < 1:
            raise ConfigError(f"--prompt-tokens must be >= 1, got {self.decode_prompt_tokens}")
        if self.decode_new_tokens is not None and self.decode_new_tokens < 1:
            raise ConfigError(f"--new-tokens must be >= 1, got {self.decode_new_tokens}")
        bad = [p for p in self.decode_precisions if p not in INFERENCE_PRECISIONS]
        if bad or "float32" not in self.decode_precisions:
            raise ConfigError(
                f"--precisions takes a comma list of {', '.join(INFERENCE_PRECISIONS)} including float32 (what the "
                f"others are compared with), got {','.join(self.decode_precisions)}"
            )
        if self.llama2c is not None and not self.decode:
            raise ConfigError("--llama2c times run.c's generation: it goes with --decode")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.check_steps < 0:
            raise ConfigError(f"--check-steps must be >= 0 (0: no check), got {self.check_steps}")
        if self.steps < 1 or self.repeats < 1 or self.warmup < 0:
            raise ConfigError(
                f"--steps and --repeats must be >= 1 and warm-up >= 0 (got {self.steps}, {self.repeats}, {self.warmup})"
            )
