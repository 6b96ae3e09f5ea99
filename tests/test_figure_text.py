"""The committed controls report's figures against the database they draw: each figure's text and lines say what
the runs table says (a subtitle's token count, a panel's models, the control frontier), recomputed here from SQL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest
from matplotlib.text import Text

from benchctl.report.fmt import ftokens
from benchctl.stages.report import engine
from benchctl.stages.train.report_compute import lower_envelope

DB = Path(__file__).resolve().parents[1] / "docs" / "results" / "controls-small" / "results.db"


@pytest.fixture(scope="module")
def rendered():
    return engine.build(DB, "small", "controls")


def query(sql: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def per_model() -> dict[str, tuple[str, float, float]]:
    """variant -> (arch, mean tokens seen, mean final loss) of the done runs, straight from the runs table."""
    rows = query(
        "select variant, arch, avg(tokens_seen), avg(final_val_loss) from runs where status = 'done' "
        "and preset = 'small' group by variant, arch"
    )
    return {v: (a, t, f) for v, a, t, f in rows}


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_final_loss_subtitle_states_the_token_range_the_models_trained_on(rendered, per_model):
    tokens = sorted({t for _, t, _ in per_model.values()})
    assert len(tokens) > 1, "the committed database trains one model on more tokens: the case this test is for"
    text = " ".join(_texts(rendered.figures["final_val_loss.png"]))
    lo, hi = ftokens(tokens[0]), ftokens(tokens[-1])
    assert f"{lo} to {hi} tokens per run (by model)" in text
    assert f"· {hi} tokens per run" not in text


def test_the_second_half_panel_draws_every_model(rendered, per_model):
    fig = rendered.figures["val_loss_curves.png"]
    whole, zoom = fig.axes[:2]
    assert len(whole.lines) == len(per_model)
    assert len(zoom.lines) == len(per_model)
    for line in zoom.lines:  # each line starts at (or after) half its own run's last token count
        x = np.asarray(line.get_xdata(), float)
        assert x.min() >= x.max() / 2 - 1e-9


def test_the_control_frontier_is_the_running_minimum_of_the_control_models(rendered, per_model):
    """The dashed line of the compute panel: at each control model's FLOPs, the best mean loss of any control model
    with at most those FLOPs (analytic FLOPs: no control here adapts its depth)."""
    rows = query(
        "select variant, avg(flops_per_token * tokens_seen), avg(final_val_loss) from runs "
        "where status = 'done' and preset = 'small' and arch = 'control' group by variant order by 2"
    )
    best, expected = np.inf, []
    for _, x, y in rows:
        if y < best:
            best = y
            expected.append((x, y))
    if rows[-1][1] > expected[-1][0]:
        expected.append((rows[-1][1], best))
    ax = rendered.figures["loss_vs_compute.png"].axes[0]
    (line,) = [ln for ln in ax.lines if "control frontier" in ln.get_label()]
    assert line.get_drawstyle() == "steps-post"
    got = list(zip(np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)))
    assert np.asarray(got) == pytest.approx(np.asarray(expected), rel=1e-6)
    md = rendered.markdown
    assert "a model below it reaches a lower loss than every control model that used no more training compute" in md
    assert "control family (every model" not in md


def test_lower_envelope_never_rises_and_skips_a_worse_larger_model():
    x = np.array([3.0, 1.0, 2.0, 4.0, 5.0])
    y = np.array([2.5, 3.0, 3.2, 2.0, 2.2])  # the model at x=2 and x=5 are beaten by smaller ones
    xs, ys = lower_envelope(x, y)
    assert xs.tolist() == [1.0, 3.0, 4.0, 5.0]
    assert ys.tolist() == [3.0, 2.5, 2.0, 2.0]
    assert all(np.diff(ys) <= 0)
