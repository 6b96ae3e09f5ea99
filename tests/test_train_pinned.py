"""Pins the numbers the training engine produces, so a refactor of it cannot change them unnoticed.

Each architecture trains the tiny preset for a few steps on deterministic synthetic stories written by the test
itself (never the real sample, which may or may not be present), so the same numbers come out on every machine
with the same torch build. The engine's job is to reproduce the recipe exactly: these values only move when the
recipe, the architectures, the tokenizer or torch itself change, and then they are re-recorded on purpose.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from benchctl import stages
from tests.conftest import synthetic_stories

# arch -> (initial validation loss, validation loss at step 4, final validation loss at step 8)
PINNED = {
    "control": (6.24190878868103, 5.922304153442383, 5.765994310379028),
    "frailt": (6.242671489715576, 5.963929891586304, 5.804434776306152),
    "three-part": (6.259857177734375, 6.0294647216796875, 5.870211124420166),
    "relaxed": (6.242671489715576, 5.9593729972839355, 5.797022104263306),
}


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pinned_stories")
    for split, n, seed in (("train", 600, 10), ("valid", 150, 11)):
        (d / f"{split}.txt").write_text("".join(f"{s}\n<|endoftext|>\n" for s in synthetic_stories(n, seed)))
    return d


@pytest.mark.parametrize("arch", list(PINNED))
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_tiny_losses_are_pinned(arch, synthetic_dir, tmp_path, monkeypatch):
    from benchctl.core import data
    from benchctl.core.config import make_config
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    # the pins are fp32 numbers: `auto` would pick bf16 autocast on a CPU with native bf16
    monkeypatch.setattr("benchctl.core.runtime.cpu_bf16_capability", lambda: None)
    overrides = {
        "data.source": str(synthetic_dir),
        "train.max_steps": 8,
        "train.eval_interval": 4,
        "train.ckpt_interval": 4,
        "train.log_interval": 2,
        "train.warmup_steps": 2,
    }
    cfg = make_config("tiny", arch, overrides=overrides)
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    db_path = tmp_path / "results.db"
    result = train_run(cfg, prepared, stages.connect(db_path), db_path, progress=False, log=lambda *_: None)
    assert result.status == "done"
    con = sqlite3.connect(db_path)
    vals = [
        v
        for (v,) in con.execute(
            "select value from metrics where run_id = ? and name = 'val_loss' order by step", [result.run_id]
        )
    ]
    final = con.execute("select final_val_loss from runs where id = ?", [result.run_id]).fetchone()[0]
    con.close()
    assert final == vals[-1]
    assert tuple(vals) == pytest.approx(PINNED[arch], rel=1e-5)
