"""How long training takes on this machine, before it starts: what `benchctl plans show` prints for an IsoFLOP plan and
`benchctl study` before its first stage.

Each run costs its optimizer steps at the speed of its model shape (architecture, model settings, tokens per step):
the median seconds per step, evaluations included, of the finished runs of that shape and preset in results.db, else
a few eager steps of the shape timed here now. Narrow models are bound by the framework's per-op cost rather than by
their FLOPs, so each shape is measured, never scaled from another by FLOPs.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError

Shape = tuple[str, str, int]


def shape(cfg: Any) -> Shape:
    """What sets a run's step time: its architecture, its model settings (the width among them) and its tokens per
    step."""
    return cfg.arch, json.dumps(cfg.to_dict()["model"], sort_keys=True), int(cfg.tokens_per_step)


def recorded_step_seconds(db_path: Path, preset: str) -> dict[Shape, float]:
    """Median seconds per optimizer step (evaluations included) of the finished runs of `preset` in results.db, per
    shape: what a shape trained at under the load it ran with."""
    if not db_path.is_file():
        return {}
    from benchctl.report.load import open_db  # pandas: kept out of 'benchctl plans'

    conn = open_db(db_path)
    try:
        rows = conn.execute(
            "select config_json, (train_seconds + coalesce(eval_seconds, 0)) / max_steps from runs "
            "where status = 'done' and preset = ? and train_seconds > 0 and max_steps > 0",
            [preset],
        ).fetchall()
    except sqlite3.DatabaseError:  # an older file without these columns: time the steps instead
        return {}
    finally:
        conn.close()
    per: dict[Shape, list[float]] = {}
    for text, secs in rows:
        try:
            cfg = RunConfig.from_json(text)
        except ConfigError:  # a run stored by another version: its speed is not needed
            continue
        per.setdefault(shape(cfg), []).append(float(secs))
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


def done_configs(db_path: Path, preset: str) -> set[str]:
    """The configurations (as stored, `RunConfig.to_json`) of the finished runs of `preset` in results.db: runs a
    study finds done and does not train again."""
    if not db_path.is_file():
        return set()
    conn = sqlite3.connect(db_path)
    try:
        rows = conn.execute("select config_json from runs where status = 'done' and preset = ?", [preset]).fetchall()
    except sqlite3.DatabaseError:  # no runs table yet
        return set()
    finally:
        conn.close()
    return {r[0] for r in rows}


@dataclass
class Estimate:
    """Seconds per optimizer step of every shape of the runs estimated, and where each figure came from."""

    db_path: Path
    preset: str
    threads: int  # torch threads the timed steps ran with
    per_step: dict[Shape, float] = field(default_factory=dict)
    timed: set[Shape] = field(default_factory=set)  # the shapes timed now (the others: recorded in results.db)

    def run_seconds(self, cfg: Any) -> float:
        return self.per_step[shape(cfg)] * cfg.train.max_steps

    def brief(self) -> str:
        """Where the speeds come from, in a few words."""
        shapes, timed = len(self.per_step), len(self.timed)
        recorded = f"{shapes - timed} model shape(s) at their speed in {self.db_path}"
        now = f"{timed} from steps timed here now"
        if not timed:
            return recorded
        if timed == shapes:
            return f"{shapes} model shape(s), each from steps timed here now"
        return f"{recorded}, {now}"

    def total(self, cfgs: list[Any]) -> float:
        """All of `cfgs`, one after another."""
        return sum(self.run_seconds(c) for c in cfgs)

    def how(self) -> str:
        """Where the speeds come from, in words: how many shapes were recorded and how many timed."""
        timed = len(self.timed)
        return (
            f"at the speed of its finished {self.preset} runs in {self.db_path} (evaluations included) for "
            f"{len(self.per_step) - timed}, and from training steps of its own timed on this machine now (eager, "
            f"{self.threads} thread(s), evaluations not included) for {timed}"
        )


def estimate(cfgs: list[Any], db_path: Path, preset: str, threads: int | None = None) -> Estimate:
    """Step seconds for every shape of `cfgs`: recorded for `preset` in results.db, else timed now with `threads`
    torch threads (None: as many as torch has)."""
    import torch  # the steps timed below

    from benchctl.stages.train import engine

    recorded = recorded_step_seconds(db_path, preset)
    saved = torch.get_num_threads()
    est = Estimate(db_path, preset, threads or saved)
    torch.set_num_threads(est.threads)
    try:
        for cfg in cfgs:
            key = shape(cfg)
            if key in est.per_step:
                continue
            if key in recorded:
                est.per_step[key] = recorded[key]
            else:
                est.per_step[key] = engine.step_seconds(cfg)
                est.timed.add(key)
    finally:
        torch.set_num_threads(saved)
    return est


def half_the_cores() -> int:
    """The threads each of two jobs gets: a step timed with every core while other work holds them waits on its own
    threads, and reads many times slower than a job runs."""
    return max(1, (os.cpu_count() or 2) // 2)
