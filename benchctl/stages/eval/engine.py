"""`evaluate_runs`, the runner behind `benchctl eval`: every finished run (or a selection) x tasks through
`lm_eval.simple_evaluate`, one eval_results row per metric.

Rows keyed (run, task, metric, n_recur, limit_n) are replaced on rerun, and a (run, task, n_recur, limit) already
stored with the same task version is skipped unless `force`. Tasks are bundled ones, lm-eval task names or globs, or
tasks from the user's own YAML directories (`include_paths`, `--include-path`); see `benchctl.stages.eval.tasks`.
When the Hugging Face hub is unreachable, standard tasks are tried from the local datasets cache only (offline mode,
so no retry storm), and those that cannot load are reported and left out. lm-eval reseeds python/numpy/torch
globally: all RNG states are saved before and restored after. lm-eval's own progress bars draw nothing: the
adapter reports the requests on the `Progress` given, and any bar of lm-eval's that lasts becomes one of its tasks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import datasets.config as dconfig
import huggingface_hub.constants as hconst
import lm_eval
import lm_eval.evaluator as evaluator_module
import torch

import architectures
from benchctl.core import data as datamod
from benchctl.core import db as dbm
from benchctl.core.checkpoint import CKPT_NAME, load_model, rng_state, run_dir, set_rng_state
from benchctl.core.config import RunConfig
from benchctl.core.errors import CheckpointError, ConfigError, EvalError
from benchctl.core.progress import Progress, as_progress
from benchctl.core.runtime import resolve_device
from benchctl.core.telemetry import git_commit
from benchctl.stages import RunSelection
from benchctl.stages.bench.precision import choose_precision
from benchctl.stages.eval import tables as eval_tables
from benchctl.stages.eval.adapter import BenchctlLM
from benchctl.stages.eval.options import EvalOptions
from benchctl.stages.eval.tasks import TaskIndex
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.executors.local import in_shares

BOOTSTRAP_ITERS = 1000  # lm-eval stderr for bootstrapped metrics (acc uses the closed form)
HUB_PROBE_TIMEOUT = 3.0


@dataclass
class EvalSummary:
    """What `evaluate_runs` did; `rows` are the stored eval_results rows of the selection (new and earlier)."""

    tasks: list[str]
    runs: list[dict[str, Any]]  # id, arch, preset, seed, n_recur (the one evaluated)
    rows: list[dict[str, Any]] = field(default_factory=list)
    evaluated: list[tuple[str, str]] = field(default_factory=list)  # (run id, task) computed now
    skipped: list[tuple[str, str]] = field(default_factory=list)  # already stored
    unavailable: dict[str, str] = field(default_factory=dict)  # task -> why it could not run (needs the hub)
    seconds: float = 0.0
    limit: int | None = None
    n_recur: int | None = None


# ====================================================================================================================
# Recurrence and result rows


def allowed_recurrence(arch: str, model_args: Any) -> str:
    cls = architectures.get(arch)
    top = cls.max_n_recur(model_args)
    if top is None:
        return "any value >= 1"
    if top == 1:
        return "only 1"
    return f"1 to {top} (trained with {model_args.n_recur})"


def check_recurrence(run: dict[str, Any], cfg: Any, n_recur: int | None) -> int:
    """The recurrence to evaluate `run` at; a ConfigError naming the run and the allowed range if it cannot."""
    if n_recur is None:
        return int(cfg.model.n_recur)
    top = architectures.get(cfg.arch).max_n_recur(cfg.model)
    if n_recur < 1 or (top is not None and n_recur > top):
        raise ConfigError(
            f"--n-recur {n_recur} is not allowed for run {run['id']} ({cfg.arch}): it accepts "
            f"{allowed_recurrence(cfg.arch, cfg.model)}; select other runs with --runs/--archs"
        )
    return n_recur


def _split_metric(key: str) -> tuple[str, bool] | None:
    """lm-eval result key "acc,none" -> ("acc", is_stderr); "acc_stderr,none" -> ("acc", True); alias -> None."""
    if "," not in key:
        return None
    name, filt = key.split(",", 1)
    is_stderr = name.endswith("_stderr")
    if is_stderr:
        name = name[: -len("_stderr")]
    return (name if filt == "none" else f"{name}[{filt}]"), is_stderr


def result_rows(
    results: dict[str, Any],
    run_id: str,
    n_recur: int,
    limit: int | None,
    batch_size: int,
    versions: dict[str, str],
    dtype: str | None = None,
    dtype_reason: str | None = None,
) -> list[dict[str, Any]]:
    """simple_evaluate's output -> eval_results rows (stderr "N/A" -> None)."""
    rows = []
    created = dbm.now()
    for task, metrics in results["results"].items():
        n_samples = (results.get("n-samples", {}).get(task) or {}).get("effective")
        version = versions.get(task)
        if version is None:
            v = results.get("versions", {}).get(task)
            version = None if v is None else str(v)
        values: dict[str, float] = {}
        errs: dict[str, Any] = {}
        for key, value in metrics.items():
            parsed = _split_metric(key)
            if parsed is None:
                continue
            name, is_stderr = parsed
            (errs if is_stderr else values)[name] = value
        for name, value in values.items():
            if not isinstance(value, (int, float)):
                continue
            err = errs.get(name)
            rows.append(
                {
                    "run_id": run_id,
                    "task": task,
                    "metric": name,
                    "n_recur": n_recur,
                    "limit_n": limit or 0,
                    "value": float(value),
                    "stderr": float(err) if isinstance(err, (int, float)) else None,
                    "n_samples": n_samples,
                    "task_version": version,
                    "batch_size": batch_size,
                    "lm_eval_version": lm_eval.__version__,
                    "created_at": created,
                    "dtype": dtype,
                    "dtype_reason": dtype_reason,
                }
            )
    return rows


