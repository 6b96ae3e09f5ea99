"""lm-eval's own command line, with benchctl's model registered and its bundled tasks on the include path.

`benchctl lm-eval ARGS...` runs exactly what `lm-eval ARGS...` (lm-eval 0.4.13's `HarnessCLI`) would: its parser,
its output table, its `--output_path` files, its exit codes. Two things are added before it runs:
- the "benchctl" model is registered (importing `benchctl.stages.eval.api` does that), so `--model benchctl --model_args
  checkpoint=results/runs/<id>/ckpt.pt,n_recur=8` loads a run's checkpoint;
- when a bundled task (tinystories_ppl, tinystories_ending, tinystories_names, tinystories_order, or a glob
  matching one) is asked for with a benchctl checkpoint, its documents are generated from the validation split of
  the data that run trained on (found through the config stored in the checkpoint, prepared on demand, instantly
  when cached) and their folder is put first on lm-eval's include path, before any `--include_path` of the
  user's. These are the same documents `benchctl eval` uses, so the numbers compare;
- with a benchctl checkpoint and no `--device`, the device is "auto" (CUDA when present, else CPU) instead of
  lm-eval's default "cuda:0", which fails on a machine without a GPU.

`record=True` stores the metrics in results.db (`eval_results`) the way `benchctl eval` does: keyed by the run the
checkpoint belongs to, its test-time recurrence, and the document limit, with the bundled tasks' versions.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lm_eval.evaluator as evaluator
from lm_eval._cli import HarnessCLI
from lm_eval.utils import setup_logging

from benchctl import stages
from benchctl.core import checkpoint as ckpt
from benchctl.core import data as datamod
from benchctl.core import db as dbm
from benchctl.core.config import RunConfig
from benchctl.core.errors import CheckpointError, ConfigError, DatabaseError, EvalError
from benchctl.stages.eval import api as ev  # importing it registers the "benchctl" model with lm-eval
from benchctl.stages.eval import tables as eval_tables
from benchctl.stages.eval.adapter import adapter_precision
from benchctl.stages.train import tables as train_tables


@dataclass
class _Checkpoint:
    path: Path
    run_id: str | None
    cfg: Any  # benchctl.core.config.RunConfig


def _parse(argv: list[str]):
    """lm-eval's parser and the namespace it makes of `argv` (its own compatibility rule: no subcommand = run)."""
    cli = HarnessCLI()
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        return cli, cli.parse_args()
    finally:
        sys.argv = saved


def _check_model_args(model_args: dict[str, Any]) -> None:
    """The benchctl model's own arguments, checked before lm-eval builds it (where a bad one is a traceback)."""
    try:
        adapter_precision(model_args.get("dtype"))
    except ValueError as e:
        raise ConfigError(f"--model_args {e}") from None
    raw = model_args.get("n_recur")
    if raw in (None, ""):
        return
    try:
        ok = int(raw) >= 1 and float(raw).is_integer()
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"--model_args n_recur must be an integer >= 1, got {raw!r}")


def _bundled_requested(tasks: list[str] | None) -> list[str]:
    wanted: list[str] = []
    for name in tasks or []:
        for part in str(name).split(","):
            wanted += [t for t in ev.BUNDLED_TASKS if fnmatch.fnmatchcase(t, part.strip()) and t not in wanted]
    return wanted


def _checkpoint(args) -> _Checkpoint | None:
    """The benchctl checkpoint named by --model benchctl --model_args checkpoint=..., if any."""
    if getattr(args, "model", None) != "benchctl":
        return None
    path = (getattr(args, "model_args", None) or {}).get("checkpoint")
    if not path:
        return None
    state = ckpt.load(Path(str(path)), map_location="cpu")
    return _Checkpoint(path=Path(str(path)), run_id=state.get("run_id"), cfg=RunConfig.from_json(state["config"]))


def _bundled_tasks(args, source: _Checkpoint | None, log: Callable[[str], None]) -> dict[str, str]:
    """Generate the requested bundled tasks and put their folder on the include path; their versions."""
    wanted = _bundled_requested(getattr(args, "tasks", None))
    if not wanted:
        return {}
    if source is None:
        raise ConfigError(
            f"{', '.join(wanted)} are generated from a run's validation data: pass --model benchctl "
            "--model_args checkpoint=results/runs/<run id>/ckpt.pt"
        )
    log(f"preparing {', '.join(wanted)} from the validation data of {source.path}")
    prepared = datamod.prepare(source.cfg.data, source.cfg.model.vocab_size, progress=False)
    bundled = ev.build_bundled_tasks(prepared, wanted)
    own = args.include_path
    args.include_path = [str(bundled.dir)] + ([own] if own else [])  # lm-eval's TaskManager takes a list
    return bundled.versions


