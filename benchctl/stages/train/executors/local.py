"""Runs on this machine: one after another in this process (`InProcess`, the default), or N at once in separate
processes (`ProcessPool`, `--jobs N`).

The processes are started with `spawn`, not `fork`: a forked copy of a process that already runs torch's thread
pools (and possibly CUDA) can deadlock. Each is one long-lived "slot" that trains the runs it is handed one after
another, with its share of the cores (and its own GPU on a GPU machine), so torch is imported once per slot, not
once per run. Every slot writes to the same results.db: WAL mode, a busy timeout and one transaction per event
(benchctl.core.db) make that safe.

Interruption: Ctrl-C reaches every process of the terminal's group; each training process records its run as
interrupted (its last checkpoint stays), and the parent waits for them briefly before terminating what is left. A
`kill` of the parent terminates the slots (they record the interruption the same way), and a slot whose parent
vanished (kill -9) stops by itself. A rerun resumes every run from its last checkpoint.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchctl import stages
from benchctl.core import accounting
from benchctl.core.errors import BenchctlError, Terminated, raise_terminated
from benchctl.core.progress import Progress, Task, as_progress
from benchctl.stages.train import engine
from benchctl.stages.train.executors import (
    Execution,
    OnOutcome,
    Outcome,
    RunSpec,
    Slots,
    already_done,
    link_run_dir,
    plan_slots,
    split_evenly,
)

GRACE_SECONDS = 10.0  # how long terminated slots get to record their runs before they are killed
POLL_SECONDS = 1.0
UPDATE_SECONDS = 0.5  # a slot sends its progress at most this often (the parent redraws or prints from it)


class InProcess:
    """Every run in this process, one after another: the behaviour of `--jobs 1` (and of torchrun, whose ranks all
    train each run together)."""

    def __init__(
        self,
        *,
        prepared: Any,
        db_path: Path,
        db: Any,
        progress: Any,
        log: Callable[[str], None],
        runs_dir: Path | None = None,
        weights_needed: bool = True,
    ):
        self.prepared, self.db_path, self.db, self.progress, self.log = prepared, db_path, db, progress, log
        self.runs_dir, self.weights_needed = runs_dir, weights_needed

    def run(self, specs: list[RunSpec], on_outcome: OnOutcome) -> None:
        for spec in specs:
            c = spec.cfg
            self.log(f"[{spec.index}/{spec.of or len(specs)}] {spec.variant} seed {c.seed} (preset {c.preset})")
            try:
                r = engine.train_run_when_free(
                    c,
                    self.prepared,
                    self.db,
                    self.db_path,
                    progress=self.progress,
                    log=self.log,
                    variant=spec.variant,
                    runs_dir=self.runs_dir,
                    weights_needed=self.weights_needed,
                )
            except BenchctlError as e:
                on_outcome(spec, Outcome("failed", str(e)))
                continue
            link_run_dir(self.db_path, self.runs_dir, spec.run_id)
            on_outcome(spec, Outcome("skipped" if r.skipped else "done", resumed_from=r.resumed_from))


class _Slot:
    """The parent's handle on one training process: its inbox and the run it is training."""

    def __init__(self, number: int, process: Any, inbox: Any):
        self.number, self.process, self.inbox = number, process, inbox
        self.spec: RunSpec | None = None


