"""An optional TensorBoard mirror of the training metrics, for watching a long run live.

results.db stays the source of truth: the mirror receives exactly the metric rows `train` writes there (run, step,
name, value), as they are written, and puts each one in `<db dir>/tensorboard/<run id>/` under the metric's own
name (val_loss, train_loss, lr, grad_norm, ...), so `tensorboard --logdir results/tensorboard` shows one run per
curve with the vocabulary of the metrics table.

Resuming: a resumed run recomputes every step after its checkpoint, and results.db drops those rows first. The
mirror does the same for TensorBoard with `purge_step`: a new writer starts with a restart marker (SessionLog.START)
at `start_step + 1`, and TensorBoard's readers (the fast data server and the Python accumulators) then hide every
older event at or after that step, so curves continue without duplicated steps. A run started from scratch purges
from step 0. The first writer of a run writes the marker too (at step 0): TensorBoard's server ignores the first
marker it sees in a run and honours the later ones. Readers take a run's event files in name order, and a name
starts with the creation second, so a writer opened in the same second as the previous one waits for the next
second before creating its file.

Turned on by the config flag `log.tensorboard` or by `BENCHCTL_TENSORBOARD=1` (see `enabled`). Only rank 0 of a
distributed run should mirror, as only it writes results.db.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from benchctl.core.errors import ConfigError

ENV = "BENCHCTL_TENSORBOARD"
SUBDIR = "tensorboard"
FLUSH_SECS = 10  # TensorBoard's default is 120 s; rows are also flushed with every batch written to results.db
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def enabled(cfg_value: bool | None = None) -> bool:
    """Mirror to TensorBoard? On when the config flag is true or $BENCHCTL_TENSORBOARD is 1/true/yes/on.

    Either switch turns it on, so a user can watch one run of a preset (env) without changing its config, and a
    config can ask for it without the environment. A value of the variable that is neither on nor off is an error
    rather than a silent "off".
    """
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise ConfigError(f"${ENV} must be 1 or 0 (or true/false), got {os.environ[ENV]!r}")
    return bool(cfg_value) or raw in _TRUE


def log_dir(db_path: str | os.PathLike, run_id: str) -> Path:
    """`<db dir>/tensorboard/<run id>`: beside the run directories, one TensorBoard run per benchctl run."""
    return Path(db_path).resolve().parent / SUBDIR / run_id


def _event_second(name: str) -> int | None:
    """The creation second in an event file's name ('events.out.tfevents.<second>.<host>.<pid>.<n>')."""
    parts = name.split(".")
    if len(parts) > 3 and parts[:3] == ["events", "out", "tfevents"] and parts[3].isdigit():
        return int(parts[3])
    return None


def _wait_for_a_later_second(directory: Path) -> None:
    """Make the next event file's name sort after every existing one (readers go through files in name order)."""
    if not directory.is_dir():
        return
    seconds = [s for s in (_event_second(p.name) for p in directory.iterdir()) if s is not None]
    if not seconds:
        return
    newest = max(seconds)
    while int(time.time()) <= newest:
        time.sleep(0.05)


class TensorBoardMirror:
    """Writes metric rows to one TensorBoard run directory; `purge_step` hides older events from that step on."""

    def __init__(self, directory: str | os.PathLike, *, purge_step: int = 0, flush_secs: int = FLUSH_SECS) -> None:
        if purge_step < 0:
            raise ValueError(f"purge_step must be >= 0, got {purge_step}")
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: pip install 'benchctl[tensorboard]'
        except ImportError:  # torch raises this when the tensorboard package is missing
            raise ConfigError(
                "TensorBoard logging is on but the tensorboard package is not installed; "
                "pip install tensorboard, or turn log.tensorboard / $BENCHCTL_TENSORBOARD off"
            ) from None
        self.dir = Path(directory)
        _wait_for_a_later_second(self.dir)
        self._writer = SummaryWriter(str(self.dir), purge_step=purge_step, flush_secs=flush_secs)

    def add(self, step: int, name: str, value: float) -> None:
        """One scalar, tagged with the metric's name."""
        self._writer.add_scalar(name, float(value), int(step))

    def add_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Metric rows as written to results.db (`step`, `name`, `value`), then flush so TensorBoard sees them."""
        for row in rows:
            self.add(row["step"], row["name"], row["value"])
        self.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoMirror:
    """What `open_mirror` returns when TensorBoard logging is off: every call does nothing."""

    dir = None

    def add(self, step: int, name: str, value: float) -> None:
        pass

    def add_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NoMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def open_mirror(db_path: str | os.PathLike, run_id: str, *, start_step: int, on: bool) -> TensorBoardMirror | NoMirror:
    """The mirror for a run that (re)starts after `start_step` (0 = from scratch), or a no-op when `on` is false.

    Steps up to `start_step` are kept (results.db keeps their rows too); later ones are hidden, since the resumed
    run writes them again.
    """
    if not on:
        return NoMirror()
    return TensorBoardMirror(log_dir(db_path, run_id), purge_step=start_step + 1 if start_step > 0 else 0)