@contextlib.contextmanager
def _captured_results() -> Iterator[dict[str, Any]]:
    """Keep what lm-eval's `simple_evaluate` returns while its CLI runs (the CLI only prints and saves it)."""
    box: dict[str, Any] = {}
    original = evaluator.simple_evaluate

    def keep(*a, **kw):
        box["results"] = original(*a, **kw)
        return box["results"]

    evaluator.simple_evaluate = keep
    try:
        yield box
    finally:
        evaluator.simple_evaluate = original


@dataclass
class _Record:
    db: Any
    db_path: Path
    run_id: str
    n_recur: int
    limit: int | None
    dtype: str  # the adapter's weights, as its dtype argument makes them (adapter_precision)
    dtype_reason: str


def _prepare_record(args, source: _Checkpoint | None, db_path: Path) -> _Record:
    """Check everything --record needs before lm-eval runs, so a long evaluation is never thrown away."""
    if getattr(args, "command", None) != "run" or source is None:
        raise ConfigError(
            "--record stores the results of a benchctl checkpoint: pass --model benchctl "
            "--model_args checkpoint=results/runs/<run id>/ckpt.pt"
        )
    if getattr(args, "predict_only", False):
        raise ConfigError("--record stores metrics, and --predict_only computes none; drop one of them")
    limit = args.limit
    if limit is not None and (limit < 1 or not float(limit).is_integer()):
        raise ConfigError(f"--record needs --limit as a number of documents (results are keyed by it), got {limit}")
    if getattr(args, "samples", None):
        raise ConfigError("--record cannot key results chosen with --samples; use --limit N")
    if not source.run_id:
        raise CheckpointError(f"{source.path} does not name its run; it cannot be recorded")
    db = stages.connect(db_path, create=False)
    if train_tables.get_run(db, source.run_id) is None:
        raise DatabaseError(
            f"run {source.run_id} (from {source.path}) is not in {db_path}; pass the --db it was trained into"
        )
    raw = (args.model_args or {}).get("n_recur")
    n_recur = int(raw) if raw not in (None, "") else int(source.cfg.model.n_recur)
    dtype, dtype_reason = adapter_precision((args.model_args or {}).get("dtype"))
    return _Record(
        db=db,
        db_path=db_path,
        run_id=source.run_id,
        n_recur=n_recur,
        limit=None if limit is None else int(limit),
        dtype=dtype,
        dtype_reason=dtype_reason,
    )


def _store(rec: _Record, results: dict[str, Any], versions: dict[str, str]) -> int:
    config = results.get("config") or {}
    try:
        batch_size = int(config.get("batch_size"))
    except (TypeError, ValueError):  # "auto" or absent: the adapter's own default applied
        batch_size = ev.DEFAULT_BATCH_SIZE
    rows = ev.result_rows(
        results,
        rec.run_id,
        rec.n_recur,
        rec.limit,
        batch_size,
        versions,
        dtype=rec.dtype,
        dtype_reason=rec.dtype_reason,
    )
    tasks = {r["task"] for r in rows} | set(results.get("results", {}))
    eval_tables.replace_eval_results(rec.db, rows, {(rec.run_id, t) for t in tasks}, rec.n_recur, rec.limit or 0)
    return len(rows)


def run(
    argv: list[str],
    *,
    record: bool = False,
    db_path: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Run lm-eval's command line on `argv` (see the module docstring); argparse errors exit as lm-eval's do."""
    setup_logging()
    cli, args = _parse(argv)
    source = _checkpoint(args) if getattr(args, "command", None) in ("run", "validate") else None
    if source is not None:
        _check_model_args(args.model_args or {})
    if source is not None and getattr(args, "device", None) is None and not getattr(args, "config", None):
        args.device = "auto"  # lm-eval's default is cuda:0; benchctl's adapter takes CUDA when present, else CPU
    rec = _prepare_record(args, source, Path(db_path) if db_path else dbm.default_path()) if record else None
    versions = _bundled_tasks(args, source, log) if hasattr(args, "tasks") else {}
    with _captured_results() as box:
        try:
            cli.execute(args)
        except ValueError as e:  # lm-eval's own word for a task name it does not know
            if not str(e).startswith("Tasks not found"):
                raise
            raise ConfigError(
                f"lm-eval: {e}; 'benchctl lm-eval ls tasks' lists the tasks (bundled: {', '.join(ev.BUNDLED_TASKS)})"
            ) from None
    if rec is not None:
        if box.get("results") is None:
            raise EvalError("lm-eval returned no results to record")
        n = _store(rec, box["results"], versions)
        log(
            f"recorded {n} metric rows for run {rec.run_id} (n_recur {rec.n_recur}, limit {rec.limit or 'none'}) "
            f"in {rec.db_path} (table eval_results)"
        )
