"""IsoFLOP plans and the report's Scaling section: the plan kind (grid, width rule, steps from the budget, schedule
scaled with the steps, epochs refused beyond max_epochs), its validation errors, `benchctl plans show` for it, the
parabola and power-law fits on synthetic runs with a known optimum, and the section rendered from a database."""

from __future__ import annotations

import io
import math
import sqlite3
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from scipy.stats import t as stats_t

from benchctl import plans, stages
from benchctl.cli import main
from benchctl.core import accounting, stats
from benchctl.core.config import make_config, run_id
from benchctl.core.errors import ConfigError
from benchctl.stages.report import engine as report_engine
from benchctl.stages.train import report_scaling as sc
from benchctl.stages.train import tables as train_tables
from tests.conftest import real_tinystories
from tests.fixtures_db import layout_data_dir

ISO = """name = "iso"
description = "a small grid"
kind = "isoflop"
preset = "tiny"
seeds = [0]
budgets = [2e9, 1e9]
widths = [16, 32, 48]

[[variant]]
name = "control"
arch = "control"

[[variant]]
name = "looped"
arch = "frailt"
set = ["model.n_recur=2"]
"""


def write(tmp_path, text: str):
    p = tmp_path / "iso.toml"
    p.write_text(text)
    return p


# --------------------------------------------------------------------------------------------------------------------
# The plan


def test_the_grid_sets_widths_steps_and_a_scaled_schedule(tmp_path):
    plan = plans.load(write(tmp_path, ISO))
    assert plan.kind == "isoflop" and plan.isoflop is not None and plan.isoflop.budgets == (1e9, 2e9)
    runs = plans.resolve(plan, "tiny", [0])
    assert [r.variant for r in runs][:4] == ["control-w16-1e9", "control-w32-1e9", "control-w48-1e9", "looped-w16-1e9"]
    assert len(runs) == 2 * 3 * 2
    base = make_config("tiny", "control")
    for r in runs:
        v = next(v for v in plan.variants if v.name == r.variant)
        cfg, point = r.cfg, v.point
        assert point is not None and cfg.model.dim == point.width
        assert cfg.model.n_heads == cfg.model.n_kv_heads == point.width // 16  # the tiny preset's head width
        assert (
            cfg.model.hidden_dim == make_config("tiny", cfg.arch, overrides={"model.dim": point.width}).model.hidden_dim
        )
        assert cfg.model.n_layers == 4 and (cfg.arch != "frailt" or cfg.model.n_recur == 2)
        per_step = accounting.training_flops(cfg) / cfg.train.max_steps
        assert abs(accounting.training_flops(cfg) - point.budget) <= per_step / 2 + 1e-6  # the nearest step
        share = base.train.warmup_steps / base.train.max_steps
        assert cfg.train.warmup_steps == min(cfg.train.max_steps, max(1, round(cfg.train.max_steps * share)))
        assert cfg.train.eval_interval == max(1, round(cfg.train.max_steps * base.train.eval_interval / 30))


@pytest.mark.slow  # trains the small preset's 4096-piece tokenizer
def test_the_builtin_isoflop_plan_fits_the_sample_at_small():
    """At least 3 budgets, 4 widths, the study's four; no run beyond max_epochs of the bundled sample at small. The
    plan's budgets are sized for that sample's real text, so synthetic stories cannot stand in for it."""
    from benchctl.core import data

    tinystories_dir = real_tinystories()
    if tinystories_dir is None:
        pytest.skip("needs the TinyStories sample in $BENCHCTL_TEST_DATA")

    plan, preset, runs = plans.planned_runs("isoflop", "small", None, [0], {"data.source": str(tinystories_dir)})
    iso = plan.isoflop
    assert iso is not None and preset == "small" and len(iso.budgets) >= 3 and len(iso.widths) >= 4
    assert {v.arch for v in iso.archs} >= {"control", "frailt", "three-part", "relaxed"}
    cfg = runs[0].cfg
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    plans.check_epochs(plan, runs, prepared.n_train_tokens)  # raises if any run is beyond max_epochs
    assert max(plans.epochs(r.cfg, prepared.n_train_tokens) for r in runs) <= iso.max_epochs


def test_runs_beyond_max_epochs_are_refused(tmp_path):
    plan = plans.load(write(tmp_path, ISO.replace("widths =", "max_epochs = 0.5\nwidths =")))
    runs = plans.resolve(plan, "tiny", [0])
    most = max(r.cfg.train.max_steps * r.cfg.tokens_per_step for r in runs)
    plans.check_epochs(plan, runs, most * 2)
    with pytest.raises(ConfigError, match=r"more than max_epochs = 0.5 times \(e.g. control-w16-2e9"):
        plans.check_epochs(plan, runs, most)


