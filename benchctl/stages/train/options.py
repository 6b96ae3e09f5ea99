"""How `benchctl train-all` (and the study's train stage) trains its runs: one frozen `TrainOptions`, checked when
built (a bad --jobs, --executor or --ray-address is one clear error before any data is prepared).

Cheap to import: the command line is built from it (`benchctl --help`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchctl.stages.train.executors import Execution


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Where the runs train (in this process one after another, in `jobs` local processes at once, or as tasks on a
    Ray cluster) and whether work estimated above an hour may start without asking (`yes`). Which runs train is the
    caller's: a sweep, a plan's variants, the study's."""

    yes: bool = False
    jobs: int | str = 1  # runs trained at once on this machine: a number, or "auto"
    executor: str = "local"  # local, or ray: every run a task on a Ray cluster
    ray_address: str | None = None  # the cluster to join (None: $RAY_ADDRESS, else a new local instance)
    runs_dir: Path | None = None  # where run directories live (None: beside results.db)
    weights_needed: bool = True  # False: a run done in results.db is done without its checkpoint (nothing loads it)
    execution: Execution = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "execution",
            Execution(
                executor=self.executor,
                jobs=self.jobs,
                ray_address=self.ray_address,
                runs_dir=self.runs_dir,
                weights_needed=self.weights_needed,
            ),
        )
