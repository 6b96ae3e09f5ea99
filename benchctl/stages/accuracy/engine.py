"""Accuracy of reasoning-task runs: exact match of greedy answers on held-out problems, per level and test-time depth.

For every finished run on a procedural task (`tasks/`), and every difficulty level of its task (the in-distribution
level it trained on, then each harder one), the first N problems of the level's test split (the same problems for
every run: they are a function of the task's knobs, the level, the seed and the index, and never in any training
stream) are answered by greedy decoding on the fast decode path (`architectures.generate`, a static KV cache), from
`[BOS] prompt` until the end token or the level's longest answer plus one. The answer is scored by the task's exact
scorer: exact match, and the share of answer characters right position by position. Beside it, the teacher-forced
answer loss on the same problems (cross-entropy of the answer and end tokens given the true prefix).

A recurrent model is measured at every test-time depth of a list (default: 1, the powers of two and 1x to 4x its
trained depth, within its `max_n_recur`): accuracy against iterations, per level, is the logical-extrapolation
curve — does a model trained at depth r solve harder problems when it runs deeper? A plain model has one depth.

Rows are keyed by (run, level, depth, problems, seed) and written as each is measured, so a rerun skips what is
stored. Architectures that draw a random initial state (three-part, huginn) draw it from the global RNG, which is
seeded the same way before every level, so a row is reproducible.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import architectures
import tasks
from architectures.generate import DecodeReport, generate
from benchctl.core import checkpoint, taskdata
from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError, EvalError
from benchctl.core.progress import Progress, as_progress, silent
from benchctl.core.runtime import autocast_dtype, resolve_device
from benchctl.stages.accuracy import tables as acc_tables
from benchctl.stages.accuracy.options import AccuracyOptions, default_depths
from benchctl.stages.train import tables as train_tables

DECODE_BATCH = 256  # problems decoded at once: the static KV cache holds this many rows of the model's context


@dataclass
class AccuracySummary:
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    seconds: float = 0.0


@dataclass
class _RunPlan:
    row: dict[str, Any]
    cfg: RunConfig
    task: tasks.Task
    todo: list[tuple[tasks.Level, int]]  # (level, depth) still to measure
    problems: int


def depths_for(cfg: RunConfig, asked: tuple[int, ...] | None) -> list[int]:
    """The test-time depths to measure a run at: those asked (within what its model accepts), else the defaults."""
    cls = architectures.get(cfg.arch)
    trained, limit = int(cfg.model.n_recur or 1), cls.max_n_recur(cfg.model)
    if asked is None:
        return default_depths(trained, limit)
    return sorted({d for d in asked if limit is None or d <= limit} | ({trained} if limit == trained else set()))


def plan(db: Any, rows: list[dict[str, Any]], opts: AccuracyOptions) -> tuple[list[_RunPlan], int]:
    """What is still to measure per run (every check done before any work), and how many rows are stored already."""
    plans, skipped = [], 0
    for row in rows:
        cfg = RunConfig.from_json(row["config_json"])
        task = taskdata.build_task(cfg.task)
        levels = task.levels()
        if opts.levels is not None:
            known = [lv.name for lv in levels]
            unknown = [name for name in opts.levels if name not in known]
            if unknown:
                raise ConfigError(
                    f"--levels: task {task.name} has no level {', '.join(unknown)}; its levels: {', '.join(known)}"
                )
            levels = [lv for lv in levels if lv.name in opts.levels]
        n = opts.problems_for(cfg.preset)
        have = acc_tables.accuracy_keys(db, row["id"])
        wanted = [(lv, d) for d in depths_for(cfg, opts.depths) for lv in levels]  # type: ignore[arg-type]
        todo = [(lv, d) for lv, d in wanted if (lv.name, d, n, opts.seed) not in have]
        skipped += len(wanted) - len(todo)
        if todo:
            plans.append(_RunPlan(row, cfg, task, todo, n))
    return plans, skipped


def _answer_loss(model: Any, batch: torch.Tensor, n_recur: int, device: torch.device, amp: Any) -> float:
    """Teacher-forced cross-entropy over the answer and end tokens of encoded problems (n, 2, T)."""
    total, count = 0.0, 0
    for i in range(0, len(batch), DECODE_BATCH):
        x, y = batch[i : i + DECODE_BATCH, 0].to(device), batch[i : i + DECODE_BATCH, 1].to(device)
        with torch.autocast(device.type, dtype=amp) if amp else torch.autocast(device.type, enabled=False):
            _, loss = model(x, y, n_recur=n_recur, return_logits=False)
        k = int((y >= 0).sum())
        total += float(loss) * k
        count += k
    return total / max(count, 1)


def measure(
    model: Any,
    cfg: RunConfig,
    task: tasks.Task,
    level: tasks.Level,
    n_recur: int,
    n: int,
    seed: int,
    device: torch.device,
) -> dict[str, Any]:
    """Score the first `n` test problems of `level` at depth `n_recur`: one accuracy_results row (without its keys)."""
    tok = task.tokenizer()
    problems = task.problems("test", level, seed, n)
    limit = task.max_prompt_answer(level)[1] + 1  # the level's longest answer and its end token: no per-problem hint
    amp = autocast_dtype(cfg, device)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.eval.val_seed)  # random initial states (three-part, huginn): the same draw on every rerun
    report = DecodeReport()
    preds: list[str] = []
    for i in range(0, n, DECODE_BATCH):
        chunk = problems[i : i + DECODE_BATCH]
        prompts = [[tok.bos_id, *tok.encode_text(p.prompt)] for p in chunk]
        with torch.autocast(device.type, dtype=amp) if amp else torch.autocast(device.type, enabled=False):
            out = generate(
                model,
                prompts,
                max_new_tokens=limit,
                temperature=0.0,
                stop_ids=[tok.eos_id],
                n_recur=n_recur,
                report=report,
            )
        preds += [tok.decode(g.tokens) for g in out]
    scores = [task.score(p, pred) for p, pred in zip(problems, preds)]
    by: dict[str, list[int]] = {}
    for p, s in zip(problems, scores):
        key = ",".join(f"{k}={v}" for k, v in sorted(p.difficulty.items()))
        cell = by.setdefault(key, [0, 0])
        cell[0] += 1
        cell[1] += int(s["exact"])
    batch = taskdata.encode_batch(task, tok, problems, cfg.model.max_seq_len, "answer")
    torch.manual_seed(cfg.eval.val_seed)
    with torch.no_grad():
        loss = _answer_loss(model, batch, n_recur, device, amp)
    correct = sum(int(s["exact"]) for s in scores)
    return {
        "task": task.name,
        "level": level.name,
        "in_distribution": int(level.in_distribution),
        "n_recur": n_recur,
        "trained_n_recur": int(cfg.model.n_recur or 1),
        "problems": n,
        "seed": seed,
        "correct": correct,
        "accuracy": correct / n,
        "position_accuracy": sum(s["positions"] for s in scores) / n,
        "answer_loss": loss,
        "by_difficulty": json.dumps(by, sort_keys=True),
        "decode_path": report.path + (f" ({report.reason})" if report.reason else ""),
        "seconds": time.perf_counter() - t0,
    }


def measure_run(db: Any, db_path: Path, p: _RunPlan, seed: int, device: torch.device, on_row: Callable) -> None:
    """Load one run's model and measure (and store) each of its missing (level, depth) rows."""
    model, cfg, _ = checkpoint.load_model(
        checkpoint.run_dir(db_path, p.row["id"]) / checkpoint.CKPT_NAME, device, p.row
    )
    for level, depth in p.todo:
        row = {"run_id": p.row["id"], **measure(model, cfg, p.task, level, depth, p.problems, seed, device)}
        acc_tables.record_accuracy(db, row)
        on_row({**row, "arch": p.row["arch"], "run_seed": p.row["seed"]})


def accuracy_all(
    db: Any,
    db_path: str | Path,
    opts: AccuracyOptions,
    *,
    progress: bool | Progress = True,
) -> AccuracySummary:
    """Measure every finished task run `opts` selects at every level and depth asked; stored rows are skipped."""
    reporter = as_progress(progress)
    dev = resolve_device(opts.device, option="--device")
    sel = opts.select
    rows = train_tables.finished_runs(
        db,
        run_ids=sel.run_ids,
        archs=sel.archs,
        preset=sel.preset,
        none_left=EvalError,
        purpose="on a reasoning task to score",
        kind="tasks",
    )
    plans, skipped = plan(db, rows, opts)
    summary = AccuracySummary(skipped=skipped)
    total = sum(len(p.todo) for p in plans)
    bar = reporter.task("accuracy", total=total) if total else silent().task("accuracy")
    t0 = time.perf_counter()
    with bar:
        for p in plans:
            label = f"{p.row['arch']} s{p.row['seed']}"
            measure_run(
                db,
                Path(db_path),
                p,
                opts.seed,
                dev,
                on_row=lambda r, label=label: (summary.rows.append(r), bar.update(advance=1, description=label)),
            )
    summary.seconds = time.perf_counter() - t0
    return summary
