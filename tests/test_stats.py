"""benchctl.core.stats against independent computations (hand formulas, scipy.stats) and its edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from benchctl.core import stats

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
# a fitted quantity's t-interval over seeds


def test_seed_ci_of_a_mean_is_the_t_interval_of_the_mean():
    """A plain mean's seed contributions are (x_s − x̄)/k: the interval is mean_ci's."""
    x = {0: 3.21, 1: 3.18, 2: 3.25, 3: 3.19}
    m = sum(x.values()) / 4
    ci = stats.seed_ci(m, [(1.0, {s: (v - m) / 4 for s, v in x.items()})])
    ref = stats.mean_ci(list(x.values()))
    assert (ci.lo, ci.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12) and ci.df == 3 and ci.paired


def test_seed_ci_pairs_parts_with_the_same_seeds_and_adds_parts_with_other_seeds():
    """A difference of two means over the same seeds is the paired t; over different seeds the variances add and
    the smaller seed count sets the degrees of freedom."""
    a, b = {0: 3.0, 1: 3.4, 2: 3.1}, {0: 2.9, 1: 3.35, 2: 2.95}
    ma, mb = sum(a.values()) / 3, sum(b.values()) / 3
    terms_a = {s: (v - ma) / 3 for s, v in a.items()}
    terms_b = {s: (v - mb) / 3 for s, v in b.items()}
    paired = stats.seed_ci(ma - mb, [(1.0, terms_a), (-1.0, terms_b)])
    ref = stats.mean_ci([a[s] - b[s] for s in a])
    assert paired.paired and (paired.lo, paired.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-12)
    c = {5: 2.9, 6: 3.35}
    mc = sum(c.values()) / 2
    apart = stats.seed_ci(ma - mc, [(1.0, terms_a), (-1.0, {s: (v - mc) / 2 for s, v in c.items()})])
    se = math.sqrt(np.var(list(a.values()), ddof=1) / 3 + np.var(list(c.values()), ddof=1) / 2)
    assert not apart.paired and apart.df == 1 and apart.se == pytest.approx(se, rel=1e-12)
    assert stats.seed_ci(1.0, [(1.0, {0: 0.0})]).lo is None  # one seed: no interval


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
# compare_seeds: paired over shared seeds, Welch otherwise


def test_compare_seeds_pairs_by_seed_when_the_seeds_match():
    a = {0: 1.384, 1: 1.402, 2: 1.371}
    b = {2: 1.380, 0: 1.391, 1: 1.410}  # dict order must not matter: seeds are matched by key
    c = stats.compare_seeds(a, b)
    ref = sps.ttest_rel([a[k] for k in (0, 1, 2)], [b[k] for k in (0, 1, 2)])
    assert c.method == "paired-t" and c.n_a == c.n_b == 3 and c.p_wilcoxon is None
    assert c.p == pytest.approx(ref.pvalue, rel=1e-12) and c.t == pytest.approx(ref.statistic) and c.df == 2
    assert (c.lo, c.hi) == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-12)
    # the seed-to-seed spread both models share is removed: Welch on the same numbers is much weaker
    assert c.p < 0.05 < stats.welch(a.values(), b.values()).p


def test_compare_seeds_adds_wilcoxon_from_six_pairs():
    rng = np.random.default_rng(4)
    base = rng.normal(1.4, 0.02, 6)
    a = {i: float(v - 0.01 + rng.normal(0, 0.003)) for i, v in enumerate(base)}
    b = {i: float(v) for i, v in enumerate(base)}
    c = stats.compare_seeds(a, b)
    assert c.method == "paired-t" and c.p_wilcoxon == pytest.approx(
        sps.wilcoxon(list(a.values()), list(b.values())).pvalue
    )
    assert stats.compare_seeds({k: a[k] for k in range(5)}, {k: b[k] for k in range(5)}).p_wilcoxon is None


# ---------------------------------------------------------------------------------------------------------------------
# the exact sign-flip test beside a t over few pairs


@pytest.mark.parametrize(
    "d,want",
    [
        ([0.1, 0.2, 0.3], 0.25),  # all positive: only the observed pattern and its mirror reach |sum| = 0.6
        ([-0.1, -0.2, -0.3], 0.25),
        ([0.5, 0.5], 0.5),  # 2 pairs: the floor is 2/4
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0.0625),  # 5 pairs, all one sign: 2/32
        ([0.3, -0.1, 0.2], 0.5),  # |sum| 0.4 is reached by + - +, - + -, + + +, - - -: 4 of 8
        ([1.0, 1.0, -2.0], 1.0),  # sum 0: every pattern reaches it
        ([0.0, 0.0, 1.0], 1.0),  # zeros flip to themselves: (0, 0, ±1) both reach |1| in all 8 patterns
    ],
)
def test_sign_flip_exact_p_of_small_known_cases(d, want):
    assert stats.sign_flip(d) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_sign_flip_is_scipys_exact_paired_permutation_test(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    x, y = rng.normal(0.1, 1.0, n), rng.normal(0.0, 1.0, n)
    ref = sps.permutation_test(
        (x, y), lambda a, b: np.mean(a - b), permutation_type="samples", n_resamples=np.inf, alternative="two-sided"
    )
    assert stats.sign_flip(x - y) == pytest.approx(ref.pvalue, rel=1e-12)


def test_sign_flip_floor_and_limits():
    assert [stats.sign_flip_floor(n) for n in (2, 3, 4, 5)] == [0.5, 0.25, 0.125, 0.0625]
    assert stats.sign_flip([]) is None and stats.sign_flip([None, float("nan")]) is None
    with pytest.raises(ValueError, match="2\\^n"):
        stats.sign_flip(np.ones(stats.MAX_EXACT_PAIRS + 1))


def test_a_paired_t_over_few_seeds_carries_the_exact_sign_flip_p():
    a = {0: 1.40, 1: 1.45, 2: 1.38}
    b = {0: 1.30, 1: 1.36, 2: 1.27}  # a is higher at every seed by about 0.1, with little spread
    c = stats.compare_seeds(a, b)
    assert c.method == "paired-t" and c.p < 0.01
    assert c.p_sign_flip == pytest.approx(0.25)  # the least 3 pairs allow, however consistent the gap
    six_a, six_b = {**a, 3: 1.41, 4: 1.42, 5: 1.39}, {**b, 3: 1.33, 4: 1.31, 5: 1.30}
    assert stats.compare_seeds(six_a, six_b).p_sign_flip is None  # from 6 pairs the Wilcoxon p stands beside it
    assert stats.compare_seeds(six_a, six_b).p_wilcoxon is not None
    assert stats.welch([1.0, 1.1, 1.2], [1.3, 1.5]).p_sign_flip is None  # unpaired: nothing to flip


def test_a_significant_verdict_from_three_seeds_says_it_rests_on_normality():
    a = {0: 1.40, 1: 1.45, 2: 1.38}
    b = {0: 1.30, 1: 1.36, 2: 1.27}
    c = stats.compare_seeds(a, b)
    v = stats.verdict("frailt", "control", "final validation loss", c)
    assert "higher than control's" in v
    assert "significant only under the t-test's assumption of normal differences" in v
    assert "exact sign-flip p = 0.25, the least possible at 3 seeds" in v
    # not significant: the same facts, without claiming anything rests on them
    flat = stats.compare_seeds({0: 1.40, 1: 1.30, 2: 1.35}, {0: 1.35, 1: 1.36, 2: 1.33})
    v = stats.verdict("frailt", "control", "final validation loss", flat)
    assert "not distinguishable" in v and "the t assumes normal differences; exact sign-flip p = " in v
    assert "significant only" not in v


# ---------------------------------------------------------------------------------------------------------------------
# margins: equivalence (TOST) and non-inferiority


@pytest.mark.parametrize(
    "x",
    [[0.002, -0.001, 0.003], [0.004, 0.006, 0.005, 0.007], [-0.02, 0.03, 0.01], [0.011, 0.012, 0.0125]],
)
def test_tost_is_two_one_sided_scipy_t_tests(x):
    m = 0.01
    e = stats.tost(x, m)
    lower = sps.ttest_1samp(x, -m, alternative="greater").pvalue
    upper = sps.ttest_1samp(x, m, alternative="less").pvalue
    assert e.p == pytest.approx(max(lower, upper), rel=1e-10)
    lo, hi = sps.t.interval(0.90, len(x) - 1, loc=np.mean(x), scale=sps.sem(x))
    assert (e.lo, e.hi) == pytest.approx((lo, hi), rel=1e-10) and e.level == pytest.approx(0.90)
    assert e.shown == (-m < lo and hi < m)  # both one-sided tests reject exactly when the 90% interval is inside


def test_a_wide_ci_containing_zero_is_not_equivalence_and_a_tight_one_is():
    wide = [-0.05, 0.04, 0.02]  # mean 0.003: the 95% CI contains 0 by a mile, which shows no equivalence
    assert stats.mean_ci(wide).lo < 0 < stats.mean_ci(wide).hi
    assert not stats.tost(wide, 0.01).shown
    tight = [0.001, 0.002, 0.0015, 0.0012]
    assert stats.tost(tight, 0.01).shown
    assert not stats.tost(tight, 0.001).shown  # the same values, a margin they are not inside


def test_noninferiority_is_scipys_one_sided_t_below_the_margin():
    x = [0.001, 0.004, -0.002]
    r = stats.noninferiority(x, 0.01)
    assert r.kind == "non-inferiority"
    assert r.p == pytest.approx(sps.ttest_1samp(x, 0.01, alternative="less").pvalue, rel=1e-10)
    assert r.shown and r.hi < 0.01
    # a large improvement is non-inferior too; an increase near the margin is not shown
    assert stats.noninferiority([-0.2, -0.3, -0.25], 0.01).shown
    assert not stats.noninferiority([0.009, 0.012, 0.008], 0.01).shown


def test_margin_tests_need_two_varying_values():
    one = stats.tost([0.001], 0.01)
    assert one.p is None and not one.shown and one.mean == 0.001 and "spread is unknown" in one.reason
    assert stats.noninferiority([], 0.01).reason == "no values"
    assert stats.tost([0.002, 0.002], 0.01).reason == "the values do not vary"
    with pytest.raises(ValueError):
        stats.tost([1.0, 2.0], 0.0)


def test_compare_seeds_uses_welch_when_the_seeds_differ():
    a, b = {0: 1.40, 1: 1.42, 2: 1.41}, {0: 1.38, 1: 1.39, 3: 1.37}
    c = stats.compare_seeds(a, b)
    ref = sps.ttest_ind(list(a.values()), list(b.values()), equal_var=False)
    assert c.method == "welch" and c.p == pytest.approx(ref.pvalue, rel=1e-10)
    # a seed whose run has no value counts as absent, so the seeds differ
    assert stats.compare_seeds({0: 1.0, 1: 1.1, 2: None}, {0: 1.2, 1: 1.3, 2: 1.25}).method == "welch"


def test_compare_seeds_edge_cases():
    one = stats.compare_seeds({0: 1.4}, {0: 1.5})
    assert one.p is None and one.reason == "one seed per model" and one.diff == pytest.approx(-0.1)
    flat = stats.compare_seeds({0: 1.0, 1: 2.0}, {0: 0.5, 1: 1.5})  # every seed differs by exactly 0.5
    assert flat.p is None and "do not vary" in flat.reason
    assert stats.compare_seeds({}, {0: 1.0}).p is None


# ---------------------------------------------------------------------------------------------------------------------
# compare_judge: seeds are the unit for architectures; one seed speaks for the trained models


def _grades(seeds, prompts, shift=0.0, rng=None):
    rng = rng or np.random.default_rng(0)
    return {
        (s, f"p{p}"): float(np.clip(np.round(5 + shift + rng.normal(0, 1.5)), 1, 10))
        for s in seeds
        for p in range(prompts)
    }


def test_compare_judge_tests_per_seed_means_with_several_seeds():
    rng = np.random.default_rng(5)
    a, b = _grades((0, 1, 2), 12, 0.5, rng), _grades((0, 1, 2), 12, 0.0, rng)
    del a[(1, "p3")]  # a failed grade: that (seed, prompt) is left out of both sides
    c = stats.compare_judge(a, b)
    means = [
        (np.mean([a[k] for k in a if k[0] == s and k in b]), np.mean([b[k] for k in a if k[0] == s and k in b]))
        for s in (0, 1, 2)
    ]
    ref = sps.ttest_rel([m[0] for m in means], [m[1] for m in means])
    assert c.method == "seed-t" and c.n_a == 3 and c.n_prompts == 12 and c.scope == "architectures"
    assert c.p == pytest.approx(ref.pvalue) and c.df == 2


def test_compare_judge_with_one_seed_is_about_the_trained_models():
    rng = np.random.default_rng(6)
    a, b = _grades((0,), 20, 1.0, rng), _grades((0,), 20, 0.0, rng)
    c = stats.compare_judge(a, b)
    keys = sorted(a)
    assert c.method == "prompt-t" and c.scope == "trained models" and c.n_a == 20
    assert c.p == pytest.approx(sps.ttest_rel([a[k] for k in keys], [b[k] for k in keys]).pvalue)
    v = stats.verdict("relaxed", "control", "judge average", c, p_adj=c.p, family="the 1 pairwise comparisons")
    assert "about these two trained models only" in v


@pytest.mark.parametrize("seeds,prompts", [(1, 5), (1, 10), (1, 50), (3, 5), (3, 10), (3, 50)])
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_judge_comparison_false_positive_rate_under_no_difference(seeds, prompts):
    """Under no true difference the judge comparison rejects at most 7% of the time at alpha = 0.05.

    The simulated grades are integers 1..10 around a prompt difficulty both models share (the reason to pair), with
    a model x seed effect when there are several seeds (a claim about architectures must absorb it) and none with
    one seed (there the null is "these two trained models grade alike"). 1000 simulations per cell: a test whose
    true rate is 5% shows more than 7% with probability ~0.2% (binomial sd 0.69 points, 7% is 2.9 sd above), and
    the generator is seeded so the outcome is fixed. The percentile bootstrap over prompts this replaced rejected
    ~15% of the time at 5 prompts."""
    rng = np.random.default_rng(1000 * seeds + prompts)
    n_sim, rejected = 1000, 0
    seed_sd = 0.4 if seeds > 1 else 0.0
    for _ in range(n_sim):
        difficulty = rng.normal(0, 1.5, prompts)
        y = 5.5 + difficulty + rng.normal(0, seed_sd, (2, seeds, 1)) + rng.normal(0, 1.2, (2, seeds, prompts))
        y = np.clip(np.round(y), 1, 10)  # (model, seed, prompt)
        a = {(s, p): y[0, s, p] for s in range(seeds) for p in range(prompts)}
        b = {(s, p): y[1, s, p] for s in range(seeds) for p in range(prompts)}
        c = stats.compare_judge(a, b)
        rejected += c.p is not None and c.p < 0.05
    assert rejected / n_sim <= 0.07


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
    assert "Welch t, 3 seeds each" in s and stats.fmt_p(d.p) in s


def test_verdict_is_decided_on_the_holm_adjusted_p_and_names_the_family():
    """Raw p below 0.05, Holm-adjusted p above it: never called a difference."""
    a = {0: 1.380, 1: 1.402, 2: 1.371}
    b = {0: 1.394, 1: 1.416, 2: 1.391}
    c = stats.compare_seeds(a, b)
    family_ps = [c.p, 0.30, 0.45, 0.60, 0.70, 0.90]
    p_adj = stats.holm(family_ps)[0]
    assert c.p < 0.05 < p_adj  # the constructed case
    family = "the 6 pairwise comparisons of final validation loss"
    v = stats.verdict("frailt", "relaxed", "final validation loss", c, p_adj=p_adj, family=family)
    assert "lower" not in v and "higher" not in v and "significant" not in v
    assert v.startswith("frailt's and relaxed's final validation loss are not distinguishable once adjusted")
    assert f"Holm-adjusted {stats.fmt_p(p_adj)} over {family}" in v and stats.fmt_p(c.p) in v
    # the same comparison in a family where it survives adjustment is a difference, with both p-values
    p_ok = stats.holm([c.p, 0.9])[0]
    if p_ok < 0.05:
        v2 = stats.verdict("frailt", "relaxed", "final validation loss", c, p_adj=p_ok, family="2")
        assert " lower than relaxed's" in v2 and "Holm-adjusted" in v2


def test_verdict_significant_higher_for_the_judge():
    rng = np.random.default_rng(9)
    a, b = _grades((0, 1, 2, 3), 40, 2.0, rng), _grades((0, 1, 2, 3), 40, 0.0, rng)
    c = stats.compare_judge(a, b)
    s = stats.verdict("relaxed", "control", "judge average", c, p_adj=c.p, digits=2)
    assert s.startswith("relaxed's judge average is") and " higher than control's" in s
    assert "t over the mean differences of 4 shared seeds (40 prompts)" in s and "trained models" not in s


def test_verdict_not_distinguishable():
    a, b = [1.40, 1.45], [1.42, 1.41]
    d = stats.welch(a, b)
    s = stats.verdict("frailt", "control", "final validation loss", d)
    assert s.startswith("frailt's and control's final validation loss are not distinguishable (")
    assert "Welch t, 2 seeds each" in s
    assert stats.fmt_p(d.p) in s and "lower" not in s and "higher" not in s


def test_verdict_cannot_be_tested():
    s = stats.verdict("frailt", "control", "final validation loss", stats.welch([1.4], [1.5]))
    assert s == "frailt vs control, final validation loss: cannot be tested: one seed per model."


def test_verdict_never_prints_negative_zero():
    d = stats.Diff("welch", 3, 3, 1.0, 1.0, -1e-9, -0.0001, 0.0001, 0.9)
    assert "-0.000" not in stats.verdict("a", "b", "loss", d)


# ---------------------------------------------------------------------------------------------------------------------
# The judge itself: agreement, length bias, failure rates


# Krippendorff (2011), "Computing Krippendorff's alpha-reliability", the reliability data with missing values
# (4 coders x 12 units; None = not coded): alpha = 0.849 for interval data.
KRIPPENDORFF_UNITS = [
    [1, 1, None, 1],
    [2, 2, 3, 2],
    [3, 3, 3, 3],
    [3, 3, 3, 3],
    [2, 2, 2, 2],
    [1, 2, 3, 4],
    [4, 4, 4, 4],
    [1, 1, 2, 1],
    [2, 2, 2, 2],
    [None, 5, 5, 5],
    [None, None, 1, 1],
    [None, 3, None, None],
]


def test_krippendorff_alpha_matches_the_published_value():
    assert stats.krippendorff_alpha(KRIPPENDORFF_UNITS) == pytest.approx(0.849, abs=5e-4)
    assert stats.krippendorff_alpha([[3, 3], [5, 5], [7, 7]]) == pytest.approx(1.0)
    assert stats.krippendorff_alpha([[3, 3], [3, 3]]) is None  # no variation: agreement is undefined
    assert stats.krippendorff_alpha([[3], [4, None]]) is None  # no unit with two values


def test_alpha_ci_resamples_units_and_is_deterministic():
    ag = stats.alpha_ci(KRIPPENDORFF_UNITS, n_boot=500, seed=1)
    assert ag.n_units == 11 and ag.n_values == 40  # the unit with one value carries no information
    assert ag.lo <= ag.alpha <= ag.hi <= 1.0 and ag == stats.alpha_ci(KRIPPENDORFF_UNITS, n_boot=500, seed=1)
    rng = np.random.default_rng(0)
    truth = rng.normal(5, 2, 300)
    noisy = [[t + rng.normal(0, 2), t + rng.normal(0, 2)] for t in truth]  # reliability 4 / (4 + 4) = 0.5
    ag = stats.alpha_ci(noisy, n_boot=500)
    assert ag.lo < 0.5 < ag.hi and ag.hi - ag.lo < 0.25


def test_length_bias_spearman_and_ranking_after_adjustment():
    rows = [("long", 100 + i, 6 + i / 10) for i in range(10)] + [("short", 20 + i, 4.5 + i / 20) for i in range(10)]
    lb = stats.length_bias(rows)
    assert lb.rho["long"][0] == pytest.approx(1.0) and lb.rho["long"][2] == 10
    assert lb.rho["long"][0] == pytest.approx(sps.spearmanr([r[1] for r in rows[:10]], [r[2] for r in rows[:10]])[0])
    assert lb.raw_rank == ["long", "short"] and lb.slope > 0
    fit = sps.linregress([r[1] for r in rows], [r[2] for r in rows])
    grand = np.mean([r[2] for r in rows])
    resid = np.mean([g - fit.intercept - fit.slope * x for m, x, g in rows if m == "short"])
    assert lb.adjusted_mean["short"] == pytest.approx(grand + resid)
    assert lb.rank_changes == (lb.adjusted_rank != lb.raw_rank)
    assert stats.length_bias([("a", None, 5.0), ("a", 3, None)]).rho == {}


def test_failure_rates_are_tested_for_equality():
    two = stats.failure_rates({"a": (1, 40), "b": (9, 40)})
    assert two.test == "Fisher exact" and two.p == pytest.approx(sps.fisher_exact([[1, 39], [9, 31]]).pvalue)
    three = stats.failure_rates({"a": (1, 40), "b": (9, 40), "c": (3, 40)})
    assert three.test == "chi-square"
    assert three.p == pytest.approx(sps.chi2_contingency([[1, 39], [9, 31], [3, 37]]).pvalue)
    none = stats.failure_rates({"a": (0, 40), "b": (0, 40)})
    assert none.p is None and none.reason == "no failures"
