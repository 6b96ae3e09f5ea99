"""Atomic file writes, and where benchctl caches what it derives (prepared data, generated tasks, lm-eval's files).

A reader (or a process killed half-way) of an atomic write sees the old file or the new one, never a torn one. Used
for checkpoints, cached data, generated task files and reports. The temporary file sits next to its target
(same filesystem, so the final rename is atomic), has a unique name (several processes may write the same target:
parallel runs preparing the same cached data), is fsynced before the rename, and is removed if anything fails.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], object]) -> None:
    """Write `data` (bytes, text as UTF-8, or a function that writes into the open binary file) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cache_root() -> Path:
    """$BENCHCTL_CACHE, else results/cache under the working directory (absolute, so manifests can be found later)."""
    return Path(os.environ.get("BENCHCTL_CACHE") or Path("results") / "cache").expanduser().resolve()
