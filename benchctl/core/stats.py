"""Statistics for the report: means with t intervals, the tests that compare two models, Holm's correction,
agreement and bias measures for the judge, and plain-language verdicts that say only what the numbers support.

Pure functions over plain sequences and mappings (numpy/scipy), no I/O. Entry points other modules use:

    mean_ci(values) -> MeanCI                  mean ± t_{1-α/2, n-1} · s/√n
    compare_seeds(a, b) -> Comparison          two models' per-seed values, a: {seed: value}
    compare_judge(a, b) -> Comparison          two models' grades, a: {(seed, prompt): grade}
    sign_flip(differences) -> p                exact paired permutation (sign-flip) test, all 2^n sign patterns
    tost(values, margin) -> MarginTest         equivalence: the mean is within ±margin (two one-sided t-tests)
    noninferiority(values, margin) -> MarginTest   the mean is below +margin (one one-sided t-test)
    holm(pvalues) -> adjusted p-values         Holm's step-down correction for one family
    seed_ci(estimate, parts) -> SeedCI         a fitted quantity's t-interval with the seed as the unit (delta method)
    verdict(a, b, quantity, c, p_adj=..., family=...) -> one sentence, decided on the adjusted p
    krippendorff_alpha(units) / alpha_ci(...)  agreement of repeated or competing grades (interval metric)
    length_bias(...) / failure_rates(...)      the judge's length bias and failure-rate homogeneity

`Comparison` is the stable result type of every two-model test (fields: method, n_a, n_b, mean_a, mean_b, diff,
lo, hi, p, level, df, t, p_wilcoxon, p_sign_flip, n_prompts, scope, reason); `diff` is a − b, `lo`/`hi` its
(unadjusted) CI.

Which test, when:
- per-seed values (final validation loss): at a given seed every architecture trains on the same data stream, so
  when both models have the same seeds the test is the paired t over seeds (`scipy.stats.ttest_rel`), with a
  Wilcoxon signed-rank test (`scipy.stats.wilcoxon`) reported beside it from 6 pairs on (below 6 pairs its smallest
  two-sided p is 2/2^5 = 0.0625, so it could never reject); when the seeds differ, Welch's unequal-variance t
  (`scipy.stats.ttest_ind(equal_var=False)`).
- few pairs (at most MAX_SIGN_FLIP_PAIRS): a t-test over 3 seeds has 2 degrees of freedom, and its p is only as good
  as the assumption that the 3 differences are normal, which 3 values cannot check. Beside it stands the exact
  paired permutation test (`sign_flip`): under "no difference" each pair's difference is as likely to have either
  sign, so the p is the share of all 2^n sign patterns whose |sum| reaches the observed one. It assumes nothing
  about the differences' distribution but symmetry, and it cannot go below 2/2^n (0.25 at 3 seeds, 0.0625 at 5):
  a t p below that is significant only through the normality assumption, and `verdict` says so.
- judge grades: a claim about architectures must count seeds, not prompts, as the independent units: each seed's
  paired difference is averaged over its shared prompts, and the test is a one-sample t over those per-seed means
  (df = seeds − 1). With one seed the only resampling unit is the prompt: a paired t over prompts, whose verdict is
  about the two trained models only. A hierarchical paired bootstrap (resample seeds, then prompts within each seed)
  was measured against this in simulation under no true difference (grades 1–10, prompt difficulty shared by both
  models, a model × seed effect, 400 simulations each): its percentile interval rejected 14.5% of the time at 5
  prompts with one seed and 13% at 50 prompts with 3 seeds (three seeds give the bootstrap only 10 distinct seed
  sets, so it underestimates the seed-level spread), while the t over per-seed means stayed at 4–6%. The bootstrap
  is therefore not used; tests/test_stats.py keeps the simulation for the tests that are.
- a quantity fitted across runs (the IsoFLOP optimum, its exponents, differences between architectures): the seed is
  the unit, because a seed's runs share its data stream at every size and budget. Each seed's linearised
  contribution to the estimate (its cluster's term of the least-squares sandwich, carried through the delta method)
  gives the variance, k/(k−1) times their sum of squares over k seeds, and the interval is a t with k − 1 degrees of
  freedom (`seed_ci`). A bootstrap over 2 to 5 seeds has 3 to 126 distinct resamples and a percentile interval that
  covers too little; resampling runs instead of seeds treats a seed's runs as independent and shrinks with their
  number.
- a family of comparisons (all pairs of models for one quantity) is adjusted with Holm's step-down method; a verdict
  calls a difference real only when the adjusted p is below α, and names the family it was adjusted over.
- "no change" and "no worse" are claims of their own, never read off a difference test that failed to reject (a
  wide CI containing 0 is absence of evidence, not evidence of absence): `tost` shows that a mean lies within a
  stated ±margin by rejecting both "mean <= −margin" and "mean >= +margin" with one-sided t-tests at α (TOST;
  equivalently the (1 − 2α) t interval lies inside the margin), and `noninferiority` rejects "mean >= +margin"
  alone. Both need at least 2 values with some spread; with fewer they carry p None and a reason.

Nothing here invents a number: with too few observations a result carries `None` and a `reason`, and the verdict
says the comparison cannot be tested.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeGuard, TypeVar

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
MIN_WILCOXON_PAIRS = 6
# Up to this many pairs the exact sign-flip p stands beside the paired t (from MIN_WILCOXON_PAIRS on the Wilcoxon p
# does): below 6 pairs no rank or sign test can reach 0.05, which is exactly what a reader of a t p must be told.
MAX_SIGN_FLIP_PAIRS = 5
# The most pairs `sign_flip` enumerates (2^n patterns of n values each); more would be a sampled test, not this one.
MAX_EXACT_PAIRS = 20


def _finite(values: Iterable[float | None]) -> np.ndarray:
    """The finite values as float64; None and NaN (a metric a run never wrote) are dropped, not imputed."""
    out = []
    for v in values:
        if v is None:
            continue
        f = float(v)
        if math.isfinite(f):
            out.append(f)
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class MeanCI:
    """A mean with its t confidence interval. `lo`/`hi` are None when n < 2 (no interval without spread)."""

    n: int
    mean: float | None
    sd: float | None  # sample standard deviation (ddof = 1)
    sem: float | None
    lo: float | None
    hi: float | None
    level: float = LEVEL

    @property
    def half_width(self) -> float | None:
        return None if self.lo is None or self.hi is None else (self.hi - self.lo) / 2


def mean_ci(values: Iterable[float | None], level: float = LEVEL) -> MeanCI:
    """Mean and t-interval: mean ± t_{(1+level)/2, n-1} · sd/√n. n = 1 gives the mean and no interval."""
    x = _finite(values)
    n = len(x)
    if n == 0:
        return MeanCI(0, None, None, None, None, None, level)
    m = float(x.mean())
    if n == 1:
        return MeanCI(1, m, None, None, None, None, level)
    sd = float(x.std(ddof=1))
    sem = sd / math.sqrt(n)
    h = float(sps.t.ppf((1 + level) / 2, n - 1)) * sem
    return MeanCI(n, m, sd, sem, m - h, m + h, level)


@dataclass(frozen=True)
class Comparison:
    """A difference a − b with its CI and two-sided p-value; p is None (with a `reason`) when it cannot be tested.

    method: "paired-t" (over shared seeds), "welch" (seeds differ), "seed-t" (judge: t over per-seed mean
    differences) or "prompt-t" (judge, one seed: paired t over prompts). n_a/n_b: values of each model (for the
    paired methods both are the number of pairs: seeds, or prompts for "prompt-t"). scope: what the verdict is
    about — "architectures" when seeds are the unit, "trained models" when one seed's prompts are.
    """

    method: str
    n_a: int
    n_b: int
    mean_a: float | None
    mean_b: float | None
    diff: float | None
    lo: float | None
    hi: float | None
    p: float | None
    level: float = LEVEL
    df: float | None = None
    t: float | None = None
    p_wilcoxon: float | None = None  # beside a paired t with at least MIN_WILCOXON_PAIRS pairs
    p_sign_flip: float | None = None  # beside a paired t with at most MAX_SIGN_FLIP_PAIRS pairs: exact, no normality
    n_prompts: int | None = None  # judge comparisons: distinct prompts both models were graded on
    scope: str = "architectures"
    reason: str | None = None  # why p is None

    @property
    def testable(self) -> bool:
        return self.p is not None


Diff = Comparison  # the earlier name of the same result type


def sign_flip(differences: Iterable[float | None]) -> float | None:
    """Exact two-sided p of the paired permutation (sign-flip) test that the differences are centred on 0.

    Under that null each difference is as likely to carry either sign, so every one of the 2^n sign patterns is
    equally likely; p is the share of them whose |sum| is at least the observed |sum| (the observed pattern and its
    mirror always count, so p >= 2/2^n). A zero difference flips to itself and stays in. Enumerated, not sampled:
    the same values give the same p. None without any value; more than MAX_EXACT_PAIRS values is a ValueError."""
    x = _finite(differences)
    n = len(x)
    if n == 0:
        return None
    if n > MAX_EXACT_PAIRS:
        raise ValueError(f"sign_flip enumerates 2^n sign patterns; {n} values is more than {MAX_EXACT_PAIRS}")
    bits = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1  # (2^n, n): every sign pattern once
    sums = (1 - 2 * bits) @ x  # (2^n,)
    observed = abs(float(x.sum()))
    tol = 1e-12 * max(1.0, float(np.abs(x).sum()))  # a mirror's sum equals the observed one up to rounding only
    return float(np.mean(np.abs(sums) >= observed - tol))


def sign_flip_floor(n: int) -> float:
    """The smallest two-sided p the exact sign-flip test can give from n pairs: 2/2^n."""
    return 2.0 ** (1 - n)


@dataclass(frozen=True)
class MarginTest:
    """A one-sample t-test against a margin: `kind` "equivalence" (TOST: −margin < mean < +margin) or
    "non-inferiority" (mean < +margin). `lo`/`hi` is the (1 − 2·alpha) t interval of the mean, the interval whose
    ends the one-sided tests compare with the margin; `p` the decisive one-sided p (for TOST the larger of the two),
    None with a `reason` when untestable."""

    kind: str
    n: int
    mean: float | None
    lo: float | None
    hi: float | None
    p: float | None
    margin: float
    alpha: float = 0.05
    reason: str | None = None

    @property
    def shown(self) -> bool:
        """Whether the claim (within the margin, or below it) is shown at level alpha."""
        return self.p is not None and self.p < self.alpha

    @property
    def level(self) -> float:
        """The coverage of lo/hi: 1 − 2·alpha (0.90 at alpha 0.05)."""
        return 1 - 2 * self.alpha


def _margin_test(kind: str, values: Iterable[float | None], margin: float, alpha: float) -> MarginTest:
    if not margin > 0 or not 0 < alpha < 0.5:
        raise ValueError(f"{kind} needs a margin > 0 and 0 < alpha < 0.5, got margin {margin}, alpha {alpha}")
    x = _finite(values)
    n = len(x)
    mean = float(x.mean()) if n else None
    base = MarginTest(kind, n, mean, None, None, None, float(margin), alpha)
    if n < 2:
        return replace(base, reason="one value: its spread is unknown, so nothing can be tested" if n else "no values")
    sd = float(x.std(ddof=1))
    if sd <= 1e-12 * max(1.0, float(np.abs(x).max())):  # no spread: t would be ±∞, a test of nothing
        return replace(base, reason="the values do not vary")
    assert mean is not None
    se, df = sd / math.sqrt(n), n - 1
    h = float(sps.t.ppf(1 - alpha, df)) * se
    below = float(sps.t.cdf((mean - margin) / se, df))  # H0: mean >= +margin
    if kind == "equivalence":
        above = float(sps.t.sf((mean + margin) / se, df))  # H0: mean <= −margin
        p = max(below, above)
    else:
        p = below
    return replace(base, lo=mean - h, hi=mean + h, p=p)


def tost(values: Iterable[float | None], margin: float, alpha: float = 0.05) -> MarginTest:
    """Equivalence by two one-sided t-tests: p < alpha shows −margin < mean < +margin (the (1 − 2α) t interval lies
    inside the margin). A CI that merely contains 0 shows nothing of the kind: this is the test of "no change"."""
    return _margin_test("equivalence", values, margin, alpha)


def noninferiority(values: Iterable[float | None], margin: float, alpha: float = 0.05) -> MarginTest:
    """One-sided t-test of H0 "mean >= margin": p < alpha shows the mean is below +margin ("no worse by more than the
    margin", for values where higher is worse; the upper end of the (1 − 2α) t interval is then below it)."""
    return _margin_test("non-inferiority", values, margin, alpha)


def welch(a: Iterable[float | None], b: Iterable[float | None], level: float = LEVEL) -> Comparison:
    """Welch's t-test for mean(a) − mean(b), with the Welch–Satterthwaite CI. Needs n ≥ 2 in each group."""
    xa, xb = _finite(a), _finite(b)
    na, nb = len(xa), len(xb)
    if na < 2 or nb < 2:
        ma = float(xa.mean()) if na else None
        mb = float(xb.mean()) if nb else None
        diff = ma - mb if ma is not None and mb is not None else None
        return Comparison("welch", na, nb, ma, mb, diff, None, None, None, level, reason=_too_few(na, nb))
    ma, mb = float(xa.mean()), float(xb.mean())
    diff = ma - mb
    va, vb = float(xa.var(ddof=1)) / na, float(xb.var(ddof=1)) / nb
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Comparison(
            "welch", na, nb, ma, mb, diff, None, None, None, level, reason="no variation within either group"
        )
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    t = diff / se
    p = float(2 * sps.t.sf(abs(t), df))
    h = float(sps.t.ppf((1 + level) / 2, df)) * se
    return Comparison("welch", na, nb, ma, mb, diff, diff - h, diff + h, p, level, df=df, t=t)


def _too_few(na: int, nb: int) -> str:
    if na == 0 or nb == 0:
        return "no values for one of the two"
    if na == 1 and nb == 1:
        return "one seed per model"
    return "only one seed of one of the two"


def _is_num(v: float | None) -> TypeGuard[float]:
    return v is not None and math.isfinite(float(v))


K = TypeVar("K", bound=Hashable)


def _sorted_keys(keys: Iterable[K]) -> list[K]:
    out: list[Any] = list(keys)  # compared as they come; a mix that cannot be is ordered by type and text below
    try:
        out.sort()
    except TypeError:  # keys of mixed types: any fixed order will do
        out.sort(key=lambda k: (type(k).__name__, str(k)))
    return out


def compare_seeds(a: Mapping[int, float | None], b: Mapping[int, float | None], level: float = LEVEL) -> Comparison:
    """Compare two models' per-seed values ({seed: value}; None/NaN = the run has no value and is left out).

    Same seeds on both sides: paired t over the seeds (each seed is one data stream both models saw), plus the exact
    sign-flip p up to MAX_SIGN_FLIP_PAIRS pairs and a Wilcoxon signed-rank p from MIN_WILCOXON_PAIRS pairs on.
    Different seeds: Welch over every value.
    """
    fa = {k: float(v) for k, v in a.items() if _is_num(v)}
    fb = {k: float(v) for k, v in b.items() if _is_num(v)}
    if set(fa) != set(fb) or not fa:
        return welch(fa.values(), fb.values(), level)
    keys = _sorted_keys(fa)
    return _paired_t(
        np.array([fa[k] for k in keys]), np.array([fb[k] for k in keys]), "paired-t", level, unit="seed", wilcoxon=True
    )


def _paired_t(
    xa: np.ndarray,
    xb: np.ndarray,
    method: str,
    level: float,
    *,
    unit: str,
    wilcoxon: bool,
    n_prompts: int | None = None,
    scope: str = "architectures",
) -> Comparison:
    """Paired t-test of xa − xb (scipy.stats.ttest_rel) with its t interval, and the exact sign-flip p beside it up
    to MAX_SIGN_FLIP_PAIRS pairs; untestable below 2 pairs or without any spread in the differences (t would be 0/0
    or ±∞)."""
    n = len(xa)
    ma = float(xa.mean()) if n else None
    mb = float(xb.mean()) if n else None
    diff = ma - mb if ma is not None and mb is not None else None
    base = Comparison(method, n, n, ma, mb, diff, None, None, None, level, n_prompts=n_prompts, scope=scope)
    if n < 2:
        return replace(base, reason=f"one {unit} per model" if n == 1 else f"no shared {unit}s")
    d = xa - xb
    if np.ptp(d) <= 1e-12 * max(1.0, float(np.abs(d).max())):  # equal up to rounding: t would be noise / ~0
        return replace(base, reason=f"the paired differences do not vary across {unit}s")
    res = sps.ttest_rel(xa, xb)
    ci = res.confidence_interval(level)
    p_w = None
    if wilcoxon and n >= MIN_WILCOXON_PAIRS and np.any(d != 0):
        with warnings.catch_warnings():  # ties and zeros switch scipy to the normal approximation; fine here
            warnings.simplefilter("ignore")
            p_w = float(sps.wilcoxon(xa, xb).pvalue)
    p_sf = sign_flip(d) if n <= MAX_SIGN_FLIP_PAIRS else None
    return replace(
        base,
        lo=float(ci.low),
        hi=float(ci.high),
        p=float(res.pvalue),
        df=float(res.df),
        t=float(res.statistic),
        p_wilcoxon=p_w,
        p_sign_flip=p_sf,
    )


def compare_judge(
    a: Mapping[tuple[Hashable, Hashable], float | None],
    b: Mapping[tuple[Hashable, Hashable], float | None],
    level: float = LEVEL,
) -> Comparison:
    """Compare two models' judge grades, {(seed, prompt): grade averaged over repeats}, paired by (seed, prompt).

    Two or more shared seeds: each seed's mean paired difference over its shared prompts, then a one-sample t over
    those seed means (scope "architectures"). One seed: a paired t over its prompts (scope "trained models").
    """
    shared: dict[tuple[Hashable, Hashable], tuple[float, float]] = {}
    for k, x in a.items():
        if _is_num(x) and _is_num(y := b.get(k)):
            shared[k] = float(x), float(y)
    by_seed: dict[Hashable, list[tuple[float, float]]] = {}
    for seed, prompt in _sorted_keys(shared):
        by_seed.setdefault(seed, []).append(shared[(seed, prompt)])
    n_prompts = len({p for _, p in shared})
    if len(by_seed) >= 2:
        seeds = _sorted_keys(by_seed)
        xa = np.array([np.mean([x for x, _ in by_seed[s]]) for s in seeds])  # (seeds,) per-seed mean of a
        xb = np.array([np.mean([y for _, y in by_seed[s]]) for s in seeds])  # (seeds,)
        return _paired_t(xa, xb, "seed-t", level, unit="seed", wilcoxon=False, n_prompts=n_prompts)
    pairs = next(iter(by_seed.values()), [])
    xa, xb = np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])
    return _paired_t(
        xa, xb, "prompt-t", level, unit="prompt", wilcoxon=False, n_prompts=n_prompts, scope="trained models"
    )


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm–Bonferroni adjusted p-values for one family; None entries are skipped and stay None.

    (scipy has the Benjamini–Hochberg false discovery rate, `false_discovery_control`, but not Holm's
    family-wise control.)"""
    known = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)  # smallest first, ties by position
    m = len(known)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(known):
        running = max(running, min(1.0, (m - rank) * float(p)))
        out[i] = running
    return out


@dataclass(frozen=True)
class SeedCI:
    """`estimate` with its t-interval over seeds: `lo`/`hi` are None below two seeds. `paired`: every part had the
    same seeds, so their contributions were combined seed by seed."""

    estimate: float
    lo: float | None
    hi: float | None
    df: int | None
    se: float | None
    paired: bool
    level: float = LEVEL


def seed_ci(estimate: float, parts: Sequence[tuple[float, Mapping[int, float]]], level: float = LEVEL) -> SeedCI:
    """The t-interval of a weighted sum of fitted quantities whose spread is over seeds.

    Each part is (weight, {seed: that seed's linearised contribution to the quantity}), the contributions of one part
    summing to zero (a least-squares sandwich's cluster terms, through the delta method). Parts with the same seeds
    are combined seed by seed, so what a seed does to all of them alike (its data stream) cancels in a difference:
    variance = k/(k−1) · Σ_s (Σ_parts weight · contribution_s)², df = k − 1, which for a plain mean is s²/k. Parts
    whose seeds differ are taken as independent: their variances add and the smallest seed count sets df."""
    seed_sets = {tuple(sorted(c)) for _, c in parts}
    paired = len(seed_sets) == 1
    if not parts or min(len(s) for s in seed_sets) < 2:
        return SeedCI(estimate, None, None, None, None, paired, level)
    if paired:
        seeds = next(iter(seed_sets))
        k = len(seeds)
        u = np.array([sum(w * float(c[s]) for w, c in parts) for s in seeds])
        var = k / (k - 1) * float(u @ u)
        df = k - 1
    else:
        var = 0.0
        for w, c in parts:
            v = np.array([float(x) for x in c.values()])
            var += w * w * len(v) / (len(v) - 1) * float(v @ v)
        df = min(len(s) for s in seed_sets) - 1
    se = math.sqrt(max(var, 0.0))
    h = float(sps.t.ppf((1 + level) / 2, df)) * se
    return SeedCI(estimate, estimate - h, estimate + h, df, se, paired, level)


# ----------------------------------------------------------------------------------------------------------------
# Words


def fmt_p(p: float | None) -> str:
    """'p = 0.43', 'p = 0.012', 'p < 0.001'; 'p n/a' when untested."""
    if p is None:
        return "p n/a"
    if p < 0.001:
        return "p < 0.001"
    if p < 0.1:
        return f"p = {p:.3f}"
    return f"p = {p:.2f}"


def _fmt(x: float, digits: int) -> str:
    s = f"{x:.{digits}f}"
    return "0." + "0" * digits if s.startswith("-") and float(s) == 0 else s  # no "-0.000"


def method_phrase(c: Comparison) -> str:
    """The test and its units in words: 'paired t over 3 shared seeds', 'Welch t, 3 and 2 seeds', ..."""
    if c.method == "paired-t":
        return f"paired t over {c.n_a} shared seeds"
    if c.method == "seed-t":
        return f"t over the mean differences of {c.n_a} shared seeds ({c.n_prompts} prompts)"
    if c.method == "prompt-t":
        return f"paired t over {c.n_a} prompts of one seed"
    if c.method == "welch":
        return f"Welch t, {c.n_a} seeds each" if c.n_a == c.n_b else f"Welch t, {c.n_a} and {c.n_b} seeds"
    return c.method


def normality_note(c: Comparison, *, significant: bool = False, alpha: float = 0.05) -> str:
    """What a t p from few pairs rests on, in words; '' when no exact sign-flip p stands beside it.

    'paired t ... p = 0.004' from 3 seeds reads as strong evidence, but with 2 degrees of freedom it holds only if
    the 3 differences are normal, and the exact sign-flip test, which needs no such assumption, cannot go below
    0.25. A significant verdict says its significance rests on that assumption; any other names it plainly."""
    if c.p_sign_flip is None:
        return ""
    unit = "prompts" if c.method == "prompt-t" else "seeds"
    floor = sign_flip_floor(c.n_a)
    at = f"at {c.n_a} {unit}"
    least = c.p_sign_flip <= floor * (1 + 1e-9)
    where = f"the least possible {at}" if least else f"never below {fmt_p(floor).removeprefix('p = ')} {at}"
    if significant and c.p_sign_flip >= alpha:
        return (
            f"significant only under the t-test's assumption of normal differences: exact sign-flip "
            f"{fmt_p(c.p_sign_flip)}, {where}"
        )
    return f"the t assumes normal differences; exact sign-flip {fmt_p(c.p_sign_flip)}, {where}"


def verdict(
    a: str,
    b: str,
    quantity: str,
    c: Comparison,
    *,
    p_adj: float | None = None,
    family: str | None = None,
    digits: int = 3,
    alpha: float = 0.05,
) -> str:
    """One sentence about a − b that states only what the numbers support, decided on the adjusted p.

    `p_adj` is the p-value after adjusting over `family` (e.g. "the 6 pairwise comparisons of final validation
    loss"); without it the raw p decides. A raw p below alpha whose adjusted p is not is reported as not
    distinguishable once adjusted, never as a difference. Significant: "three-part's final validation loss is
    0.041 lower than control's (95% CI 0.012 to 0.070; paired t over 3 shared seeds, p = 0.004, Holm-adjusted
    p = 0.024 over the 6 pairwise comparisons of final validation loss; significant only under the t-test's
    assumption of normal differences: exact sign-flip p = 0.25, the least possible at 3 seeds)." (`normality_note`)
    """
    if not c.testable or c.diff is None or c.lo is None or c.hi is None:
        return f"{a} vs {b}, {quantity}: cannot be tested: {c.reason or 'not enough data'}."
    pct = f"{round(c.level * 100):d}%"
    detail = f"{method_phrase(c)}, {fmt_p(c.p)}"
    if p_adj is not None:
        detail += f", Holm-adjusted {fmt_p(p_adj)}" + (f" over {family}" if family else "")
    if c.p_wilcoxon is not None:
        detail += f"; Wilcoxon signed-rank {fmt_p(c.p_wilcoxon)}"
    scope = (
        "; about these two trained models only: one seed cannot separate the architecture from the initialization"
        if c.scope == "trained models"
        else ""
    )
    decisive = p_adj if p_adj is not None else c.p
    assert decisive is not None and c.p is not None
    significant = decisive < alpha and (c.lo > 0 or c.hi < 0)
    note = normality_note(c, significant=significant, alpha=alpha)
    if note:
        detail += f"; {note}"
    if significant:
        if c.diff < 0:
            word, mag, lo, hi = "lower", -c.diff, -c.hi, -c.lo
        else:
            word, mag, lo, hi = "higher", c.diff, c.lo, c.hi
        return (
            f"{a}'s {quantity} is {_fmt(mag, digits)} {word} than {b}'s "
            f"({pct} CI {_fmt(lo, digits)} to {_fmt(hi, digits)}; {detail}{scope})."
        )
    numbers = f"difference {_fmt(c.diff, digits)}, {pct} CI {_fmt(c.lo, digits)} to {_fmt(c.hi, digits)}; {detail}"
    if c.p < alpha and p_adj is not None and p_adj >= alpha:
        return (
            f"{a}'s and {b}'s {quantity} are not distinguishable once adjusted for multiple comparisons "
            f"({numbers}{scope})."
        )
    return f"{a}'s and {b}'s {quantity} are not distinguishable ({numbers}{scope})."


# ----------------------------------------------------------------------------------------------------------------
# Accuracy against a chance level


def binom_above_chance(successes: int, n: int, chance: float) -> float | None:
    """One-sided exact binomial p-value of `successes` correct answers out of `n` against the chance rate `chance`:
    P(X >= successes) for X ~ Binomial(n, chance), i.e. `scipy.stats.binomtest(..., alternative="greater")`.

    Small p means the accuracy is above chance. Exact rather than a normal approximation because the task sizes
    here (a few hundred documents, sometimes a --limit of a few) are where the approximation is poor. None when
    there is nothing to test (no documents, or a chance level of 0 or 1, which no accuracy can exceed)."""
    if n <= 0 or not 0.0 < chance < 1.0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..{n}, got {successes}")
    return float(sps.binomtest(int(successes), int(n), float(chance), alternative="greater").pvalue)


# ----------------------------------------------------------------------------------------------------------------
# The judge itself: agreement, length bias, failure rates


@dataclass(frozen=True)
class Agreement:
    """Krippendorff's alpha (interval metric) with a bootstrap CI over units; alpha None when undefined."""

    alpha: float | None
    lo: float | None
    hi: float | None
    n_units: int  # units with at least two values (the only ones that carry information about agreement)
    n_values: int  # values in those units
    n_boot: int = 0
    reason: str | None = None


def _unit_sums(units: Iterable[Iterable[float | None]]) -> np.ndarray:
    """(units, 3): per pairable unit m (values), Σx, Σx² — what alpha needs, so resampling is arithmetic only."""
    rows = [(len(x), x.sum(), (x * x).sum()) for x in (_finite(u) for u in units) if len(x) >= 2]
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def _alpha_from_sums(s: np.ndarray) -> np.ndarray:
    """Alpha for each set of units along the second-to-last axis of `s` (..., units, 3).

    Interval metric, δ² = (x − y)²: observed disagreement D_o = (1/n) Σ_u Σ_{i≠j∈u} δ²/(m_u − 1), expected
    D_e = Σ_{i≠j} δ² / (n(n − 1)) over all n pairable values, alpha = 1 − D_o/D_e; Σ_{i≠j} δ² = 2mΣx² − 2(Σx)²."""
    m, s1, s2 = s[..., 0], s[..., 1], s[..., 2]
    n = m.sum(axis=-1)
    d_o = ((2 * m * s2 - 2 * s1**2) / (m - 1)).sum(axis=-1) / n
    d_e = (2 * n * s2.sum(axis=-1) - 2 * s1.sum(axis=-1) ** 2) / (n * (n - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d_e > 0, 1 - d_o / np.where(d_e > 0, d_e, 1.0), np.nan)


def krippendorff_alpha(units: Iterable[Iterable[float | None]]) -> float | None:
    """Krippendorff's alpha for interval data; `units` holds each unit's values (one per coder, None = missing).
    1 = perfect agreement, 0 = agreement at chance level. None without two pairable values or any variation."""
    s = _unit_sums(units)
    if len(s) == 0:
        return None
    a = float(_alpha_from_sums(s))
    return a if math.isfinite(a) else None


def alpha_ci(
    units: Iterable[Iterable[float | None]], *, n_boot: int = 1000, seed: int = 0, level: float = LEVEL
) -> Agreement:
    """Alpha with a percentile bootstrap CI that resamples units (samples), seeded and deterministic."""
    s = _unit_sums(units)
    n_units, n_values = len(s), int(s[:, 0].sum()) if len(s) else 0
    alpha = float(_alpha_from_sums(s)) if n_units else math.nan
    if not math.isfinite(alpha):
        why = "no unit has two values" if n_units == 0 else "the values do not vary at all"
        return Agreement(None, None, None, n_units, n_values, reason=why)
    if n_units < 2:
        return Agreement(alpha, None, None, n_units, n_values, reason="one unit: no interval")
    idx = np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))  # (B, units)
    boot = _alpha_from_sums(s[idx])  # (B,)
    boot = boot[np.isfinite(boot)]
    q = (1 - level) / 2
    lo, hi = (float(v) for v in np.quantile(boot, [q, 1 - q])) if len(boot) else (None, None)
    return Agreement(alpha, lo, hi, n_units, n_values, n_boot=n_boot)


@dataclass(frozen=True)
class LengthBias:
    """Spearman correlation of completion length with the grade per model, and the ranking of models before and
    after removing a pooled linear effect of length (grade ~ length over every model's samples)."""

    rho: dict[str, tuple[float | None, float | None, int]]  # model -> (Spearman rho, p, n)
    slope: float | None  # grade points per token of the pooled fit
    raw_mean: dict[str, float]
    adjusted_mean: dict[str, float]  # mean residual of the pooled fit, plus the overall mean
    raw_rank: list[str]  # best (highest grade) first
    adjusted_rank: list[str]

    @property
    def rank_changes(self) -> bool:
        return self.raw_rank != self.adjusted_rank


def length_bias(rows: Iterable[tuple[str, float | None, float | None]]) -> LengthBias:
    """rows: (model, completion length in tokens, grade). Rows without both numbers are left out."""
    data: dict[str, list[tuple[float, float]]] = {}
    for model, length, grade in rows:
        if _is_num(length) and _is_num(grade):
            data.setdefault(model, []).append((float(length), float(grade)))
    rho: dict[str, tuple[float | None, float | None, int]] = {}
    for m, xy in data.items():
        x, y = np.array(xy).T if xy else (np.array([]), np.array([]))
        if len(xy) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0:
            r = sps.spearmanr(x, y)
            rho[m] = (float(r.statistic), float(r.pvalue), len(xy))
        else:
            rho[m] = (None, None, len(xy))
    allxy = np.array([v for xy in data.values() for v in xy]).reshape(-1, 2)
    slope, intercept = None, 0.0
    if len(allxy) >= 3 and np.ptp(allxy[:, 0]) > 0:
        fit = sps.linregress(allxy[:, 0], allxy[:, 1])
        slope, intercept = float(fit.slope), float(fit.intercept)
    grand = float(allxy[:, 1].mean()) if len(allxy) else 0.0
    raw = {m: float(np.mean([g for _, g in xy])) for m, xy in data.items()}
    adj = (
        dict(raw)
        if slope is None
        else {m: grand + float(np.mean([g - (intercept + slope * x) for x, g in xy])) for m, xy in data.items()}
    )

    def order(d: dict[str, float]) -> list[str]:
        return sorted(d, key=lambda k: (-d[k], k))

    return LengthBias(rho, slope, raw, adj, order(raw), order(adj))


@dataclass(frozen=True)
class FailureTest:
    """Failure rate per model and a test that the rates are equal (Fisher exact for two models, else chi-square)."""

    counts: dict[str, tuple[int, int]]  # model -> (failed, total)
    test: str | None
    p: float | None
    reason: str | None = None


def failure_rates(counts: Mapping[str, tuple[int, int]]) -> FailureTest:
    """counts: model -> (failed grade requests, all grade requests)."""
    c = {m: (int(f), int(t)) for m, (f, t) in counts.items() if t > 0}
    if len(c) < 2:
        return FailureTest(c, None, None, reason="fewer than two models with grade requests")
    failed = sum(f for f, _ in c.values())
    if failed == 0 or failed == sum(t for _, t in c.values()):
        return FailureTest(c, None, None, reason="no failures" if failed == 0 else "every request failed")
    table = np.array([[f, t - f] for f, t in c.values()])  # (models, 2): failed, ok
    if len(c) == 2:
        return FailureTest(c, "Fisher exact", float(sps.fisher_exact(table).pvalue))
    return FailureTest(c, "chi-square", float(sps.chi2_contingency(table).pvalue))
