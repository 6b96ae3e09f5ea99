"""One progress reporter for every stage, created by the command line and passed down to the engine.

On a terminal it draws rich progress bars; when output goes to a file or a pipe (`benchctl study ... > log`) it
writes one plain line per task every few seconds instead of thousands of carriage-return updates; disabled
(`--no-progress`) it draws nothing. Messages (`log`) are always printed: they are output, not decoration.

Libraries that draw their own tqdm bars (lm-eval, datasets, the Hugging Face hub) draw nothing of their own inside
`library_bars()`: the bars that last become tasks of the reporter, the instant ones show nothing.

    progress = Progress(enabled=True)
    with progress.task("training control", total=400) as t:
        t.update(completed=step, loss=f"{loss:.3f}", **{"tok/s": f"{tps:,.0f}"})
    progress.log("done")

The engine never imports the CLI: it receives a `Progress` (or builds a silent one with `Progress(enabled=False)`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from benchctl.core.errors import Aborted

PLAIN_INTERVAL = 10.0  # seconds between plain progress lines when output is not a terminal
# A library's tqdm bar becomes a task of the reporter once it has run this long (`Progress.library_bars`): long enough
# that the instant bars of a library's bookkeeping never show, short enough that a download is seen to move.
LIBRARY_BAR_AFTER = 2.0


class Task:
    """One unit of work with a known (or unknown) total, reported through its `Progress`."""

    def __init__(self, owner: Progress, description: str, total: int | None, completed: int, fields: dict[str, Any]):
        self._owner = owner
        self.description = description
        self.total = total
        self.completed = completed
        self.fields = {k: str(v) for k, v in fields.items()}
        self.started = time.monotonic()
        self._last_line = 0.0
        self._rich_id: Any = None
        self.closed = False

    def update(
        self,
        *,
        advance: int = 0,
        completed: int | None = None,
        description: str | None = None,
        total: int | None = None,
        **fields: Any,
    ) -> None:
        """Move the task forward by `advance` or to `completed`; `fields` are shown after the counts as `name value`."""
        if self.closed:
            return
        if completed is not None:
            self.completed = completed
        self.completed += advance
        if description is not None:
            self.description = description
        if total is not None:
            self.total = total
        self.fields.update({k: str(v) for k, v in fields.items()})
        self._owner._refresh(self, final=False)

    def move_to(self, completed: int, **fields: Any) -> None:
        """Set the position (a loop reporting where it is, e.g. a training step) and any fields that changed."""
        self.update(completed=completed, **fields)

    def close(self) -> None:
        if not self.closed:
            self._owner._refresh(self, final=True)
            self.closed = True
            self._owner._closed(self)

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> str:
        """The plain one-line form: `description: 120/400 (30%) loss 3.12, 41s elapsed, ~96s left`."""
        elapsed = time.monotonic() - self.started
        parts = [f"{self.description}: {self.completed:,}"]
        if self.total:
            parts[0] += f"/{self.total:,} ({100.0 * self.completed / self.total:.0f}%)"
        extra = [f"{k} {v}" for k, v in self.fields.items() if v not in ("", "-")]
        tail = f"{elapsed:.0f}s elapsed"
        if self.total and 0 < self.completed < self.total:
            tail += f", ~{elapsed * (self.total - self.completed) / self.completed:.0f}s left"
        return " ".join(parts + extra) + f", {tail}"


class Progress:
    """Progress bars (rich) on a terminal, a plain line every `interval` seconds otherwise, nothing when disabled."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        console: Any = None,
        interval: float = PLAIN_INTERVAL,
        interactive: bool | None = None,
        stream: TextIO | None = None,
    ):
        if console is None:
            console = Console(file=stream) if stream is not None else Console()
        self.console = console
        self.enabled = enabled
        self.interactive = console.is_terminal if interactive is None else interactive
        self.interval = interval
        self._rich: Any = None
        self._tasks: list[Task] = []
        self._lock = threading.Lock()

    # ---- messages --------------------------------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        """Print a message (above any live bar)."""
        self.console.print(msg, highlight=False, markup=False, soft_wrap=not self.interactive)

    # ---- tasks -----------------------------------------------------------------------------------------------------

    def task(self, description: str, total: int | None = None, *, completed: int = 0, **fields: Any) -> Task:
        t = Task(self, description, total, completed, fields)
        with self._lock:
            self._tasks.append(t)
            if self.enabled and self.interactive:
                self._rich_start()
                t._rich_id = self._rich.add_task(
                    description, total=total, completed=completed, extra=_fields_text(t.fields)
                )
        if self.enabled and not self.interactive:
            self.console.print(t.summary(), highlight=False, markup=False, soft_wrap=True)
            t._last_line = time.monotonic()
        return t

    def _refresh(self, t: Task, final: bool) -> None:
        if not self.enabled:
            return
        if self.interactive:
            with self._lock:
                if self._rich is not None and t._rich_id is not None:
                    self._rich.update(
                        t._rich_id,
                        completed=t.completed,
                        total=t.total,
                        description=t.description,
                        extra=_fields_text(t.fields),
                    )
            return
        now = time.monotonic()
        if final or now - t._last_line >= self.interval:
            t._last_line = now
            self.console.print(t.summary(), highlight=False, markup=False, soft_wrap=True)

    def _closed(self, t: Task) -> None:
        with self._lock:
            if t in self._tasks:
                self._tasks.remove(t)
            if self._rich is not None and t._rich_id is not None:
                self._rich.stop_task(t._rich_id)
            if self._rich is not None and not self._tasks:
                self._rich.stop()
                self._rich = None

    def _rich_start(self) -> None:
        if self._rich is not None:
            return
        self._rich = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[extra]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._rich.start()

    def close(self) -> None:
        """Close every open task (used when a stage fails half-way, so a live bar never outlives it)."""
        for t in list(self._tasks):
            t.close()

    # ---- libraries' own tqdm bars ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def library_bars(self, after: float | None = None) -> Iterator[None]:
        """Inside this block, tqdm bars (lm-eval, datasets, the Hugging Face hub) draw nothing of their own: a bar
        still running `after` seconds (None: LIBRARY_BAR_AFTER) after it started becomes a task of this reporter (a
        rich bar on a terminal, a plain line every `interval` seconds otherwise), so a download shows how far it
        is while the many sub-second bars of a library's bookkeeping (lm-eval builds each task's contexts under
        one) show nothing. Disabled, every bar is hidden. tqdm is restored afterwards."""
        from tqdm import std  # only what runs a library's bars needs it: `benchctl runs` and `--help` never do

        wait = LIBRARY_BAR_AFTER if after is None else after
        saved = {name: std.tqdm.__dict__[name] for name in ("__init__", "display", "close")}  # descriptors as stored
        original_init, original_close = std.tqdm.__init__, std.tqdm.close
        enabled, reporter, sink = self.enabled, self, _Discard()

        def init(bar: Any, *args: Any, **kw: Any) -> None:
            if not enabled:
                kw["disable"] = True
            elif len(args) > 4:  # tqdm(iterable, desc, total, leave, file, ...): the file given positionally
                args = (*args[:4], sink, *args[5:])
            else:
                kw["file"] = sink
            original_init(bar, *args, **kw)

        def display(bar: Any, msg: str | None = None, pos: int | None = None) -> bool:
            task = bar.__dict__.get("_benchctl_task")
            if task is None:
                started = getattr(bar, "start_t", None)  # unset during tqdm's own first refresh, in its __init__
                if started is None or bar._time() - started < wait:
                    return True
                desc = (bar.desc or "").strip().rstrip(":").strip() or "working"
                task = bar.__dict__["_benchctl_task"] = reporter.task(desc, total=bar.total, completed=bar.n)
            else:
                task.update(completed=bar.n, total=bar.total)
            return True

        def close(bar: Any) -> None:
            original_close(bar)  # its last display() brings the task up to date
            task = bar.__dict__.pop("_benchctl_task", None)
            if task is not None:
                task.close()

        ds_bars = None if enabled else _datasets_bars(False)
        # patching the class is the point here (every bar any library makes), hence the ignores
        std.tqdm.__init__ = init  # type: ignore[method-assign,assignment]
        std.tqdm.display = display  # type: ignore[method-assign,assignment]
        std.tqdm.close = close  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(std.tqdm, name, value)
            if ds_bars is not None:
                _datasets_bars(ds_bars)


