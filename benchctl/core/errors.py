"""The one error hierarchy of benchctl.

Expected failures (a user typo, a missing file, a server that says no) are raised deep inside as a
`BenchctlError` subclass, caught once in `cli.py`, printed as one line and mapped to an exit code.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class BenchctlError(Exception):
    """A failure the user can fix; the message says what was wrong and what to do."""

    exit_code = 1


class ConfigError(BenchctlError):
    """Unknown key, wrong type, impossible shape, unknown preset or architecture."""

    exit_code = 2


class DataError(BenchctlError):
    """Missing, empty or malformed data; unreachable hub; corrupt cache."""

    exit_code = 3


class CheckpointError(BenchctlError):
    """A checkpoint that is missing, corrupt, or from a different configuration."""

    exit_code = 4


class DatabaseError(BenchctlError):
    """results.db missing, locked, or of an unknown schema."""

    exit_code = 5


class ForeignDatabaseError(DatabaseError):
    """An SQLite file that is not a benchctl results database: refused before a byte of it is written."""

    exit_code = 2


class JudgeError(BenchctlError):
    """No API key, or the judge service refused the whole job."""

    exit_code = 6


class EvalError(BenchctlError):
    """lm-eval tasks that cannot run (unknown task, bad recurrence override)."""

    exit_code = 7


class OutputError(BenchctlError):
    """A file or folder benchctl writes could not be written: the disk is full, the destination is read-only or not
    ours to write. Nothing partial is left in its place."""

    exit_code = 8


def output_error(path: object, e: OSError, *, staged: bool = True) -> OutputError:
    """One line for an OSError while writing `path`, by its cause. `staged`: the writer staged its output beside
    `path` and removed it, so the line can say nothing partial is left."""
    import errno

    why = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EROFS: "the destination is on a read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
    }.get(e.errno or 0, e.strerror or str(e))
    left = "; nothing partial was left there" if staged else ""
    return OutputError(f"cannot write {path}: {why}{left}")


class Aborted(BenchctlError):
    """The user declined a confirmation prompt."""

    exit_code = 130


class Terminated(KeyboardInterrupt):
    """A SIGTERM (a plain `kill`, a scheduler stopping the job), unwound like Ctrl-C: a training process records its
    run as interrupted instead of leaving it `running`."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: raise Terminated in the main thread, wherever it is, once. Further SIGTERMs are ignored:
    the process is already unwinding, and one raised inside that unwinding (recording a run as interrupted, printing
    the last line) would cut it short with a chain of tracebacks. SIGKILL still ends it at once."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated(f"signal {signum}")


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest option to a mistyped word, or "" when nothing is close.

    `architectures` has its own copy (it imports nothing from benchctl); importing that one would load torch."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
