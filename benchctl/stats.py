"""Statistics for the report: means with t confidence intervals, Welch's t-test, a paired bootstrap, Holm's
correction, and plain-language verdicts that say only what the numbers support.

Pure functions over plain sequences (numpy/scipy), no I/O. References:
- the t interval for a mean, mean ± t_{1-α/2, n-1} · s/√n (Student 1908);
- Welch's unequal-variance t-test with Welch–Satterthwaite degrees of freedom (Welch 1947), the same test as
  `scipy.stats.ttest_ind(equal_var=False)`; its CI for the difference is diff ± t_{1-α/2, df} · SE;
- the paired bootstrap over shared units (Efron & Tibshirani 1993, ch. 13 and 16.4): resample the paired
  differences with replacement; percentile CI; two-sided p-value from the bootstrap distribution shifted to
  the null (mean difference 0), p = (1 + #{|D* − D| ≥ |D|}) / (B + 1);
- Holm's step-down correction for a family of p-values (Holm 1979).

Nothing here invents a number: with too few observations a result carries `None` and a `reason`, and the
verdict says the comparison cannot be tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np
from scipy import stats as sps

LEVEL = 0.95


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
class Diff:
    """A difference of means a − b with its CI and two-sided p-value; p is None when it cannot be tested."""

    method: str  # "welch" | "paired-bootstrap"
    n_a: int
    n_b: int  # for the paired bootstrap, n_a = n_b = number of shared keys
    mean_a: float | None
    mean_b: float | None
    diff: float | None
    lo: float | None
    hi: float | None
    p: float | None
    level: float = LEVEL
    df: float | None = None  # Welch–Satterthwaite degrees of freedom
    t: float | None = None
    n_boot: int | None = None
    reason: str | None = None  # why p is None

    @property
    def testable(self) -> bool:
        return self.p is not None


def welch(a: Iterable[float | None], b: Iterable[float | None], level: float = LEVEL) -> Diff:
    """Welch's t-test for mean(a) − mean(b), with the Welch–Satterthwaite CI. Needs n ≥ 2 in each group."""
    xa, xb = _finite(a), _finite(b)
    na, nb = len(xa), len(xb)
    ma = float(xa.mean()) if na else None
    mb = float(xb.mean()) if nb else None
    diff = ma - mb if ma is not None and mb is not None else None
    if na < 2 or nb < 2:
        return Diff("welch", na, nb, ma, mb, diff, None, None, None, level, reason=_too_few(na, nb))
    va, vb = float(xa.var(ddof=1)) / na, float(xb.var(ddof=1)) / nb
    se = math.sqrt(va + vb)
    if se == 0.0:
        return Diff("welch", na, nb, ma, mb, diff, None, None, None, level, reason="no variation within either group")
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    t = diff / se
    p = float(2 * sps.t.sf(abs(t), df))
    h = float(sps.t.ppf((1 + level) / 2, df)) * se
    return Diff("welch", na, nb, ma, mb, diff, diff - h, diff + h, p, level, df=df, t=t)


def _too_few(na: int, nb: int) -> str:
    if na == 0 or nb == 0:
        return "no values for one of the two"
    if na == 1 and nb == 1:
        return "one seed per model"
    return "only one seed of one of the two"