@pytest.mark.parametrize(
    "edit,says",
    [
        (("budgets = [2e9, 1e9]", "budgets = []"), "'budgets' must be a non-empty list of positive numbers"),
        (("budgets = [2e9, 1e9]", 'budgets = ["1e9"]'), "'budgets' must be a non-empty list"),
        (("budgets = [2e9, 1e9]\n", ""), "an IsoFLOP plan needs 'budgets'"),
        (("widths = [16, 32, 48]", "widths = [16, 16]"), "'widths' lists a value twice"),
        (("widths = [16, 32, 48]", "widths = [16, 24]\nhead_dim = 16"), "24 is not"),
        (("widths = [16, 32, 48]", "widths = [16, 24]"), "width 24 is not a multiple of the head width 16"),
        (('kind = "isoflop"', 'kind = "grid"'), "'kind' must be"),
        (('kind = "isoflop"\n', ""), "unknown key 'budgets' (an IsoFLOP plan's key"),
        (('set = ["model.n_recur=2"]', 'set = ["model.dim=64"]'), "'model.dim' is set by the width"),
        (('set = ["model.n_recur=2"]', "steps = 10"), "'steps' is not allowed (an IsoFLOP plan sets every run's"),
        (('set = ["model.n_recur=2"]', 'from = "control"'), "'from' is not allowed"),
        (("budgets = [2e9, 1e9]", "budgets = [1e9, 1.0001e9]"), "agree to three significant digits"),
        (("widths = [16, 32, 48]", "widths = [16]\nmax_epochs = -1"), "'max_epochs' must be a positive number"),
    ],
)
def test_a_bad_isoflop_plan_is_one_line_and_exit_2(tmp_path, capsys, edit, says):
    path = write(tmp_path, ISO.replace(*edit))
    with pytest.raises(ConfigError) as e:
        plan = plans.load(path)
        plans.resolve(plan, "tiny", [0])
    msg = str(e.value)
    assert "\n" not in msg and says in msg, msg
    with pytest.raises(SystemExit) as ex:
        data = layout_data_dir(tmp_path)  # passes the early --data check: the plan's error comes first
        main(["plans", "show", str(path), "--data", str(data), "--db", str(tmp_path / "x.db")])
    err = capsys.readouterr().err.strip()
    assert ex.value.code == 2 and says.split("(")[0].strip() in " ".join(err.split()), err


def test_a_width_key_on_the_command_line_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'model.n_heads' is set by the IsoFLOP plan's widths"):
        plans.planned_runs(str(write(tmp_path, ISO)), None, None, [0], {"model.n_heads": "4"})


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_plans_show_isoflop_lists_every_run(tmp_path, capsys, tinystories_dir, monkeypatch):
    """Width, heads, parameters, tokens, epochs over the prepared data and the time estimate: a shape with finished
    runs in the database at their speed, every other shape from one step of its own timed here."""
    from tests.fixtures_db import build_fixture_db

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    # Wide enough for every column. The console reads $COLUMNS only when it is made, at import, and an xdist
    # worker fixes its width then (80 columns), so the width is set on the console this command prints with.
    from benchctl.stages.cli import console

    monkeypatch.setattr(console, "_width", 250)
    db = build_fixture_db(tmp_path / "r.db", archs=["control"], seeds=[0], judge=False, evals=False)
    path = write(tmp_path, ISO)
    with pytest.raises(SystemExit) as e:
        main(["plans", "show", str(path), "--data", str(tinystories_dir), "--db", str(db)])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    plan = plans.load(path)
    runs = plans.resolve(plan, "tiny", [0], {"data.source": str(tinystories_dir)})
    from benchctl.core import data

    split = data.prepare(runs[0].cfg.data, runs[0].cfg.model.vocab_size, progress=False).n_train_tokens
    lines = out.splitlines()
    for r in runs:
        row = next(line for line in lines if line.split() and line.split()[0] == r.variant).split()
        d = accounting.describe(r.cfg)
        tokens = r.cfg.train.max_steps * r.cfg.tokens_per_step
        assert row[2] == str(r.cfg.model.dim) and row[3] == str(r.cfg.model.n_heads)
        assert row[7] == f"{d['total_params']:,}" and row[8] == f"{d['effective_params']:,}"
        assert row[9] == f"{tokens:,}" and row[10] == f"{tokens / split:.2f}"
    assert "12 runs per seed" in out and f"{split:,}-token training split" in out
    assert "estimated training time" in out
    shapes = len({(r.cfg.arch, r.cfg.model.dim) for r in runs})  # one variant per architecture here
    assert f"each of the {shapes} model shapes (architecture, width, settings)" in " ".join(out.split())


