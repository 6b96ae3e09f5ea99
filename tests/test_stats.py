"""benchctl.stats against independent computations (hand formulas, scipy.stats) and its edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from benchctl import stats


# ---------------------------------------------------------------------------------------------------------------------
# mean with a t-interval


def test_mean_ci_matches_hand_formula_and_scipy():
    x = [3.21, 3.18, 3.25, 3.19, 3.30]
    ci = stats.mean_ci(x)
    n, m, sd = len(x), sum(x) / len(x), math.sqrt(sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1))
    h = sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert ci.n == 5
    assert ci.mean == pytest.approx(m, abs=1e-12)
    assert ci.sd == pytest.approx(sd, rel=1e-12)
    assert (ci.lo, ci.hi) == pytest.approx((m - h, m + h), rel=1e-12)
    lo, hi = sps.t.interval(0.95, n - 1, loc=np.mean(x), scale=sps.sem(x))
    assert (ci.lo, ci.hi) == pytest.approx((lo, hi), rel=1e-12)
    assert ci.half_width == pytest.approx(h, rel=1e-12)


def test_mean_ci_other_level():
    x = [1.0, 2.0, 4.0]
    ci = stats.mean_ci(x, level=0.90)
    lo, hi = sps.t.interval(0.90, 2, loc=np.mean(x), scale=sps.sem(x))
    assert (ci.lo, ci.hi) == pytest.approx((lo, hi))


def test_mean_ci_one_value_has_no_interval():
    ci = stats.mean_ci([3.14])
    assert ci.n == 1 and ci.mean == 3.14
    assert ci.lo is None and ci.hi is None and ci.sd is None and ci.half_width is None


def test_mean_ci_empty_and_missing_values_are_dropped_not_imputed():
    assert stats.mean_ci([]).mean is None and stats.mean_ci([]).n == 0
    assert stats.mean_ci([None, float("nan")]).n == 0
    ci = stats.mean_ci([1.0, None, float("nan"), 3.0])
    assert ci.n == 2 and ci.mean == 2.0


# ---------------------------------------------------------------------------------------------------------------------
# Welch


@pytest.mark.parametrize(
    "a,b",
    [
        ([1.429, 1.431, 1.425], [1.384, 1.391, 1.380]),
        ([3.2, 3.1, 3.3, 3.25, 3.15], [3.0, 3.4]),
        ([10.0, 12.0, 9.5, 11.0], [10.5, 10.7, 10.4, 10.9, 10.6, 10.8]),
    ],
)
def test_welch_matches_scipy(a, b):
    d = stats.welch(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    assert d.p == pytest.approx(ref.pvalue, rel=1e-10)
    assert d.t == pytest.approx(ref.statistic, rel=1e-10)
    assert d.df == pytest.approx(ref.df, rel=1e-10)
    lo, hi = ref.confidence_interval(0.95)
    assert (d.lo, d.hi) == pytest.approx((lo, hi), rel=1e-10)
    assert d.diff == pytest.approx(np.mean(a) - np.mean(b))
    assert d.n_a == len(a) and d.n_b == len(b)


def test_welch_hand_formula():
    a, b = [2.0, 4.0, 6.0], [1.0, 2.0, 3.0, 4.0]
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    t = (4.0 - 2.5) / math.sqrt(va + vb)
    d = stats.welch(a, b)
    assert d.df == pytest.approx(df) and d.t == pytest.approx(t)
    assert d.p == pytest.approx(2 * sps.t.sf(abs(t), df))


@pytest.mark.parametrize(
    "a,b,reason",
    [([1.0], [2.0], "one seed per model"), ([1.0, 1.1], [2.0], "only one seed"), ([], [1.0, 2.0], "no values")],
)
def test_welch_too_few_seeds_is_untestable(a, b, reason):
    d = stats.welch(a, b)
    assert d.p is None and d.lo is None and d.hi is None and not d.testable
    assert reason in d.reason


def test_welch_without_variation_is_untestable():
    d = stats.welch([1.0, 1.0], [2.0, 2.0])
    assert d.p is None and d.diff == -1.0 and "no variation" in d.reason


# ---------------------------------------------------------------------------------------------------------------------
# paired bootstrap


def test_paired_bootstrap_is_deterministic_and_order_free():
    rng = np.random.default_rng(0)
    keys = [f"p{i}" for i in range(30)]
    a = {k: float(v) for k, v in zip(keys, rng.normal(3.0, 1.0, 30))}
    b = {k: float(v) for k, v in zip(keys, rng.normal(2.8, 1.0, 30))}
    d1 = stats.paired_bootstrap(a, b, seed=7)
    d2 = stats.paired_bootstrap(dict(reversed(list(a.items()))), b, seed=7)
    assert d1 == d2
    assert stats.paired_bootstrap(a, b, seed=8).lo != d1.lo  # the seed matters


def test_paired_bootstrap_matches_direct_resampling():
    """The same resampling written out plainly: one (B, n) index matrix from the seeded generator."""
    rng = np.random.default_rng(1)
    n, B = 25, 2000
    a = {i: float(v) for i, v in enumerate(rng.normal(5, 1, n))}
    b = {i: float(v) for i, v in enumerate(rng.normal(5.3, 1, n))}
    d = stats.paired_bootstrap(a, b, n_boot=B, seed=3)
    diffs = np.array([a[i] - b[i] for i in sorted(a)])
    idx = np.random.default_rng(3).integers(0, n, size=(B, n))
    boot = diffs[idx].mean(axis=1)
    assert d.diff == pytest.approx(diffs.mean())
    assert (d.lo, d.hi) == pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])))
    extreme = sum(abs(x - diffs.mean()) >= abs(diffs.mean()) for x in boot)
    assert d.p == pytest.approx((1 + extreme) / (B + 1))


def test_paired_bootstrap_agrees_with_normal_theory_for_many_prompts():
    rng = np.random.default_rng(2)
    n = 400
    base = rng.normal(3, 1.5, n)  # prompt difficulty shared by both models: the reason to pair
    a = {i: float(v + 0.15 + rng.normal(0, 0.6)) for i, v in enumerate(base)}
    b = {i: float(v + rng.normal(0, 0.6)) for i, v in enumerate(base)}
    d = stats.paired_bootstrap(a, b, seed=0)
    diffs = np.array([a[i] - b[i] for i in range(n)])
    se = diffs.std(ddof=1) / math.sqrt(n)
    assert d.lo == pytest.approx(diffs.mean() - 1.96 * se, abs=0.1 * se)
    assert d.hi == pytest.approx(diffs.mean() + 1.96 * se, abs=0.1 * se)
    t_p = sps.ttest_rel(list(a.values()), list(b.values())).pvalue
    assert d.p < 0.01 and t_p < 0.01
    # an unpaired test on the same numbers is far weaker: pairing removes the prompt difficulty
    assert sps.ttest_ind(list(a.values()), list(b.values())).pvalue > 10 * t_p


def test_paired_bootstrap_uses_only_shared_keys():
    a = {"x": 1.0, "y": 2.0, "z": 3.0, "only_a": 100.0}
    b = {"x": 0.0, "y": 1.0, "z": 2.5, "only_b": -100.0, "w": None}
    d = stats.paired_bootstrap(a, b, n_boot=500)
    assert d.n_a == 3 and d.diff == pytest.approx((1 + 1 + 0.5) / 3)
    assert d.mean_a == pytest.approx(2.0) and d.mean_b == pytest.approx(3.5 / 3)


def test_paired_bootstrap_edge_cases():
    assert stats.paired_bootstrap({"a": 1.0}, {"a": 2.0}).p is None
    assert "no shared" in stats.paired_bootstrap({"a": 1.0}, {"b": 2.0}).reason
    same = stats.paired_bootstrap({i: float(i) for i in range(10)}, {i: float(i) for i in range(10)})
    assert same.diff == 0 and same.p == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Holm and words


def test_holm_by_hand():
    out = stats.holm([0.01, 0.04, 0.03, None])
    # sorted 0.01, 0.03, 0.04 -> 3*0.01 = 0.03, 2*0.03 = 0.06, max(0.06, 1*0.04) = 0.06
    assert out[0] == pytest.approx(0.03) and out[2] == pytest.approx(0.06) and out[1] == pytest.approx(0.06)
    assert out[3] is None
    assert stats.holm([0.5, 0.9]) == [pytest.approx(1.0), pytest.approx(1.0)]
    assert stats.holm([]) == []


def test_fmt_p():
    assert stats.fmt_p(0.4321) == "p = 0.43"
    assert stats.fmt_p(0.0123) == "p = 0.012"
    assert stats.fmt_p(0.0004) == "p < 0.001"
    assert stats.fmt_p(None) == "p n/a"


def test_verdict_significant_lower():
    a, b = [1.384, 1.380, 1.388], [1.429, 1.431, 1.425]
    d = stats.welch(a, b)
    s = stats.verdict("three-part", "control", "final validation loss", d)
    lo, hi = sps.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert s.startswith(f"three-part's final validation loss is {np.mean(b) - np.mean(a):.3f} lower than control's")
    assert f"95% CI {-hi:.3f} to {-lo:.3f}" in s
    assert "3 seeds each" in s and stats.fmt_p(d.p) in s


def test_verdict_significant_higher_with_bootstrap():
    a = {i: 3.5 + 0.1 * (i % 3) for i in range(20)}
    b = {i: 3.0 + 0.1 * (i % 4) for i in range(20)}
    d = stats.paired_bootstrap(a, b)
    s = stats.verdict("relaxed", "control", "judge average", d, unit="prompts", digits=2)
    assert s.startswith("relaxed's judge average is") and " higher than control's" in s
    assert "over 20 shared prompts" in s


def test_verdict_not_distinguishable():
    a, b = [1.40, 1.45], [1.42, 1.41]
    d = stats.welch(a, b)
    s = stats.verdict("frailt", "control", "final validation loss", d)
    assert s.startswith("frailt's and control's final validation loss are not distinguishable with 2 seeds each")
    assert stats.fmt_p(d.p) in s and "lower" not in s and "higher" not in s


def test_verdict_cannot_be_tested():
    s = stats.verdict("frailt", "control", "final validation loss", stats.welch([1.4], [1.5]))
    assert s == "frailt vs control, final validation loss: cannot be tested: one seed per model."


def test_verdict_never_prints_negative_zero():
    d = stats.Diff("welch", 3, 3, 1.0, 1.0, -1e-9, -0.0001, 0.0001, 0.9)
    assert "-0.000" not in stats.verdict("a", "b", "loss", d)