class ProcessPool:
    """Up to N runs at once, each in a spawned process with its share of the threads."""

    def __init__(
        self, execution: Execution, *, prepared: Any, db_path: Path, db: Any, progress: Any, log: Callable[[str], None]
    ):
        self.execution, self.prepared, self.db_path, self.db, self.log = execution, prepared, Path(db_path), db, log
        self.progress: Progress = as_progress(progress)
        self._relay = _ProgressRelay(self.progress, log)

    def run(self, specs: list[RunSpec], on_outcome: OnOutcome) -> None:
        todo = []
        for spec in specs:  # finished runs need no process (and must not count towards the jobs started)
            if already_done(self.db, self.db_path, self.execution.runs_dir, spec.run_id, self.execution.weights_needed):
                on_outcome(spec, Outcome("skipped"))
            else:
                todo.append(spec)
        if todo:
            # the longest runs first, so that the last ones to start are short and the jobs end close together
            # (runs keep their numbers in the messages)
            self._run(sorted(todo, key=lambda spec: -accounting.training_flops(spec.cfg)), on_outcome)

    def _run(self, specs: list[RunSpec], on_outcome: OnOutcome) -> None:
        slots = plan_slots(self.execution.jobs, len(specs), specs[0].cfg.train.device)
        where = f", GPUs {','.join(slots.gpus)}" if slots.gpus else ""
        self.log(f"{len(specs)} run(s), {slots.jobs} at a time, {slots.threads} thread(s) each{where}")
        ctx = mp.get_context("spawn")
        events = ctx.Queue()
        pending, total = deque(specs), len(specs)
        running = [self._start(ctx, slots, k, events) for k in range(slots.jobs)]
        stop = _TermAsInterrupt()
        try:
            for s in running:
                self._hand_out(s, pending, total)
            while any(s.spec is not None for s in running):
                try:
                    event = events.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    self._replace_dead(ctx, slots, running, events, pending, total, on_outcome)
                    continue
                self._handle(event, running, pending, total, on_outcome)
        except BaseException as e:
            # a kill reached this process alone: pass it on at once; Ctrl-C reached every process of the terminal's
            # group, so the slots are already recording their runs and get a moment before being terminated
            _stop(
                [s.process for s in running],
                events,
                self.log,
                terminate_after=0.0 if isinstance(e, Terminated) else 2.0,
            )
            raise
        finally:
            stop.restore()
            self.progress.close()
        _stop([s.process for s in running], events, self.log, terminate_after=60.0)

    def _start(self, ctx: Any, slots: Slots, number: int, events: Any) -> _Slot:
        inbox = ctx.Queue()
        args = (
            number,
            inbox,
            events,
            self.prepared,
            str(self.db_path),
            self.execution.runs_dir,
            slots.threads,
            self.progress.enabled,
            os.getpid(),
        )
        return _Slot(number, _spawn(ctx, _slot_main, args, f"benchctl-job-{number}", slots.env(number)), inbox)

    def _hand_out(self, slot: _Slot, pending: deque, total: int) -> None:
        """The slot's next run, or the end of its work."""
        if not pending:
            slot.spec = None
            slot.inbox.put(None)
            return
        slot.spec = spec = pending.popleft()
        self.log(
            f"[{spec.index}/{spec.of or total}] {spec.variant} seed {spec.cfg.seed} (preset {spec.cfg.preset}) "
            f"-> job {slot.number}"
        )
        slot.inbox.put(spec)

    def _replace_dead(
        self,
        ctx: Any,
        slots: Slots,
        running: list[_Slot],
        events: Any,
        pending: deque,
        total: int,
        on_outcome: OnOutcome,
    ) -> None:
        """A slot that died without reporting (killed, out of memory): its run failed (and is resumable); a new
        process takes its place while runs remain."""
        for i, s in enumerate(running):
            if s.spec is None or s.process.is_alive():
                continue
            spec, s.spec = s.spec, None
            self._relay.close_tasks(s.number)
            on_outcome(
                spec,
                Outcome(
                    "failed",
                    f"its training process died (exit code {s.process.exitcode}); "
                    "rerun to resume it from its last checkpoint",
                ),
            )
            if pending:
                running[i] = fresh = self._start(ctx, slots, s.number, events)
                self._hand_out(fresh, pending, total)

    # ---- events from the slots -------------------------------------------------------------------------------------

    def _handle(self, event: tuple, running: list[_Slot], pending: deque, total: int, on_outcome: OnOutcome) -> None:
        kind, number = event[0], event[1]
        if kind == "result":
            slot = next(s for s in running if s.number == number)
            index, outcome = event[2], event[3]
            spec = slot.spec
            if spec is None or index not in (None, spec.index):
                return  # from a process already replaced (its run was recorded as failed then)
            self._relay.close_tasks(number)
            link_run_dir(self.db_path, self.execution.runs_dir, spec.run_id)
            on_outcome(spec, outcome)
            self._hand_out(slot, pending, total)
        else:
            self._relay.handle(event)


def in_shares(
    fn: Callable[..., Any],
    run_ids: list[str],
    work: list[float],
    share: Callable[[list[str]], dict[str, Any]],
    *,
    jobs: int | str,
    db_path: Path,
    device_spec: str,
    progress: Progress,
    log: Callable[[str], None],
    what: str,
) -> list[Any] | None:
    """`run_ids` split into `jobs` shares of about equal `work`, each handled by `fn(..., **share(its run ids))` in
    its own process (`in_processes`): their results, or None when one job is all there is (the caller then works
    in its own process)."""
    slots = plan_slots(jobs, len(run_ids), device_spec)
    if slots.jobs < 2:
        return None
    groups = split_evenly(run_ids, work, slots.jobs)
    return in_processes(
        fn,
        [share(ids) for ids in groups],
        db_path=db_path,
        device_spec=device_spec,
        progress=progress,
        log=log,
        what=what,
    )