def test_recorded_step_seconds_are_per_shape_medians(tmp_path):
    """What a finished run's shape trained at: (train + eval seconds) / steps, the median over its runs, keyed by
    architecture, model settings and tokens per step."""
    from benchctl.core.config import RunConfig
    from benchctl.stages.train.estimate import recorded_step_seconds as _recorded_step_seconds
    from benchctl.stages.train.estimate import shape as _shape
    from tests.fixtures_db import build_fixture_db

    db = build_fixture_db(tmp_path / "r.db", archs=["control", "frailt"], seeds=[0, 1, 2], judge=False, evals=False)
    got = _recorded_step_seconds(db, "tiny")
    conn = sqlite3.connect(db)
    rows = conn.execute("select config_json, train_seconds, eval_seconds, max_steps from runs where status = 'done'")
    want: dict = {}
    for text, train_s, eval_s, steps in rows:
        cfg = RunConfig.from_json(text)
        want.setdefault(_shape(cfg), []).append((train_s + (eval_s or 0)) / steps)
    assert got and set(got) == set(want)
    assert all(got[k] == sorted(v)[len(v) // 2] for k, v in want.items())
    assert _recorded_step_seconds(tmp_path / "none.db", "tiny") == {} and _recorded_step_seconds(db, "paper") == {}


# --------------------------------------------------------------------------------------------------------------------
# The fits


def synthetic(n_star: float, l_star: float, widths: list[float], seeds: int, noise: float, rng) -> pd.DataFrame:
    """Runs whose loss is a parabola in ln N with its minimum at (n_star, l_star), plus Gaussian noise."""
    rows = []
    for i, n in enumerate(widths):
        for s in range(seeds):
            loss = l_star + 0.08 * (math.log(n) - math.log(n_star)) ** 2 + rng.normal(0, noise)
            rows.append({"width": i, "params": n, "final": loss, "seed": s})
    return pd.DataFrame(rows)


def test_the_fit_finds_a_known_optimum_within_10_percent():
    """Recovered wherever it lies inside the widths; ok only where two widths or more lie on each side of it."""
    rng = np.random.default_rng(7)
    sizes = [1e5, 2e5, 4e5, 8e5, 1.6e6]
    for truth, status in ((1.8e5, sc.EDGE), (4e5, sc.OK), (9e5, sc.EDGE)):
        pts = synthetic(truth, 3.0, sizes, seeds=3, noise=0.01, rng=rng)
        o = sc.optimum(pts)
        assert o.status == status and o.has_vertex and o.fit is not None, (truth, o.status, o.reasons)
        assert abs(o.fit.n_star / truth - 1) < 0.10, (truth, o.fit.n_star)
        assert abs(o.fit.l_star - 3.0) < 0.02
        assert o.n_lo is not None and o.n_hi is not None and o.n_lo <= o.fit.n_star <= o.n_hi
        assert o.l_lo is not None and o.l_hi is not None and o.l_lo <= o.fit.l_star <= o.l_hi


def test_a_minimum_at_the_edge_or_a_downward_parabola_is_degenerate():
    rng = np.random.default_rng(1)
    sizes = [1e5, 2e5, 4e5, 8e5]
    below = sc.optimum(synthetic(2e4, 3.0, sizes, seeds=2, noise=0.0, rng=rng))
    assert below.status == sc.DEGENERATE and not below.has_vertex and below.n_lo is None
    assert below.fit is not None and "smallest width" in str(below.fit.problem)
    above = sc.optimum(synthetic(5e6, 3.0, sizes, seeds=2, noise=0.0, rng=rng))
    assert not above.ok and above.fit is not None and "largest width" in str(above.fit.problem)
    down = sc.fit_parabola(np.array(sizes), np.array([3.0, 3.2, 3.2, 3.0]))
    assert down is not None and "opens downward" in str(down.problem)
    assert sc.fit_parabola(np.array([1e5, 2e5, 1e5]), np.array([3.0, 2.9, 3.1])) is None  # two sizes: no parabola


def test_a_comparison_without_an_optimum_says_which_side_lacks_one_and_why():
    rng = np.random.default_rng(2)
    sizes = [1e5, 2e5, 4e5, 8e5]
    two_widths = sc.Point(sc.optimum(synthetic(3e5, 3.0, sizes[:2], seeds=2, noise=0.0, rng=rng)), 1e9, None, {})
    edge = sc.Point(sc.optimum(synthetic(2e4, 3.0, sizes, seeds=2, noise=0.0, rng=rng)), 1e9, None, {})
    assert two_widths.opt.fit is None and edge.opt.fit is not None and not edge.opt.ok
    assert sc._at_budget("trm", 1e9, two_widths, edge) == (
        "At C = 1e9 there is no comparison: trm has no fit (fewer than 3 widths) and the fit of the control is "
        "degenerate."
    )
    assert sc._at_budget("trm", 1e9, two_widths, two_widths) == (
        "At C = 1e9 there is no comparison: neither trm nor the control has a fit (fewer than 3 widths)."
    )


def test_the_power_law_recovers_its_exponent_and_crossings_stay_in_range():
    c = np.array([1e12, 2e12, 4e12, 8e12])
    law = sc.fit_power_law(list(c), list(2.0 + 1.5 * (c / 1e12) ** -0.4))
    assert law is not None and abs(law.alpha - 0.4) < 0.02 and abs(law.e - 2.0) < 0.02
    other = sc.fit_power_law(list(c), list(1.8 + 1.8 * (c / 1e12) ** -0.4))  # above at 1e12, below from ~2.8e12
    assert other is not None
    lo, hi, at = sc.crossing(other, law)
    assert (lo, hi) == (1e12, 8e12) and len(at) == 1 and 2.5e12 < at[0] < 3.1e12
    assert sc.fit_power_law([1e12, 2e12], [3.0, 2.9]) is None
    # three parameters through three budgets pass exactly: no fit is offered
    assert sc.fit_power_law(list(c[:3]), list(2.0 + 1.5 * (c[:3] / 1e12) ** -0.4)) is None


SIZES = [1e5 * 2**i for i in range(5)]  # equally spaced in ln N


def by_seed(losses: list[np.ndarray], runs_per_seed: int = 1) -> pd.DataFrame:
    """Runs at SIZES: seed s has `runs_per_seed` runs at each size, all with losses[s] there (they agree)."""
    rows = []
    for s, ys in enumerate(losses):
        for i, (n, y) in enumerate(zip(SIZES, ys)):
            rows += [{"width": i, "params": n, "final": float(y), "seed": s}] * runs_per_seed
    return pd.DataFrame(rows)


def parabola(vertex: float, l_star: float = 3.0) -> np.ndarray:
    """Losses at SIZES of a parabola in ln N with its minimum at ln N = vertex."""
    return l_star + 0.1 * (np.log(SIZES) - vertex) ** 2


T1 = float(stats_t.ppf(0.975, 1))  # two seeds: one degree of freedom


@pytest.mark.parametrize("runs_per_seed", [1, 20])
def test_the_interval_is_as_wide_as_the_seeds_differ_however_many_runs_each_has(runs_per_seed):
    """Runs of one seed share its data stream: here they agree exactly and the two seeds differ, by a shift of the
    loss or of the optimum's size. The interval is the t over the two seeds' optima (one degree of freedom), the
    same with 1 or 20 runs per seed and size; a resampling of runs would shrink it as they grow."""
    mid = math.log(SIZES[2])
    shifted = sc.optimum(by_seed([parabola(mid) - 0.02, parabola(mid) + 0.02], runs_per_seed))
    assert shifted.ok and shifted.fit is not None and shifted.l_lo is not None and shifted.l_hi is not None
    assert shifted.fit.l_star == pytest.approx(3.0)
    assert shifted.l_hi - shifted.l_lo == pytest.approx(2 * T1 * 0.02)  # the two seeds' L*: 3 ± 0.02
    assert shifted.n_lo == pytest.approx(shifted.fit.n_star) and shifted.n_hi == pytest.approx(shifted.fit.n_star)
    moved = sc.optimum(by_seed([parabola(mid - 0.1), parabola(mid + 0.1)], runs_per_seed))
    assert moved.fit is not None and moved.n_lo is not None and moved.n_hi is not None
    assert math.log(moved.fit.n_star) == pytest.approx(mid)
    assert math.log(moved.n_hi / moved.n_lo) == pytest.approx(2 * T1 * 0.1)  # the two seeds' ln N*: mid ± 0.1


def test_a_difference_from_the_control_is_paired_by_seed():
    """At a seed both architectures trained on the same data stream: a seed that raises both losses alike cancels
    in the difference, one that moves them apart widens it by as much."""
    mid = math.log(SIZES[2])
    control = sc.optimum(by_seed([parabola(mid) - 0.02, parabola(mid) + 0.02]))
    alike = sc.optimum(by_seed([parabola(mid, 3.2) - 0.02, parabola(mid, 3.2) + 0.02]))
    apart = sc.optimum(by_seed([parabola(mid, 3.2) + 0.02, parabola(mid, 3.2) - 0.02]))
    assert control.l_hi is not None and control.l_lo is not None
    assert control.l_hi - control.l_lo == pytest.approx(2 * T1 * 0.02)  # each L* alone is that uncertain
    same = stats.seed_ci(0.2, [(1.0, alike.seeds_l), (-1.0, control.seeds_l)])
    assert same.paired and same.lo == pytest.approx(0.2) and same.hi == pytest.approx(0.2)
    opposite = stats.seed_ci(0.2, [(1.0, apart.seeds_l), (-1.0, control.seeds_l)])
    assert opposite.hi is not None and opposite.hi - 0.2 == pytest.approx(T1 * 0.04)
    c, a = sc.Point(control, 1e9, None, {}), sc.Point(alike, 1e9, None, {})
    assert sc._at_budget("frailt", 1e9, a, c) == (
        "At C = 1e9 its compute-optimal loss is higher than the control's by 0.200 (95% CI 0.200 to 0.200)."
    )


def test_edge_and_misfit_fits_are_told_apart_from_ok_ones():
    """Edge: the minimum in the outermost interval of widths, or a width whose absence leaves no minimum; misfit:
    L* above the lowest width mean by more than the seeds' noise; only ok fits are relied on."""
    near = sc.optimum(by_seed([parabola(math.log(1.6e5)), parabola(math.log(1.6e5)) + 0.01]))
    # (and without the smallest width, which alone shows the loss rising below it, there is no minimum at all)
    assert near.status == sc.EDGE and near.reasons[0] == "the minimum lies between the two smallest widths"
    assert near.has_vertex and not near.ok
    far = sc.optimum(by_seed([parabola(math.log(1.3e6)), parabola(math.log(1.3e6)) + 0.01]))
    assert far.status == sc.EDGE and far.reasons[0] == "the minimum lies between the two largest widths"
    # the minimum is inside (between the third and fourth widths), but without the smallest width there is none
    steep = np.array([3.5, 3.0, 3.02, 3.06, 3.12])
    fragile = sc.optimum(by_seed([steep, steep + 0.01]))
    assert fragile.fit is not None and SIZES[2] < fragile.fit.n_star < SIZES[3]
    assert fragile.status == sc.EDGE and fragile.reasons == ("leaving out width 0 makes it degenerate",)
    # a V the parabola cannot follow down: its minimum 3.074 sits above the middle width's 3.005
    v = np.array([3.4, 3.2, 3.0, 3.2, 3.4])
    misfit = sc.optimum(by_seed([v, v + 0.01]))
    assert misfit.status == sc.MISFIT and misfit.has_vertex
    assert misfit.reasons == ("L* 3.074 lies above the width-2 mean 3.005 beyond the seeds' noise",)
    # the same V with seeds that disagree by 0.1 at every width: the excess is within their noise
    wiggle = np.array([0.05, -0.05, 0.05, -0.05, 0.05])
    assert sc.optimum(by_seed([v + wiggle, v - wiggle])).status == sc.OK
    # one seed shows no noise to weigh the excess against: any excess counts
    assert sc.optimum(by_seed([v])).status == sc.MISFIT


def test_exponents_come_from_a_line_in_log_compute_with_a_seed_interval():
    """ln N* = k + a·ln C through budgets doubling, N* growing 1.3× per doubling; a seed that shifts every
    budget's optimum alike moves the intercept, not the slope."""
    cs = [1e9, 2e9, 4e9]
    log_n = [math.log(1e5 * 1.3**i) for i in range(3)]
    same_shift = [{0: -0.05, 1: 0.05}] * 3
    fit = sc.fit_slope(cs, log_n, same_shift)
    assert fit is not None and fit.slope == pytest.approx(math.log(1.3) / math.log(2))
    assert fit.lo == pytest.approx(fit.slope) and fit.hi == pytest.approx(fit.slope)
    tilted = sc.fit_slope(cs, log_n, [{0: -0.05, 1: 0.05}, {0: 0.0, 1: 0.0}, {0: 0.05, 1: -0.05}])
    assert tilted is not None and tilted.lo is not None and tilted.hi is not None
    # seed 0's optima rise 0.1 more over the two doublings than the pooled ones, seed 1's 0.1 less: their slopes
    # are a ± 0.1 / ln 2, and the t over two seeds is as wide as that
    assert (tilted.hi - tilted.lo) / 2 == pytest.approx(T1 * 0.1 / math.log(2))
    assert sc.fit_slope(cs[:2], log_n[:2], same_shift[:2]) is None  # two points: a line through them says nothing


# --------------------------------------------------------------------------------------------------------------------
# The report section, from a database


def _iso_db(
    tmp_path,
    degenerate_at: float | None = None,
    short: float = 1.0,
    edge_at: float | None = None,
    spent: dict[str, float] | None = None,
    curves: bool = False,
):
    """A results.db of plan `iso`'s grid (2 architectures x 5 widths x 3 budgets x 2 seeds), final losses from a
    parabola in ln N whose optimum grows with the budget as N* ∝ C^(ln 1.3 / ln 2), between the second and the
    fourth width; `degenerate_at` puts one budget's frailt optimum below the smallest width, `edge_at` between the
    two smallest; `short` scales every run's tokens (below 0.9: every run misses its budget); `spent` records each
    architecture's runs as spending that share of their budget (an adaptive depth); `curves` writes validation
    curves."""
    db = stages.connect(tmp_path / "r.db")
    rng = np.random.default_rng(3)
    widths, budgets = [16, 32, 48, 64, 96], [1e9, 2e9, 4e9]
    plan_rows, metrics = [], []
    with db.atomic():
        for b_i, budget in enumerate(budgets):
            for name, arch, offset in (("control", "control", 0.0), ("frailt", "frailt", -0.05)):
                for w in widths:
                    sets = {"model.dim": w, "model.n_heads": w // 16, "model.n_kv_heads": w // 16}
                    d = accounting.describe(make_config("tiny", arch, 0, sets))
                    n = float(d["total_params"])
                    best = 1e5 * 1.3**b_i
                    if arch == "frailt" and budget == degenerate_at:
                        best = 1e3
                    if arch == "frailt" and budget == edge_at:
                        best = 3e4
                    for seed in (0, 1):
                        c = make_config("tiny", arch, seed, sets)
                        rid = run_id(c, "fp") + f"-{b_i}"
                        tokens = int(short * budget / d["flops_per_token"])
                        loss = 4.0 - 0.2 * b_i + offset + 0.1 * (math.log(n) - math.log(best)) ** 2
                        steps = 10 + b_i
                        db["runs"].insert(
                            {
                                "id": rid,
                                "arch": arch,
                                "variant": f"{name}-w{w}-{b_i}",
                                "preset": "tiny",
                                "seed": seed,
                                "status": "done",
                                "config_json": replace(c, train=replace(c.train, max_steps=steps)).to_json(),
                                "data_fingerprint": "fp",
                                "n_params": int(n),
                                "effective_params": int(d["effective_params"]),
                                "flops_per_token": d["flops_per_token"],
                                "tokens_seen": tokens,
                                "step": steps,
                                "data_train_tokens": 100_000,
                                "final_val_loss": loss + rng.normal(0, 0.003),
                                # the control's runs timed on one machine, frailt's on another with two jobs
                                "train_seconds": 50.0 * (b_i + 1),
                                "warmup_seconds": 1.0,
                                "eval_seconds": 9.0,
                                "device_name": "CPU A" if arch == "control" else "CPU B",
                                "concurrent_jobs": 1 if arch == "control" else 2,
                                "dtype": "float32",
                            }
                        )
                        if spent and arch in spent:
                            value = spent[arch] * budget
                            metrics.append({"run_id": rid, "step": steps, "name": "train_flops", "value": value})
                        if curves:
                            for k in range(steps + 1):
                                metrics.append(
                                    {
                                        "run_id": rid,
                                        "step": k,
                                        "name": "val_loss",
                                        "value": loss + 3.0 * (1 - k / steps),
                                        "tokens": tokens * k // steps,
                                    }
                                )
                        plan_rows.append(
                            {
                                "plan": "iso",
                                "variant": f"{name}-w{w}-{plans.budget_label(budget)}",
                                "preset": "tiny",
                                "seed": seed,
                                "run_id": rid,
                                "plan_path": "iso.toml",
                                "plan_sha256": "ab" * 32,
                                "isoflop_arch": name,
                                "isoflop_width": w,
                                "isoflop_budget": budget,
                            }
                        )
        if metrics:
            db["metrics"].insert_all(metrics, pk=("run_id", "step", "name"), alter=True)
    train_tables.record_plan_runs(db, plan_rows)
    db.conn.close()
    return tmp_path / "r.db"


def _scaling(db, *args) -> str:
    md = report_engine.build(db, "tiny", "iso", only_plan=True).markdown
    return md[md.index("\n## Scaling\n") :]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_scaling_section_reports_optima_fits_and_sentences(tmp_path):
    rendered = report_engine.build(_iso_db(tmp_path), "tiny", "iso", only_plan=True)
    md = rendered.markdown
    sec = md[md.index("\n## Scaling\n") :]
    assert "isoflop.png" in rendered.figures
    assert "### Compute-optimal size and loss" in sec and "### Scaling with compute" in sec
    assert sec.count("| ok |") == 6  # 2 architectures x 3 budgets, every optimum inside the widths
    # frailt sits 0.05 below the control at every budget: a difference its CI resolves
    line = next(x for x in sec.splitlines() if x.startswith("- **frailt**"))
    assert line.count("compute-optimal loss is lower than the control's by 0.05") == 3, line
    assert "do not cross within the compute both spent (1e9 to 4e9)" in line
    assert "through 3 its 3 parameters are exact" in sec
    d = accounting.describe(
        make_config("tiny", "control", 0, {"model.dim": 16, "model.n_heads": 1, "model.n_kv_heads": 1})
    )
    epochs = int(1e9 / d["flops_per_token"]) / 100_000
    row = next(x for x in sec.splitlines() if x.startswith("| 1e9 | control | 16 |"))
    assert f"| {epochs:.2f} |" in row  # every point states its epochs
    # the grid's time, per machine and jobs: 10 runs per architecture and budget of 60, 110 and 160 s each
    hours = 10 * (60 + 110 + 160) / 3600
    assert f"Time: these 60 runs took {2 * hours:.2f} h of their own time" in sec
    assert f"30 runs, {hours:.2f} h on CPU A in float32, one job at a time (about {hours:.2f} h of wall time)" in sec
    assert f"30 runs, {hours:.2f} h on CPU B in float32, 2 jobs at a time (about {hours / 2:.2f} h of wall time)" in sec
    assert "Mixed precision" not in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_one_machine_s_time_is_one_clause(tmp_path):
    db = _iso_db(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET device_name = 'CPU B', concurrent_jobs = 2")
    sec = report_engine.build(db, "tiny", "iso", only_plan=True).markdown
    hours = 20 * (60 + 110 + 160) / 3600
    assert (
        f"these 60 runs took {hours:.2f} h of their own time (optimizer steps, warm-up and evaluations; start-up "
        f"and checkpoints not counted) on CPU B in float32, 2 jobs at a time (about {hours / 2:.2f} h of wall time)."
    ) in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_grid_that_mixes_precisions_says_so(tmp_path):
    db = _iso_db(tmp_path)
    with sqlite3.connect(db) as conn:  # the frailt runs resumed on a machine with native bf16
        conn.execute("UPDATE runs SET dtype = 'bfloat16' WHERE arch = 'frailt'")
    sec = report_engine.build(db, "tiny", "iso", only_plan=True).markdown
    assert "**Mixed precision**: the grid's runs trained in bfloat16 (30 runs) and float32 (30 runs)" in sec
    assert "h on CPU B in bfloat16, 2 jobs at a time" in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_degenerate_point_is_said_and_not_used(tmp_path):
    rendered = report_engine.build(_iso_db(tmp_path, degenerate_at=2e9), "tiny", "iso", only_plan=True)
    sec = rendered.markdown[rendered.markdown.index("\n## Scaling\n") :]
    row = next(x for x in sec.splitlines() if x.startswith("| 2e9 | frailt |") and "degenerate" in x)
    assert "the minimum is at the smallest width or below it" in row
    # the other five optima are inside their widths, beside the degenerate one in the same table
    assert sec.count("| ok |") == 5 and "degenerate: nan" not in sec
    line = next(x for x in sec.splitlines() if x.startswith("- **frailt**"))
    assert "At C = 2e9 there is no comparison: the fit of frailt is degenerate." in line
    # frailt's fits against compute need the degenerate budget
    assert "| frailt | 2 | - | - | - | - | - | - | needs 4 budgets with an ok fit |" in sec


def _optimum_row(sec: str, budget: str, name: str) -> str:
    start = sec.index("### Compute-optimal size and loss")
    return next(x for x in sec[start:].splitlines() if x.startswith(f"| {budget} | {name} |"))


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_an_edge_point_is_shown_but_anchors_nothing(tmp_path):
    """frailt's optimum at 2e9 lies between its two smallest widths: its N* and L* are listed with the reason, and
    neither its exponents nor the comparison at that budget use it."""
    sec = _scaling(_iso_db(tmp_path, edge_at=2e9))
    row = _optimum_row(sec, "2e9", "frailt")
    assert "| edge: the minimum lies between the two smallest widths" in row
    assert row.split(" | ")[4] != "-" and row.split(" | ")[8] != "-"  # N* and L* are given
    line = next(x for x in sec.splitlines() if x.startswith("- **frailt**"))
    assert "At C = 2e9 there is no comparison: the fit of frailt is at the edge of its widths." in line
    assert "| frailt | 2 | - | - | - | - | - | - | needs 4 budgets with an ok fit |" in sec
    assert sec.count("| ok |") == 5


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_adaptive_runs_are_placed_at_the_flops_they_spent(tmp_path):
    """frailt's runs recorded spending 0.8 of their budgets: its optima sit at 0.8 C in the fits against compute,
    the comparison at the nominal budget says so, and the fits are compared over the compute both spent."""
    sec = _scaling(_iso_db(tmp_path, spent={"frailt": 0.8, "control": 1.0}))
    assert "| 8e8 (0.80) |" in _optimum_row(sec, "1e9", "frailt")
    assert "| 1e9 (1.00) |" in _optimum_row(sec, "1e9", "control")
    line = next(x for x in sec.splitlines() if x.startswith("- **frailt**"))
    assert line.count("frailt spent 0.80 of the budget at its N*, the control 1.00") == 3, line
    assert "within the compute both spent (1e9 to 3.2e9)" in line


def _law_row(sec: str, name: str) -> list[str]:
    start = sec.index("### Scaling with compute")
    return next(x for x in sec[start:].splitlines() if x.startswith(f"| {name} |")).strip("| ").split(" | ")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_exponents_of_n_star_and_l_star_are_reported_with_their_intervals(tmp_path):
    """The grid's optima grow 1.3× per doubling of C, so a = ln 1.3 / ln 2; non-embedding N* grows faster (the
    embedding, a large share of these models, grows only with the width); L* = 4.0, 3.8, 3.6 gives b."""
    sec = _scaling(_iso_db(tmp_path))
    row = _law_row(sec, "control")
    assert row[1] == "3"
    a, (a_lo, a_hi) = float(row[2]), (float(v) for v in row[3].split(" to "))
    assert abs(a - math.log(1.3) / math.log(2)) < 0.03 and a_lo < a < a_hi
    a_ne = float(row[4])
    assert a_ne > a and " to " in row[5]
    b = np.polyfit(np.log([1e9, 2e9, 4e9]), np.log([4.0, 3.8, 3.6]), 1)[0]
    assert abs(float(row[6]) - b) < 0.005 and " to " in row[7]
    # the runs table has the non-embedding parameters beside the total: the tiny preset's width-16 control has a
    # 512 x 16 embedding
    d = accounting.describe(
        make_config("tiny", "control", 0, {"model.dim": 16, "model.n_heads": 1, "model.n_kv_heads": 1})
    )
    runs_row = next(x for x in sec.splitlines() if x.startswith("| 1e9 | control | 16 |"))
    assert f"| {d['total_params']:,} | {d['total_params'] - d['embedding']:,} |" in runs_row
    assert "The embedding is " in sec and "% of the unique parameters across this grid" in sec


def _png_width(fig) -> int:
    from PIL import Image

    from benchctl.report.figures import save_figure

    buf = io.BytesIO()
    save_figure(fig, buf)
    buf.seek(0)
    return Image.open(buf).size[0]


def legends_over_data(fig, renderer=None) -> list[str]:
    """For each legend of the figure that covers part of any visible axes (its data area) or has more entries than
    MAX_LEGEND: its first entry. Drawn first (unless given the renderer that just drew it), so every box is where
    the PNG has it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from benchctl.report.figures import MAX_LEGEND

    if renderer is None:
        FigureCanvasAgg(fig)
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    bad = []
    for leg in legends:
        box = leg.get_window_extent(renderer)
        axes = [ax.get_window_extent(renderer) for ax in fig.axes if ax.get_visible()]
        if len(leg.get_texts()) > MAX_LEGEND or any(box.overlaps(a) for a in axes):
            bad.append(leg.get_texts()[0].get_text() if leg.get_texts() else "?")
    return bad


def check_figures(figures: dict) -> None:
    """Each figure drawn once, as `save_figure` draws it (the figure's own dpi is the PNG's, so the pixels drawn
    are the PNG's; the test above checks that against a written PNG): at most 2000 px wide, no legend over data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from benchctl.report.figures import FIG_DPI

    for name, fig in figures.items():
        assert fig.dpi == FIG_DPI, name
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        assert canvas.get_renderer().width <= 2000, name
        assert legends_over_data(fig, canvas.get_renderer()) == [], name


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_figure_of_a_grid_report_is_at_most_2000_px_wide_and_its_legends_clear_the_data(tmp_path):
    """A grid of 30 models (2 architectures x 5 widths x 3 budgets): the per-model charts turn to one row per model,
    the legends name architectures, below the panels."""
    rendered = report_engine.build(_iso_db(tmp_path, curves=True, spent={"frailt": 0.8}), "tiny", "iso", only_plan=True)
    expected = {"isoflop.png", "final_val_loss.png", "val_loss_curves.png", "loss_vs_compute.png"}
    assert expected <= set(rendered.figures)
    check_figures(rendered.figures)


def test_the_checks_catch_a_wide_figure_and_a_legend_over_the_data():
    from benchctl.report.figures import _figure

    wide = _figure(14.0, 3.0)
    wide.add_subplot().plot([0, 1], [0, 1])
    assert _png_width(wide) == 2100
    with pytest.raises(AssertionError, match="wide"):
        check_figures({"wide": wide})
    over = _figure(6.0, 4.0)
    ax = over.add_subplot()
    ax.plot([0, 1], [0, 1], label="line")
    ax.legend(loc="center")
    assert legends_over_data(over) == ["line"]
    with pytest.raises(AssertionError, match="over"):
        check_figures({"over": over})
    crowded = _figure(6.0, 4.0)
    ax = crowded.add_subplot()
    for i in range(13):
        ax.plot([0, 1], [i, i], label=f"model {i}")
    crowded.legend(loc="outside lower center", ncols=5)
    assert legends_over_data(crowded) == ["model 0"]


@pytest.mark.slow
def test_the_committed_isoflop_report_s_figures_are_bounded():
    """The committed 270-run grid: nine architectures, 135 models."""
    from pathlib import Path

    db = Path(__file__).resolve().parents[1] / "docs" / "results" / "isoflop-small" / "results.db"
    rendered = report_engine.build(db, "small", "isoflop", only_plan=True)
    assert {"isoflop.png", "final_val_loss.png", "training_time.png", "loss_vs_params.png"} <= set(rendered.figures)
    check_figures(rendered.figures)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_grid_whose_every_run_misses_its_budget_is_listed_not_fitted(tmp_path):
    """Runs too short for their budget (too few steps) are listed and not fitted; with no run left to fit, the
    section still renders: no optimum, no power law, no comparison."""
    rendered = report_engine.build(_iso_db(tmp_path, short=0.5), "tiny", "iso", only_plan=True)
    sec = rendered.markdown[rendered.markdown.index("\n## Scaling\n") :]
    assert "| 1e9 | control | 16 |" in sec  # every run listed
    assert "| ok |" not in sec and "### Against the control" not in sec
    assert "isoflop.png" in rendered.figures


# --------------------------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow  # a study training a grid of runs, twice
def test_a_tiny_isoflop_study_trains_resumes_and_reports(tmp_path, tinystories_dir, monkeypatch):
    """Real training of a 2 widths x 2 budgets grid at tiny (a few steps each) through `study`: the plan's grid
    point and the split's size land in the database, the report has its Scaling section, and a rerun trains
    nothing."""
    from benchctl.study import StudyOptions, run_study

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    path = write(
        tmp_path,
        'name = "iso-e2e"\ndescription = "d"\nkind = "isoflop"\nbudgets = [5e8, 1e9]\nwidths = [16, 32]\n'
        '[[variant]]\nname = "control"\narch = "control"\n',
    )
    opts = StudyOptions(
        preset="tiny",
        plan=str(path),
        seeds=[0],
        db_path=tmp_path / "r.db",
        out_dir=tmp_path / "reports",
        overrides={"data.source": str(tinystories_dir)},
        skip=("sample", "judge", "eval", "depth", "infer"),
        progress=False,
        bench=False,
    )
    report_path = run_study(opts, log=lambda _: None)
    db = stages.connect(tmp_path / "r.db")
    rows = train_tables.plan_runs(db, "iso-e2e")
    assert {(r["isoflop_arch"], r["isoflop_width"], r["isoflop_budget"]) for r in rows} == {
        ("control", w, b) for w in (16, 32) for b in (5e8, 1e9)
    }
    runs = train_tables.runs(db)
    assert len(runs) == 4 and all(r["status"] == "done" and r["data_train_tokens"] > 0 for r in runs)
    md = report_path.read_text()
    sec = md[md.index("\n## Scaling\n") :]
    assert "no fit: fewer than 3 widths" in sec and "| 5e8 | control | 16 |" in sec
    lines: list[str] = []
    run_study(opts, log=lines.append)
    assert sum("already done" in line for line in lines) == 4


def test_find_prepared_never_builds(tmp_path, tinystories_dir, monkeypatch):
    """What `plans show` counts epochs with when it must not download: the cache entry or nothing."""
    from benchctl.core import data
    from benchctl.core.config import DataConfig

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(source=str(tinystories_dir), tokenizer_stories=500, max_train_stories=300, max_valid_stories=50)
    assert data.find_prepared(cfg, 512) is None and data.find_prepared(DataConfig(source="hub"), 512) is None
    built = data.prepare(cfg, 512, progress=False)
    found = data.find_prepared(cfg, 512)
    assert found is not None and found.dir == built.dir and found.n_train_tokens == built.n_train_tokens


def test_the_crossing_sentence_names_which_fit_is_missing():
    from benchctl.stages.train.report_scaling import _which_fit

    assert _which_fit("frailt", None, None) == "neither has a power-law fit"
    assert _which_fit("frailt", None, object()) == "only the control has one"
    assert _which_fit("frailt", object(), None) == "only frailt has one"