class _Discard:
    """The file tqdm writes its own bar to inside `library_bars`: nothing of it is shown."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def _fields_text(fields: dict[str, str]) -> str:
    return "  ".join(f"{k} {v}" for k, v in fields.items())


def _datasets_bars(enable: bool | None) -> bool | None:
    """Set Hugging Face datasets' own bars on/off; return what they were (None when datasets is absent)."""
    try:
        import datasets  # pandas, pyarrow: kept out of 'benchctl --help', which imports this module
    except ImportError:  # pragma: no cover - a dependency, but the reporter must not need it
        return None
    before = datasets.is_progress_bar_enabled()
    if enable is True:
        datasets.enable_progress_bars()
    elif enable is False:
        datasets.disable_progress_bars()
    return before


def format_duration(seconds: float) -> str:
    """A duration as a person reads it: '45 s', '12 min', '2.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def silent() -> Progress:
    """A reporter that draws no bars and prints messages to stdout (library use, tests)."""
    return Progress(enabled=False)


def as_progress(progress: bool | Progress, *, stderr: bool = False) -> Progress:
    """The reporter an engine function was given, or one built from the old `progress: bool` flag (True: bars on
    stdout, or on stderr when `stderr` so results keep stdout; False: silent)."""
    if isinstance(progress, Progress):
        return progress
    if stderr:
        return Progress(enabled=bool(progress), console=Console(stderr=True))
    return Progress(enabled=bool(progress))


# Ask before starting work estimated to take longer than this on the current device.
CONFIRM_ABOVE_SECONDS = 3600.0


def confirm_long(
    seconds: float, what: str, *, yes: bool, confirm: Callable[[str], bool] | None, hint: str = ""
) -> None:
    """Before work estimated at `seconds`: above CONFIRM_ABOVE_SECONDS ask through `confirm` (a question in, yes or
    no out), or, when there is no one to ask (confirm=None, no terminal), refuse unless --yes was given."""
    if yes or seconds <= CONFIRM_ABOVE_SECONDS:
        return
    msg = f"{what} would take about {format_duration(seconds)}{hint}"
    if confirm is None:
        raise Aborted(f"{msg}; pass --yes to start anyway")
    if not confirm(f"{msg}. Start?"):
        raise Aborted("not started")


def inference_seconds(row: dict[str, Any], tokens: float, flops_per_token: float) -> float:
    """About how long a finished run's model takes to process `tokens` tokens at `flops_per_token` forward FLOPs
    each, at the FLOP rate its training reached on this machine (training FLOPs/token x tokens/s, both stored with
    the run); 0 when the run recorded no rate. A rough figure, to decide whether to ask before starting."""
    rate = (row.get("flops_per_token") or 0) * (row.get("tokens_per_s") or 0)
    return tokens * flops_per_token / rate if rate > 0 else 0.0
