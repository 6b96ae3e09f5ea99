"""The pipeline: prepare -> train-all -> sample -> judge -> eval -> report, each stage resumable.

A sweep is data: `sweep(preset, archs, seeds, overrides)` returns the list of run configs, seed being one axis. Every
run has a stable id from its config and data, so rerunning any stage skips what is done and resumes what is not.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import architectures
from benchctl import db as dbm
from benchctl.config import RunConfig, make_config, overrides_for
from benchctl.errors import Aborted, BenchctlError

# Ask before starting work estimated to take longer than this on the current device.
CONFIRM_ABOVE_SECONDS = 3600.0


def sweep(
    preset: str, archs: list[str] | None, seeds: list[int] | None, overrides: dict[str, Any] | None = None
) -> list[RunConfig]:
    """The (architecture x seed) grid, architectures in registry order."""
    names = archs or architectures.names()
    return [make_config(preset, a, s, overrides_for(a, overrides, names)) for s in (seeds or [0]) for a in names]


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def confirm_long_run(
    cfgs: list[RunConfig], prepared: Any, *, yes: bool, log: Callable[[str], None], is_main: bool = True
) -> None:
    """Estimate the wall time of `cfgs` on this device; above an hour, ask (or require --yes when not interactive)."""
    if yes or not cfgs or not is_main:
        return
    from benchctl.train import estimate_seconds, resolve_device

    est = estimate_seconds(cfgs, prepared)
    if est <= CONFIRM_ABOVE_SECONDS:
        return
    device = resolve_device(cfgs[0].train.device)
    what = f"{len(cfgs)} run(s) of preset '{cfgs[0].preset}'"
    hint = " (try --preset small on a CPU)" if device.type == "cpu" and cfgs[0].preset != "small" else ""
    msg = f"{what} would take about {format_duration(est)} on this {device.type.upper()}{hint}"
    if not sys.stdin.isatty():
        raise Aborted(f"{msg}; pass --yes to start anyway")
    import typer

    if not typer.confirm(f"{msg}. Start?", default=False):
        raise Aborted("not started")


@dataclass
class TrainAllResult:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def train_all(
    cfgs: list[RunConfig],
    prepared: Any,
    db_path: Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    yes: bool = False,
) -> TrainAllResult:
    """Train every config not yet done (resuming interrupted ones); a failing run is recorded and the rest go on."""
    from benchctl.config import run_id
    from benchctl.train import train_run

    db = dbm.connect(db_path)
    todo = []
    for c in cfgs:
        row = dbm.get_run(db, run_id(c, prepared.fingerprint))
        if row is None or row["status"] != "done":
            todo.append(c)
    confirm_long_run(todo, prepared, yes=yes, log=log)
    result = TrainAllResult()
    for i, c in enumerate(cfgs, 1):
        log(f"[{i}/{len(cfgs)}] {c.arch} seed {c.seed} (preset {c.preset})")
        try:
            r = train_run(c, prepared, db, db_path, progress=progress, log=log)
        except BenchctlError as e:
            result.failed.append((run_id(c, prepared.fingerprint), str(e)))
            log(f"  failed: {e}")
            continue
        (result.skipped if r.skipped else result.done).append(r.run_id)
        if r.skipped:
            log(f"  already done: {r.run_id}")
    return result


@dataclass
class StudyOptions:
    """Everything `benchctl study` decides, in one place (the CLI fills it; tests build it directly)."""

    preset: str = "paper"
    archs: list[str] | None = None
    seeds: list[int] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    db_path: Path = field(default_factory=dbm.default_path)
    out_dir: Path = Path("reports")
    judge_model: str = "gemini-2.5-flash"
    judge_concurrency: int = 8
    n_prompts: int | None = None  # None: sample.py's default
    eval_tasks: list[str] | None = None  # None: the bundled tasks
    skip: tuple[str, ...] = ()  # stages to skip: sample, judge, eval
    yes: bool = False
    progress: bool = True


STAGES = ("prepare", "train", "sample", "judge", "eval", "report")


def run_study(opts: StudyOptions, log: Callable[[str], None] = print) -> Path:
    """prepare -> train-all -> sample -> judge (only with an API key) -> eval -> report; every stage resumable.

    Returns the report path. A failed training run does not stop the study: later stages use the runs that
    finished, the report lists the failure, and the caller is told (BenchctlError at the end).
    """
    from benchctl import data, report

    cfgs = sweep(opts.preset, opts.archs, opts.seeds, opts.overrides)
    archs = sorted({c.arch for c in cfgs}, key=lambda a: architectures.names().index(a))

    log(f"== 1/6 prepare: data source {cfgs[0].data.source!r}, vocab {cfgs[0].model.vocab_size}")
    prepared = data.prepare(cfgs[0].data, cfgs[0].model.vocab_size, progress=opts.progress)

    log(f"== 2/6 train: {len(cfgs)} run(s) — {', '.join(archs)} × seeds {sorted({c.seed for c in cfgs})}")
    trained = train_all(cfgs, prepared, opts.db_path, progress=opts.progress, log=log, yes=opts.yes)
    ids = trained.done + trained.skipped
    db = dbm.connect(opts.db_path)

    if "sample" in opts.skip or not ids:
        log("== 3/6 sample: skipped" + ("" if ids else " (no finished runs)"))
    else:
        from benchctl import sample

        log("== 3/6 sample: story completions from the fixed prompt set")
        kw = {"n_prompts": opts.n_prompts} if opts.n_prompts else {}
        s = sample.sample_all(db, opts.db_path, run_ids=ids, progress=opts.progress, **kw)
        log(f"   {s.generated} new sample(s), {s.skipped} already stored")

    from benchctl import judge

    if "judge" in opts.skip or not ids:
        log("== 4/6 judge: skipped")
    elif not judge.has_api_key():
        log("== 4/6 judge: skipped — no GEMINI_API_KEY (or GOOGLE_API_KEY) set; set one and rerun "
            f"'benchctl study' (or 'benchctl judge --model {opts.judge_model}') to grade the stories")
    else:
        log(f"== 4/6 judge: grading with {opts.judge_model}")
        js = judge.judge_all(db, judge_model=opts.judge_model, concurrency=opts.judge_concurrency, run_ids=ids,
                             progress=opts.progress)
        log(f"   {js.n_ok} graded, {js.n_failed} failed, {js.n_cached} already graded")

    if "eval" in opts.skip or not ids:
        log("== 5/6 eval: skipped")
    else:
        from benchctl import evaluate

        log("== 5/6 eval: lm-eval tasks on every finished run")
        evaluate.evaluate_runs(db, opts.db_path, tasks=opts.eval_tasks, run_ids=ids, progress=opts.progress,
                               log=log)

    log(f"== 6/6 report: {opts.out_dir}")
    path = report.write_report(opts.db_path, opts.out_dir, opts.preset)
    if trained.failed:
        raise BenchctlError(
            f"report written to {path}, but {len(trained.failed)} training run(s) failed: "
            + "; ".join(f"{rid}: {err}" for rid, err in trained.failed)
            + " — rerun 'benchctl study' with the same options to retry them"
        )
    return path