def in_processes(
    fn: Callable[..., Any],
    groups: list[dict[str, Any]],
    *,
    db_path: Path,
    device_spec: str,
    progress: Progress,
    log: Callable[[str], None],
    what: str,
) -> list[Any]:
    """`fn(db, db_path, progress=<reporter>, **group)` for every group at once, each in its own spawned process with
    its share of the cores (and its own GPU on a GPU machine); the results in the order of `groups`.

    For the stages that work run by run after training (sample, eval): each group is a share of the runs and `fn` is
    the stage's own function, which stores its rows in results.db itself (one transaction per batch or per run), so
    an interrupted call leaves only finished work behind and a rerun does the rest. A group's error is raised once
    every group has ended, so the others' work is kept."""
    slots = plan_slots(len(groups), len(groups), device_spec)
    where = f", GPUs {','.join(slots.gpus)}" if slots.gpus else ""
    log(f"{what}: {slots.jobs} jobs at once, {slots.threads} thread(s) each{where}")
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    relay = _ProgressRelay(progress, log)
    procs = [
        _spawn(
            ctx,
            _group_main,
            (k, fn, group, str(db_path), slots.threads, events, progress.enabled, os.getpid()),
            f"benchctl-job-{k}",
            slots.env(k),
        )
        for k, group in enumerate(groups)
    ]
    ended: dict[int, tuple[str, Any]] = {}
    gone: set[int] = set()  # processes seen dead without their last event: given one more poll for it to arrive
    stop = _TermAsInterrupt()
    try:
        while len(ended) < len(procs):
            try:
                event = events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                for k, proc in enumerate(procs):
                    if k not in ended and not proc.is_alive():
                        if k in gone:
                            ended[k] = ("died", proc.exitcode)
                        gone.add(k)
                continue
            if not relay.handle(event):
                ended[event[1]] = (event[0], event[2])
                relay.close_tasks(event[1])
    except BaseException as e:  # as in ProcessPool.run: a kill is passed on at once, Ctrl-C reached every process
        _stop(procs, events, log, terminate_after=0.0 if isinstance(e, Terminated) else 2.0)
        raise
    finally:
        stop.restore()
        progress.close()
    _stop(procs, events, log, terminate_after=60.0)
    for k in range(len(procs)):
        kind, payload = ended[k]
        if kind == "error":
            raise payload
        if kind == "interrupted":
            raise KeyboardInterrupt(f"job {k} was interrupted")
        if kind == "died":
            raise BenchctlError(
                f"{what}: job {k}'s process died (exit code {payload}); what the other jobs stored "
                "is kept, and a rerun does the rest"
            )
        if kind == "crash":
            raise RuntimeError(f"{what}: job {k} failed:\n{payload}")
    return [ended[k][1] for k in range(len(procs))]


def _group_main(
    number: int,
    fn: Callable[..., Any],
    group: dict[str, Any],
    db_path: str,
    threads: int,
    events: Any,
    progress: bool,
    parent: int,
) -> None:
    """One group of `in_processes`: its result (or its error) goes back to the parent as the last event."""
    signal.signal(signal.SIGTERM, raise_terminated)
    _watch_parent(parent)
    torch.set_num_threads(threads)
    reporter = _RemoteProgress(events, number, progress)
    try:
        db = stages.connect(db_path, create=False)
        events.put(("result", number, fn(db, db_path, progress=reporter, **group)))
    except KeyboardInterrupt:
        events.put(("interrupted", number, None))
    except BenchctlError as e:
        events.put(("error", number, e))
    except Exception:  # a bug: the parent raises it with this traceback
        events.put(("crash", number, traceback.format_exc()))


class _ProgressRelay:
    """The parent's side of the children's progress: messages are logged, and every task a child opens becomes a
    line of the parent's reporter named after its job ("job 1: frailt s0"), so the console shows one line per active
    job."""

    def __init__(self, progress: Progress, log: Callable[[str], None]):
        self.progress, self.log = progress, log
        self._tasks: dict[tuple[int, int], Task] = {}

    def handle(self, event: tuple) -> bool:
        """Show a progress event (log, task, update, close); False for any other kind of event."""
        kind, number = event[0], event[1]
        if kind == "log":
            self.log(event[2])
        elif kind == "task":
            _, _, tid, description, total_steps, completed, fields = event
            self._tasks[number, tid] = self.progress.task(
                f"job {number}: {description}", total=total_steps, completed=completed, **fields
            )
        elif kind == "update":
            _, _, tid, completed, total_steps, fields = event
            task = self._tasks.get((number, tid))
            if task is not None:
                task.update(completed=completed, total=total_steps, **fields)
        elif kind == "close":
            task = self._tasks.pop((number, event[2]), None)
            if task is not None:
                task.close()
        else:
            return False
        return True

    def close_tasks(self, number: int) -> None:
        for key in [k for k in self._tasks if k[0] == number]:
            self._tasks.pop(key).close()


