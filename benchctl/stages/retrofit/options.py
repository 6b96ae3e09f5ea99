"""What `benchctl retrofit` can be asked for: one frozen `RetrofitOptions`, checked when built, each error naming its
flag.

Cheap to import: the command line is built from it (`benchctl --help`). The study's retrofit stage converts a plan's
variants instead (benchctl.plans.conversions), from configs rather than from a stored run named on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchctl.core.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RetrofitOptions:
    """Which finished run to convert (`parent`: its id, or its name when unique, looked up among `preset`'s runs when
    given), into which architecture, how its weights are mapped (`init`, and `lora_init` for per-pass LoRA), and how
    long the converted model heals (`steps`; None: the preset's), with the command line's --set and --data on top."""

    parent: str
    to: str
    init: str
    lora_init: str = "svd"
    steps: int | None = None
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # torch: kept out of 'benchctl --help', which imports this module
        from architectures.retrofit import INITS, LORA_INITS

        if self.init not in INITS:
            raise ConfigError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.lora_init not in LORA_INITS:
            raise ConfigError(f"--lora-init must be one of {', '.join(LORA_INITS)}, got {self.lora_init!r}")