# ====================================================================================================================
# Hub access and lm-eval's side effects


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Can this machine open a TCP connection to the Hugging Face hub (honouring HF_ENDPOINT / HF_HUB_OFFLINE)?"""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or os.environ.get(
        "HF_DATASETS_OFFLINE", ""
    ).upper() in ("1", "ON", "YES", "TRUE"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """Put huggingface_hub and datasets in offline mode (local cache only) for the block, then restore.

    Both libraries read HF_HUB_OFFLINE once at import, so the environment variable cannot do it at run time; without
    it every dataset lookup retries the unreachable hub for ~20 s before failing.
    """
    if not enabled:
        yield
        return
    saved = (hconst.HF_HUB_OFFLINE, dconfig.HF_HUB_OFFLINE)
    hconst.HF_HUB_OFFLINE = dconfig.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hconst.HF_HUB_OFFLINE, dconfig.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep our output readable and lm-eval quick: it logs every step at INFO, and it collects environment details
    that cost seconds. Its progress bars are not touched here: they follow `Progress.library_bars`."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    # simple_evaluate ends by collecting environment info for its results dict: torch's collect_env (1-6 s a call:
    # pip list, nvidia-smi, ...) and `git describe` in the working directory, whose "fatal: not a git repository" goes
    # straight to our stderr outside a checkout. benchctl stores none of it (runs record versions and the commit), so
    # while we evaluate, lm-eval gets a quick, quiet version of both.
    saved_env = {
        k: evaluator_module.__dict__[k]
        for k in ("add_env_info", "get_git_commit_hash")
        if k in evaluator_module.__dict__
    }
    if "add_env_info" in saved_env:
        evaluator_module.add_env_info = _light_env_info
    if "get_git_commit_hash" in saved_env:
        evaluator_module.get_git_commit_hash = git_commit
    try:
        yield
    finally:
        logger.setLevel(level)
        for k, v in saved_env.items():
            setattr(evaluator_module, k, v)


def _light_env_info(storage: dict[str, Any]) -> None:
    """What lm-eval's add_env_info records that is quick to get (its versions), without torch's collect_env."""
    storage.update(
        {
            "pretty_env_info": "not collected by benchctl (see the runs table)",
            "lm_eval_version": metadata.version("lm_eval"),
            "torch_version": torch.__version__,
        }
    )


def _probe_standard(tm, names: list[str], offline: bool) -> dict[str, str]:
    """Load each standard task once (downloading its dataset if the hub is reachable); task -> error if it fails."""
    bad: dict[str, str] = {}
    with hub_offline(offline):
        for name in names:
            try:
                tm.load([name])
            except OSError as e:  # ConnectionError / FileNotFoundError from datasets: not on the hub, not cached
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                bad[name] = first[:200]
    return bad


# ====================================================================================================================
# The runner


def _plan(db, db_path: Path, opts: EvalOptions) -> list[tuple[dict[str, Any], Any, int]]:
    """(run row, config, n_recur to evaluate) per selected run; every run's recurrence and checkpoint are checked
    before any work starts."""
    sel = opts.select
    runs = train_tables.finished_runs(
        db,
        run_ids=sel.run_ids,
        archs=sel.archs,
        preset=sel.preset,
        bad_selection=ConfigError,
        none_left=EvalError,
        purpose="to evaluate",
        kind="stories",
    )
    plan = []
    for run in runs:
        cfg = RunConfig.from_json(run["config_json"])
        plan.append((run, cfg, check_recurrence(run, cfg, opts.n_recur)))
    for run, _, _ in plan:
        ckpt = run_dir(db_path, run["id"]) / CKPT_NAME
        if not ckpt.exists():
            raise CheckpointError(f"run {run['id']} is marked done but has no checkpoint at {ckpt}")
        load_model(ckpt, "cpu", run)  # the run's own checkpoint, not one copied over from another run
    return plan


class _Session:
    """What one `evaluate_runs` call carries from run to run: a task index per prepared data directory (built on
    first use), the standard task names resolved once, and the summary being filled."""

    def __init__(
        self, db, db_path: Path, opts: EvalOptions, summary: EvalSummary, progress: Progress, log: Callable[[str], None]
    ):
        self.db, self.db_path, self.opts, self.summary = db, db_path, opts, summary
        self.progress, self.log = progress, log
        self.offline = bool(opts.standard) and not hub_reachable()
        self.indexes: dict[Path, TaskIndex] = {}
        self.standard: list[str] | None = None  # globs expanded; None until the first index is built

    def note(self, msg: str) -> None:
        """A progress message: shown unless progress is off (warnings go through `log` directly)."""
        if self.progress.enabled:
            self.log(msg)

    def run(self, k: int, n: int, run: dict[str, Any], cfg: Any, r: int) -> None:
        """Evaluate one run at recurrence `r` on the tasks it has no current results for."""
        label = f"[{k}/{n}] {run['arch']} seed {run['seed']} ({run['id']}), n_recur {r}"
        prepared = datamod.prepare(cfg.data, cfg.model.vocab_size, progress=self.progress.enabled)
        index = self.index(prepared)
        runnable = self.opts.bundled + [t for t in (self.standard or []) if t not in self.summary.unavailable]
        if not runnable:
            raise EvalError(
                "none of the requested tasks can run here: "
                + "; ".join(f"{t}: {why}" for t, why in self.summary.unavailable.items())
            )
        todo = self.todo(run, r, runnable, index.versions())
        if not todo:
            self.note(f"{label}: already evaluated ({', '.join(runnable)}); --force recomputes")
            return
        self.evaluate(run, r, todo, index, label)

    def index(self, prepared: datamod.Prepared) -> TaskIndex:
        if prepared.dir not in self.indexes:
            self.note(f"preparing tasks from the validation split in {prepared.dir}")
            opts = self.opts
            with _quiet():
                index = TaskIndex(prepared, opts.bundled, opts.standard, opts.n_docs, opts.include_paths)
                self.indexes[prepared.dir] = index
                if opts.standard and self.standard is None:
                    self.resolve_standard(index)
        return self.indexes[prepared.dir]

    def resolve_standard(self, index: TaskIndex) -> None:
        """Expand the standard task names once, and leave out (with a message) those whose dataset cannot load."""
        self.standard = index.resolve(self.opts.standard)
        if self.offline:
            self.note(
                "the Hugging Face hub is unreachable: standard tasks run only if their dataset is in the local cache"
            )
        unavailable = self.summary.unavailable = _probe_standard(index.tm, self.standard, self.offline)
        if unavailable:
            why = (
                "the Hugging Face hub is unreachable and their dataset is not cached locally"
                if self.offline
                else "their dataset could not be loaded"
            )
            self.log(
                f"skipping {', '.join(unavailable)}: {why} ("
                + "; ".join(f"{t}: {e}" for t, e in unavailable.items())
                + ")"
            )
        self.summary.tasks = self.opts.bundled + self.standard

    def todo(self, run: dict[str, Any], r: int, runnable: list[str], versions: dict[str, str]) -> list[str]:
        """The runnable tasks without a stored result of the current task version (all of them with `force`)."""
        have = eval_tables.eval_task_versions(self.db, run["id"], r, self.opts.limit_n)
        todo = []
        for task in runnable:
            stored, current = have.get(task), versions.get(task)
            if not self.opts.force and stored and (current is None or stored == {current}):
                self.summary.skipped.append((run["id"], task))
            else:
                todo.append(task)
        return todo

    def evaluate(self, run: dict[str, Any], r: int, todo: list[str], index: TaskIndex, label: str) -> None:
        """Run lm-eval on one run's checkpoint and replace its rows for `todo` in one transaction."""
        opts, t_run = self.opts, time.perf_counter()
        dtype, dtype_reason = choose_precision(self.db, opts.precision, resolve_device(opts.device, option="--device"))
        lm = BenchctlLM(
            checkpoint=run_dir(self.db_path, run["id"]) / CKPT_NAME,
            n_recur=r,
            batch_size=opts.batch_size,
            device=opts.device,
            progress=self.progress,
            dtype=str(dtype).removeprefix("torch."),
            dtype_reason=dtype_reason,
        )
        self.note(f"{label}: {', '.join(todo)}")
        with _quiet(), hub_offline(self.offline):
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=todo,
                task_manager=index.tm,
                limit=opts.limit,
                bootstrap_iters=BOOTSTRAP_ITERS,
                log_samples=False,
                batch_size=opts.batch_size,
                device=str(lm.device),
            )
        rows = result_rows(
            results,
            run["id"],
            r,
            opts.limit,
            opts.batch_size,
            index.versions(),
            dtype=lm.dtype,
            dtype_reason=lm.dtype_reason,
        )
        done_tasks = {row["task"] for row in rows}
        eval_tables.replace_eval_results(
            self.db, rows, {(run["id"], t) for t in set(todo) | done_tasks}, r, opts.limit_n
        )
        self.summary.evaluated += [(run["id"], t) for t in todo]
        self.note(f"{label}: done in {time.perf_counter() - t_run:.1f} s")