def _spawn(ctx: Any, target: Callable[..., None], args: tuple, name: str, env: dict[str, str]) -> Any:
    """Start a process with `env` added to its environment (set before it starts, so torch and OpenMP read it)."""
    p = ctx.Process(target=target, args=args, name=name, daemon=False)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child starts with the parent's environment as it is now
    try:
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return p


def _stop(processes: list[Any], events: Any, log: Callable[[str], None], *, terminate_after: float) -> None:
    """Wait up to `terminate_after` seconds for the processes to end, then terminate them (SIGTERM: they record
    their runs as interrupted) and give them GRACE_SECONDS before killing what is left. Their messages are read
    meanwhile: a process cannot exit while what it sent is still waiting in the pipe."""
    _drain_until_ended(processes, events, log, terminate_after)
    for p in processes:
        if p.is_alive():
            p.terminate()
    _drain_until_ended(processes, events, log, GRACE_SECONDS)
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _drain_until_ended(processes: list[Any], events: Any, log: Callable[[str], None], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if event[0] == "log":
            log(event[2])


class _TermAsInterrupt:
    """While the pool runs, a SIGTERM to the parent (a plain `kill`) unwinds like Ctrl-C, so the slots are stopped
    and their runs recorded rather than orphaned."""

    def __init__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, raise_terminated)

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


# ---- inside a slot's process ----------------------------------------------------------------------------------------


class _RemoteProgress(Progress):
    """A slot's progress reporter: tasks and messages go to the parent, which draws one line per active job."""

    def __init__(self, events: Any, number: int, enabled: bool):
        super().__init__(enabled=enabled, interactive=False)
        self._events, self._number, self._next = events, number, 0

    def log(self, msg: str) -> None:
        self._events.put(("log", self._number, msg))

    def task(self, description: str, total: int | None = None, *, completed: int = 0, **fields: Any) -> Task:
        t = Task(self, description, total, completed, fields)
        self._next += 1
        t._rich_id = self._next
        if self.enabled:
            self._events.put(("task", self._number, t._rich_id, description, total, completed, dict(t.fields)))
        return t

    def _refresh(self, t: Task, final: bool) -> None:
        now = time.monotonic()
        if self.enabled and (final or now - t._last_line >= UPDATE_SECONDS):
            t._last_line = now
            self._events.put(("update", self._number, t._rich_id, t.completed, t.total, dict(t.fields)))

    def _closed(self, t: Task) -> None:
        if self.enabled:
            self._events.put(("close", self._number, t._rich_id))


def _watch_parent(parent: int) -> None:
    """Stop this process when its parent is gone (a kill -9 of the parent would otherwise leave it training)."""

    def watch() -> None:
        while True:
            time.sleep(POLL_SECONDS)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _slot_main(
    number: int,
    inbox: Any,
    events: Any,
    prepared: Any,
    db_path: str,
    runs_dir: Path | None,
    threads: int,
    progress: bool,
    parent: int,
) -> None:
    """A slot: train each run handed over until told to stop, reporting every outcome."""
    signal.signal(signal.SIGTERM, raise_terminated)
    _watch_parent(parent)
    torch.set_num_threads(threads)
    reporter = _RemoteProgress(events, number, progress)
    try:
        db = stages.connect(db_path)
        while (spec := inbox.get()) is not None:
            outcome = _train_one(spec, prepared, db, Path(db_path), runs_dir, reporter, engine.train_run_when_free)
            events.put(("result", number, spec.index, outcome))
    except KeyboardInterrupt:
        return
    except BenchctlError as e:  # results.db could not be opened: the run handed over fails with the reason
        events.put(("result", number, None, Outcome("failed", str(e))))


def _train_one(
    spec: RunSpec,
    prepared: Any,
    db: Any,
    db_path: Path,
    runs_dir: Path | None,
    reporter: Progress,
    train_run: Callable[..., Any],
) -> Outcome:
    try:
        r = train_run(
            spec.cfg,
            prepared,
            db,
            db_path,
            progress=reporter,
            log=reporter.log,
            variant=spec.variant,
            runs_dir=runs_dir,
        )
    except BenchctlError as e:
        return Outcome("failed", str(e))
    except Exception as e:  # a bug in one run must not take the other jobs down; its traceback goes to the log
        reporter.log(traceback.format_exc())
        return Outcome("failed", f"{type(e).__name__}: {e}")
    return Outcome("skipped" if r.skipped else "done", resumed_from=r.resumed_from)
