"""Tests of the TensorBoard mirror (benchctl/tblog.py), read back with TensorBoard's own event readers.

- A run of 30 steps whose trainer is killed (SIGKILL, in a subprocess) after step 20, then resumed from its
  checkpoint at step 10: every scalar series equals the values a resumed run leaves in results.db (steps <= 10 from
  the first attempt, 11..30 from the second), with no duplicated step, for both readers TensorBoard uses in Python.
- A run restarted from scratch hides everything of the earlier attempt.
- The switch: the config flag or $BENCHCTL_TENSORBOARD; a nonsense value is an error; off means no files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchctl.core.errors import ConfigError
from benchctl.stages.train import tblog

RUN = "control-tiny-s0-0123456789"


def rows_for(steps, attempt: int) -> list[dict]:
    """The metric rows a trainer writes at `steps`: train_loss, lr, grad_norm each step, val_loss every 5."""
    rows = []
    for s in steps:
        if s > 0:
            rows += [
                {"run_id": RUN, "step": s, "name": "train_loss", "value": 10.0 / (s + 1) + attempt},
                {"run_id": RUN, "step": s, "name": "lr", "value": 1e-3 * s + attempt},
                {"run_id": RUN, "step": s, "name": "grad_norm", "value": 0.5 + 0.01 * s + attempt},
            ]
        if s % 5 == 0:
            rows.append({"run_id": RUN, "step": s, "name": "val_loss", "value": 6.0 - 0.1 * s + attempt})
    return rows


def read_back(directory: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """tag -> [(step, value)] in file order, per reader."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    classic = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    pa = pea.EventAccumulator(str(directory), size_guidance={"tensors": 0})
    pa.Reload()
    plugin = {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in pa.Tensors(tag)]
        for tag in pa.Tags()["tensors"]
    }
    return {"event_accumulator": classic, "plugin_event_accumulator": plugin}


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        out.setdefault(r["name"], {})[r["step"]] = float(np.float32(r["value"]))  # TensorBoard stores float32
    return {tag: sorted(points.items()) for tag, points in out.items()}


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_killed_and_resumed_run_has_the_final_values_and_no_duplicated_steps(tmp_path):
    db_path = tmp_path / "results.db"
    # First attempt: a trainer mirrors steps 0..20 (flushed as it goes) and is killed with SIGKILL.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from benchctl.stages.train import tblog
        from tests.test_tblog import rows_for
        mirror = tblog.open_mirror({str(db_path)!r}, {RUN!r}, start_step=0, on=True)
        for step in range(0, 21):
            mirror.add_rows([r for r in rows_for([step], attempt=0)])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    directory = tblog.log_dir(db_path, RUN)
    assert directory == tmp_path / "tensorboard" / RUN

    # Resume from the checkpoint at step 10: steps 11..30 are written again, with other values.
    with tblog.open_mirror(db_path, RUN, start_step=10, on=True) as mirror:
        for step in range(11, 31):
            mirror.add_rows(rows_for([step], attempt=1))

    want = expected(rows_for(range(0, 11), attempt=0) + rows_for(range(11, 31), attempt=1))
    assert len(list(directory.glob("events.out.tfevents.*"))) == 2
    for reader, got in read_back(directory).items():
        assert set(got) == set(want), reader
        for tag, points in got.items():
            steps = [s for s, _ in points]
            assert len(steps) == len(set(steps)), f"{reader}: duplicated steps in {tag}: {steps}"
            assert sorted(points) == want[tag], f"{reader}: {tag}"


def test_a_restart_from_scratch_hides_the_earlier_attempt(tmp_path):
    db_path = tmp_path / "results.db"
    with tblog.open_mirror(db_path, RUN, start_step=0, on=True) as mirror:
        mirror.add_rows(rows_for(range(0, 16), attempt=0))
    with tblog.open_mirror(db_path, RUN, start_step=0, on=True) as mirror:
        mirror.add_rows(rows_for(range(0, 6), attempt=2))
    got = read_back(tblog.log_dir(db_path, RUN))["event_accumulator"]
    assert got == expected(rows_for(range(0, 6), attempt=2))


def test_the_switch(tmp_path, monkeypatch):
    monkeypatch.delenv(tblog.ENV, raising=False)
    assert tblog.enabled(None) is False and tblog.enabled(False) is False and tblog.enabled(True) is True
    for value, want in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv(tblog.ENV, value)
        assert tblog.enabled(None) is want, value
        assert tblog.enabled(True) is True
    monkeypatch.setenv(tblog.ENV, "maybe")
    with pytest.raises(ConfigError, match=tblog.ENV):
        tblog.enabled(None)
    off = tblog.open_mirror(tmp_path / "results.db", RUN, start_step=0, on=False)
    with off:
        off.add_rows(rows_for(range(3), attempt=0))
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError):
        tblog.TensorBoardMirror(tmp_path / "x", purge_step=-1)
