"""Atomic file writes, and where benchctl caches what it derives (prepared data, generated tasks, lm-eval's files).

A reader (or a process killed half-way) of an atomic write sees the old file or the new one, never a torn one. Used
for checkpoints, cached data, generated task files and reports. The temporary file sits next to its target
(same filesystem, so the final rename is atomic), has a unique name (several processes may write the same target:
parallel runs preparing the same cached data), is fsynced before the rename, and is removed if anything fails.
"""

from __future__ import annotations

import os
import re
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


# The cache beside the results database a command works on (set by the command line when it resolves --db): a
# command run from another directory with --db elsewhere finds, and adds to, that database's cache, as its runs
# directory sits beside it too, instead of starting a second cache in the working directory.
_beside_db: Path | None = None


def use_cache_beside(db_path: str | os.PathLike) -> None:
    """Make `cache_root()` the `cache` folder beside `db_path` (unless $BENCHCTL_CACHE names one)."""
    global _beside_db
    _beside_db = Path(db_path).expanduser().resolve().parent / "cache"


def cache_root() -> Path:
    """$BENCHCTL_CACHE, else the `cache` folder beside the command's results database, else results/cache under the
    working directory (absolute, so manifests can be found later)."""
    env = os.environ.get("BENCHCTL_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    return _beside_db if _beside_db is not None else (Path("results") / "cache").resolve()


PARTIAL = ".partial-"  # the staging name of an output being written: .<name>.partial-<pid>


def partial_path(out: Path) -> Path:
    """Where this process stages `out` (a file or a folder) before renaming it into place: beside it, on the same
    file system, named after the writer's pid so a later writer can tell a killed writer's leftovers."""
    return out.parent / f".{out.name}{PARTIAL}{os.getpid()}"


def stale_partials(out: Path) -> list[Path]:
    """Staging files or folders of earlier writers of `out` whose process is gone (killed): safe to remove. Files
    that hang off a staged file (SQLite's `-journal`) go with it, named by the same pid."""
    found = []
    for p in out.parent.glob(f".{out.name}{PARTIAL}*"):
        match = re.match(r"(\d+)(?:-[\w-]+)?$", p.name.rsplit(PARTIAL, 1)[-1])
        if match is None:  # not a name benchctl gives
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except (ProcessLookupError, OverflowError):
            found.append(p)
        except PermissionError:  # someone else's live process
            pass
    return found


def check_writable_dir(path: str | os.PathLike) -> None:
    """Refuse, with one line (OutputError), an output folder that cannot be made or written: a read-only or
    forbidden directory, a full disk, a file in the way. Asked before hours of work whose last step writes there;
    nothing is created (the nearest existing folder above it is probed with a file made and removed at once)."""
    from benchctl.core.errors import OutputError, output_error

    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot write {target}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".benchctl-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise output_error(target, e, staged=False) from None
