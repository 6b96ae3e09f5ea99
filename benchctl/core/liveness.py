"""Whether a run recorded as running is still being trained, or its process is gone (killed, its machine lost).

A training process claims its run in the run's row: `status` running, the process id (`pid`), the time the process
started (`pid_started`), its machine (`hostname`), and a `heartbeat_at` it stamps every `HEARTBEAT_S` seconds from
a thread of its own. A process that ends normally or with an error records so (done, failed); one killed outright
(`kill -9`, the machine powered off) records nothing, and its row says running until the run is trained again.
`run_state` tells the two apart when a row is read: on the machine that trains it, the process must still exist and
have started when the row says (a later process given the same id is not it); from another machine, which cannot
see that process, the heartbeat must be recent. What it finds is shown (`benchctl runs`, the report), never written:
the next training command takes the run up again, as it already does.

Only the standard library: `benchctl runs` imports this.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HEARTBEAT_S = 30.0  # how often a training process stamps its run's row
# How long a running row from another machine may go without a stamp before it is taken as interrupted: many missed
# beats, so that a busy database or a slow shared file system never makes a live run look dead.
STALE_AFTER_S = 600.0
START_TOLERANCE_S = 2.0  # a process's start time, read twice, can differ by the rounding of the boot time
INTERRUPTED = "interrupted"


@functools.cache
def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses): the state
    first. None where there is no such file (the process is gone, or this is not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def process_start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch, as the kernel keeps it; None where unknown."""
    fields, boot = _proc_stat(pid), _boot_time()
    if fields is None or boot is None or len(fields) < 20:
        return None
    try:
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the file: start time in clock ticks
    except (ValueError, OSError):
        return None


def alive(pid: int | None, started: float | None = None) -> bool:
    """Whether process `pid` runs on this machine and, when `started` is known, is the process that started then
    rather than a later one the system gave the same id. A process that has exited but not yet been collected by
    its parent (a zombie) is not alive."""
    if not pid or pid < 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, and belongs to another user
    except OSError:
        return False
    fields = _proc_stat(pid)
    if fields is not None and fields[:1] == ["Z"]:
        return False
    if started is not None:
        now_started = process_start_time(pid)
        if now_started is not None and abs(now_started - started) > START_TOLERANCE_S:
            return False
    return True


def _number(value: Any) -> float | None:
    """A stored number, or None for an empty cell (SQL NULL, or the NaN a DataFrame holds for it)."""
    if value is None or isinstance(value, str):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=timezone.utc)


def run_state(row: Mapping[str, Any], *, host: str | None = None, now: datetime | None = None) -> str:
    """The status to show for a runs row: the stored one, except `interrupted` for a running row whose process is
    gone. On the machine named in the row, that is when its process no longer exists (or is another process with
    the same id); elsewhere, when the row's last sign of life (heartbeat, else the last update or start) is older
    than STALE_AFTER_S. A row with neither a process on this machine nor any time stays running: nothing tells."""
    status = str(row.get("status"))
    if status != "running":
        return status
    pid = _number(row.get("pid"))
    if row.get("hostname") == (host or socket.gethostname()) and pid is not None:
        return "running" if alive(int(pid), _number(row.get("pid_started"))) else INTERRUPTED
    signs = [_time(row.get(k)) for k in ("heartbeat_at", "updated_at", "started_at")]
    last = max((s for s in signs if s is not None), default=None)
    if last is None:
        return status
    age = ((now or datetime.now(timezone.utc)) - last).total_seconds()
    return INTERRUPTED if age > STALE_AFTER_S else status


class Heartbeat:
    """Calls `beat()` every `interval` seconds from a daemon thread until stopped: how a training process keeps
    stamping its run's row while its main thread is busy in a long step or evaluation. `beat` runs in that thread
    only (an SQLite connection belongs to the thread that opened it); an exception in it is ignored, since a missed
    beat costs nothing but a late sign of life."""

    def __init__(self, beat: Callable[[], None], interval: float = HEARTBEAT_S):
        self.beat, self.interval = beat, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._loop, name="benchctl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - best effort, see the class docstring
                pass

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._thread = None