def _evaluate_in_jobs(
    db_path: str | os.PathLike,
    plan: list[tuple[dict[str, Any], Any, int]],
    opts: EvalOptions,
    reporter: Progress,
    log: Callable[[str], None],
    summary: EvalSummary,
) -> bool:
    """With more than one job, the runs split into that many shares of about equal work, each evaluated by
    `evaluate_runs` in its own process (benchctl.stages.train.executors.local.in_shares), their summaries merged into
    `summary`. False (nothing done) when everything runs here."""
    work = [float(run.get("flops_per_token") or 1.0) * r for run, _, r in plan]
    parts = in_shares(
        evaluate_runs,
        [run["id"] for run, _, _ in plan],
        work,
        lambda ids: {"opts": replace(opts, select=RunSelection(run_ids=ids), jobs=1)},
        jobs=opts.jobs,
        db_path=Path(db_path),
        device_spec=opts.device,
        progress=reporter,
        log=log,
        what="evaluation",
    )
    if parts is None:
        return False
    for part in parts:
        summary.evaluated += part.evaluated
        summary.skipped += part.skipped
        summary.unavailable.update(part.unavailable)
    summary.tasks = parts[0].tasks  # standard task globs expanded the same way in every process
    return True


@contextlib.contextmanager
def _preserved(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch CPU threads (when given), then restore them and every RNG state that
    lm-eval reseeds (python, numpy, torch, CUDA)."""
    saved_rng = rng_state()
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        set_rng_state(saved_rng)
        torch.set_num_threads(saved_threads)


def evaluate_runs(
    db,
    db_path: str | os.PathLike,
    opts: EvalOptions,
    *,
    progress: bool | Progress = True,
    log: Callable[[str], None] | None = None,
) -> EvalSummary:
    """Evaluate every finished run `opts` selects on `opts.tasks` and store one row per metric in eval_results.

    `opts.n_recur` overrides the recurrence (validated for every run before any work starts); `opts.limit` passes
    lm-eval's limit (first N documents; stored as limit_n, 0 = all). Skips (run, task, n_recur, limit) already stored
    with the same task version unless `opts.force`. Tasks whose dataset cannot be loaded (hub unreachable and not
    cached) are listed in `EvalSummary.unavailable` and left out. `opts.threads` sets torch's CPU threads for the
    evaluation and restores them after (tiny models gain nothing from several threads and lose a lot on a shared
    machine). Every RNG state (python, numpy, torch, CUDA) is the same after as before. `progress`: a `Progress` to
    report on, or True / False for a default reporter / none; `log` receives the messages (default: the reporter's
    `log`). `opts.jobs` (a number or "auto", as for training): runs evaluated at once, each share of the runs in its
    own process with its share of the cores (`threads`, when given, per process).
    """
    t0 = time.perf_counter()
    reporter = as_progress(progress)
    plan = _plan(db, Path(db_path), opts)
    summary = EvalSummary(
        tasks=list(opts.tasks),
        limit=opts.limit,
        n_recur=opts.n_recur,
        runs=[
            {
                "id": r["id"],
                "arch": r["arch"],
                "variant": r.get("variant") or r["arch"],
                "preset": r["preset"],
                "seed": r["seed"],
                "n_recur": n,
            }
            for r, _, n in plan
        ],
    )
    if not _evaluate_in_jobs(db_path, plan, opts, reporter, log or reporter.log, summary):
        session = _Session(db, Path(db_path), opts, summary, reporter, log or reporter.log)
        with _preserved(opts.threads), reporter.library_bars():
            for k, (run, cfg, r) in enumerate(plan, 1):
                session.run(k, len(plan), run, cfg, r)
    wanted = set(summary.tasks)
    for run in summary.runs:
        summary.rows += [
            row
            for row in eval_tables.eval_results(db, run["id"], run["n_recur"], opts.limit_n)
            if row["task"] in wanted
        ]
    summary.seconds = time.perf_counter() - t0
    return summary