def paired_bootstrap(
    a: Mapping[Hashable, float | None],
    b: Mapping[Hashable, float | None],
    *,
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = LEVEL,
) -> Diff:
    """Paired bootstrap of mean(a[k] − b[k]) over the keys both have (e.g. prompts), seeded and deterministic.

    Keys are sorted before resampling so the result does not depend on dict order. Needs ≥ 2 shared keys.
    """
    shared = [k for k in a if k in b and _is_num(a[k]) and _is_num(b[k])]
    try:
        shared.sort()
    except TypeError:  # keys of mixed types: any fixed order will do
        shared.sort(key=lambda k: (type(k).__name__, str(k)))
    n = len(shared)
    if n < 2:
        return Diff("paired-bootstrap", n, n, None, None, None, None, None, None, level, n_boot=n_boot,
                    reason=f"{'no' if n == 0 else 'only one'} shared prompt")
    xa = np.array([float(a[k]) for k in shared])  # (n,)
    xb = np.array([float(b[k]) for k in shared])  # (n,)
    d = xa - xb  # (n,)
    obs = float(d.mean())
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)  # (B,) bootstrap means of the paired differences
    chunk = max(1, 2_000_000 // n)  # bound memory of the (chunk, n) index matrix
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))  # (chunk, n)
        boot[start:stop] = d[idx].mean(axis=1)
    alpha = 1 - level
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    # Shift to the null (mean difference 0): how often is a resampled deviation as large as the observed one?
    extreme = int(np.count_nonzero(np.abs(boot - obs) >= abs(obs) - 1e-12 * max(1.0, abs(obs))))
    p = (1 + extreme) / (n_boot + 1)
    return Diff("paired-bootstrap", n, n, float(xa.mean()), float(xb.mean()), obs, float(lo), float(hi),
                min(1.0, p), level, n_boot=n_boot)


def _is_num(v: object) -> bool:
    return v is not None and math.isfinite(float(v))  # type: ignore[arg-type]


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm–Bonferroni adjusted p-values for one family; None entries are skipped and stay None."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    m = len(idx)
    order = sorted(idx, key=lambda i: (pvalues[i], i))
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))  # type: ignore[arg-type]
        out[i] = running
    return out


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


def _count_phrase(d: Diff, unit: str) -> str:
    if d.method == "paired-bootstrap":
        return f"over {d.n_a} shared {unit}"
    if d.n_a == d.n_b:
        return f"{d.n_a} {unit} each"
    return f"{d.n_a} and {d.n_b} {unit}"


def verdict(
    a: str,
    b: str,
    quantity: str,
    d: Diff,
    *,
    unit: str = "seeds",
    digits: int = 3,
    alpha: float = 0.05,
) -> str:
    """One sentence about a − b that states only what the numbers support.

    Significant (p < alpha and the CI excludes 0): "three-part's final validation loss is 0.041 lower than
    control's (95% CI 0.012 to 0.070, p = 0.010, 3 seeds each)." Otherwise "not distinguishable with ...", or
    "cannot be tested: <reason>" when there is no test at all.
    """
    pct = f"{round(d.level * 100):d}%"
    if not d.testable or d.diff is None:
        return f"{a} vs {b}, {quantity}: cannot be tested: {d.reason or 'not enough data'}."
    assert d.lo is not None and d.hi is not None
    ci_excludes_zero = d.lo > 0 or d.hi < 0
    counts = _count_phrase(d, unit)
    if d.p < alpha and ci_excludes_zero:  # type: ignore[operator]
        if d.diff < 0:
            word, mag, lo, hi = "lower", -d.diff, -d.hi, -d.lo
        else:
            word, mag, lo, hi = "higher", d.diff, d.lo, d.hi
        return (
            f"{a}'s {quantity} is {_fmt(mag, digits)} {word} than {b}'s "
            f"({pct} CI {_fmt(lo, digits)} to {_fmt(hi, digits)}, {fmt_p(d.p)}, {counts})."
        )
    detail = f"difference {_fmt(d.diff, digits)}, {pct} CI {_fmt(d.lo, digits)} to {_fmt(d.hi, digits)}, {fmt_p(d.p)}"
    if d.p < alpha:  # the bootstrap's p and percentile CI can disagree near the boundary: say so
        return f"{a} vs {b}, {quantity}: borderline ({detail}; the CI includes 0), {counts}."
    with_ = f"with {d.n_a} shared {unit}" if d.method == "paired-bootstrap" else f"with {counts}"
    return f"{a}'s and {b}'s {quantity} are not distinguishable {with_} ({detail})."


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
