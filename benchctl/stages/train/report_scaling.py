"""Report section "Scaling": IsoFLOP curves from an IsoFLOP plan's runs (benchctl.plans, kind = "isoflop").

At each training-compute budget C every architecture is trained at several widths, each on the tokens C buys. Per
(architecture, budget) the final validation loss is fitted with a parabola in ln N (N: unique parameters); its
vertex is the compute-optimal size N*(C) and loss L*(C) (Hoffmann et al. 2022, approach 2).

Each fit is classified (`optimum`): degenerate (no minimum inside the widths), edge (a minimum the grid does not pin
down: it lies in the outermost interval of widths, or leaving out one width makes the fit degenerate), misfit (L*
lies above the lowest width mean by more than the seeds' noise allows) or ok. Only ok fits anchor anything further:
the exponents of N* ∝ C^a and L* ∝ C^b, the saturating L*(C) = E + A·C^(−α) (from four budgets: through three it is
exact) and the differences from the control; the others are listed with what they give.

The seed is the statistical unit: at one seed every width, budget and architecture trains on the same data stream,
so runs of one seed are not independent. Intervals are delta-method t-intervals with seeds − 1 degrees of freedom
from the least-squares sandwich clustered by seed (`benchctl.core.stats.seed_ci`); a difference between two
architectures with the same seeds is paired seed by seed.

An adaptive architecture (halting, routing) spends less than the budget its steps were set from: the x of each
optimum in the fits against compute is the training FLOPs the runs spent at N* (interpolated between the widths),
not the nominal budget.

Everything comes from the database: the grid point of each run (plan_runs.isoflop_*), its final loss, unique and
effective parameters and tokens (runs), the training split's size (runs.data_train_tokens) for its epochs, the
training FLOPs it spent (the train_flops metric) and its configuration, rebuilt for the embedding's share.
"""

from __future__ import annotations

import math
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd
from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

from benchctl.core import stats
from benchctl.report.context import ARCH_COLOURS, CONTROL, EXTRA_COLOURS
from benchctl.report.figures import MAX_FIG_WIDTH, _figure, _style
from benchctl.report.fmt import fint, fnum, md_table, missing
from benchctl.report.frames import Frames
from benchctl.stages.train.report_compute import _accounting, spent_flops

FIGURE = "isoflop.png"
NO_FIT = "fewer than 3 widths"  # a parabola needs three sizes
OFF_BUDGET = 0.10  # a run whose analytic training FLOPs miss its budget by more (too few steps) is not fitted
MIN_SLOPE_BUDGETS = 3  # a line in ln C needs three points to leave one to judge it by
MIN_SATURATING_BUDGETS = 4  # E + A·C^(−α) has three parameters: through three budgets it is exact
SPENT_NOTE = 0.02  # an optimum whose spent FLOPs miss the budget by more is said to have spent less

# A fit's class, from best to worst; only OK enters the fits against compute and the comparisons.
OK, MISFIT, EDGE, DEGENERATE, NONE = "ok", "misfit", "edge", "degenerate", "no fit"


@dataclass(frozen=True)
class Fit:
    """A parabola L = a·u² + b·u + c in u = ln N − x0 and its vertex; `problem` says why it gives no minimum inside
    the widths (else None). Centring on x0, the middle of the measured ln N, keeps the least squares well
    conditioned and makes the coefficients of different grids comparable."""

    a: float
    b: float
    c: float
    x0: float
    x_lo: float  # the measured range of ln N
    x_hi: float
    problem: str | None

    @property
    def vertex(self) -> float:
        """ln N*."""
        return self.x0 - self.b / (2 * self.a)

    @property
    def n_star(self) -> float:
        return math.exp(self.vertex)

    @property
    def l_star(self) -> float:
        return self.c - self.b * self.b / (4 * self.a)

    def loss(self, x: np.ndarray) -> np.ndarray:
        u = np.asarray(x, dtype=float) - self.x0
        return self.a * u * u + self.b * u + self.c

    def grad_vertex(self) -> np.ndarray:
        """d ln N* / d(a, b, c)."""
        return np.array([self.b / (2 * self.a**2), -1 / (2 * self.a), 0.0])

    def grad_l_star(self) -> np.ndarray:
        """d L* / d(a, b, c)."""
        return np.array([self.b**2 / (4 * self.a**2), -self.b / (2 * self.a), 1.0])


def _design(x: np.ndarray, x0: float) -> np.ndarray:
    u = x - x0
    return np.column_stack([u * u, u, np.ones_like(u)])


def fit_parabola(params: np.ndarray, loss: np.ndarray) -> Fit | None:
    """The least-squares parabola of loss in ln(params), or None with fewer than three distinct sizes (a parabola
    needs three). Degenerate (see `Fit.problem`) when it opens downward or has its vertex outside the sizes."""
    x = np.log(np.asarray(params, dtype=float))
    y = np.asarray(loss, dtype=float)
    sizes = np.unique(x)
    if len(sizes) < 3:
        return None
    x0 = float(sizes.mean())
    a, b, c = (float(v) for v in np.linalg.lstsq(_design(x, x0), y, rcond=None)[0])
    lo, hi = float(sizes[0]), float(sizes[-1])
    problem = None
    if a <= 0:
        problem = "the parabola opens downward (no minimum)"
    else:
        v = x0 - b / (2 * a)
        if v <= lo:
            problem = "the minimum is at the smallest width or below it"
        elif v >= hi:
            problem = "the minimum is at the largest width or above it"
    return Fit(a, b, c, x0, lo, hi, problem)


def seed_terms(points: pd.DataFrame, fit: Fit) -> tuple[dict[int, float], dict[int, float]]:
    """Each seed's linearised contribution to ln N* and to L*: its cluster's term of the least-squares sandwich,
    (XᵀX)⁻¹·X_sᵀ·e_s, through the gradient of the vertex (the delta method). Over seeds each sums to zero;
    `stats.seed_ci` turns them into an interval. With the same seed at every width this is exactly the spread of
    the parabolas fitted to each seed alone."""
    x = np.log(points["params"].to_numpy(float))
    y = points["final"].to_numpy(float)
    seed = points["seed"].to_numpy()
    design = _design(x, fit.x0)
    gram = design.T @ design
    resid = y - design @ np.array([fit.a, fit.b, fit.c])
    gv, gl = fit.grad_vertex(), fit.grad_l_star()
    log_n, l_star = {}, {}
    for s in sorted(set(seed.tolist())):
        mine = seed == s
        psi = np.linalg.solve(gram, design[mine].T @ resid[mine])
        log_n[int(s)], l_star[int(s)] = float(gv @ psi), float(gl @ psi)
    return log_n, l_star


def _mean_terms(points: pd.DataFrame) -> dict[int, float]:
    """Each seed's contribution to the mean of these runs (their residuals over the run count)."""
    y = points["final"].to_numpy(float)
    resid = y - y.mean()
    seed = points["seed"].to_numpy()
    return {int(s): float(resid[seed == s].sum()) / len(y) for s in sorted(set(seed.tolist()))}


@dataclass(frozen=True)
class Optimum:
    """The compute-optimal point of one (architecture, budget): its parabola, its class (`status`: OK, MISFIT, EDGE,
    DEGENERATE or NONE) with the reasons, each seed's contribution to ln N* and L*, and the t-intervals over seeds
    (None below two seeds, or without a vertex inside the widths)."""

    fit: Fit | None
    status: str
    reasons: tuple[str, ...]
    seeds_log_n: Mapping[int, float] = field(default_factory=dict)
    seeds_l: Mapping[int, float] = field(default_factory=dict)
    n_lo: float | None = None
    n_hi: float | None = None
    l_lo: float | None = None
    l_hi: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def has_vertex(self) -> bool:
        """A minimum inside the widths (ok, misfit or edge): N* and L* can be stated, if not relied on."""
        return self.status in (OK, MISFIT, EDGE)


def optimum(points: pd.DataFrame) -> Optimum:
    """Fit one (architecture, budget)'s runs (columns params, final, width, seed), classify the fit and give N* and
    L* their t-intervals over seeds.

    Edge, when the grid does not pin the minimum down: it lies in the outermost interval of widths (one width or
    none beyond it on that side, so where the loss turns is set by that one width and the curvature the other side
    gives), or leaving out any one width makes the fit degenerate. Misfit, when L* lies above the lowest width mean
    and the seeds' noise cannot account for it (the 95% interval of the difference, paired by seed, lies above 0;
    with one seed, any excess): the parabola does not describe the bottom of the curve, and the smallest loss a
    size reached at this budget is below the "optimum". The bare comparison is not used: the lowest of several
    noisy means lies below the curve it samples, so it would flag about half of the fits whose minimum sits at a
    measured width."""
    fit = fit_parabola(points["params"].to_numpy(float), points["final"].to_numpy(float))
    if fit is None:
        return Optimum(None, NONE, (NO_FIT,))
    if fit.problem is not None:
        return Optimum(fit, DEGENERATE, (fit.problem,))
    log_n, l_terms = seed_terms(points, fit)
    edge: list[str] = []
    sizes = sorted(set(np.log(points["params"].to_numpy(float)).tolist()))
    if fit.vertex < sizes[1]:
        edge.append("the minimum lies between the two smallest widths")
    elif fit.vertex > sizes[-2]:
        edge.append("the minimum lies between the two largest widths")
    fragile = []
    widths = sorted(set(points["width"]))
    for w in widths:
        rest = points[points["width"] != w]
        if rest["width"].nunique() < 3:
            continue
        f = fit_parabola(rest["params"].to_numpy(float), rest["final"].to_numpy(float))
        if f is not None and f.problem is not None:
            fragile.append(str(w))
    if fragile:
        which = fragile[0] if len(fragile) == 1 else ", ".join(fragile[:-1]) + " or " + fragile[-1]
        edge.append(f"leaving out width {which} makes it degenerate")
    means = points.groupby("width")["final"].mean()
    best = means.idxmin()
    excess = stats.seed_ci(
        fit.l_star - float(means[best]), [(1.0, l_terms), (-1.0, _mean_terms(points[points["width"] == best]))]
    )
    misfit = excess.estimate > 0 and (excess.lo is None or excess.lo > 0)
    reasons = list(edge)
    if misfit:
        beyond = "" if excess.lo is None else " beyond the seeds' noise"
        reasons.append(f"L* {fnum(fit.l_star)} lies above the width-{best} mean {fnum(means[best])}{beyond}")
    status = EDGE if edge else MISFIT if misfit else OK
    n_ci = stats.seed_ci(fit.vertex, [(1.0, log_n)])
    l_ci = stats.seed_ci(fit.l_star, [(1.0, l_terms)])
    return Optimum(
        fit,
        status,
        tuple(reasons),
        log_n,
        l_terms,
        None if n_ci.lo is None else math.exp(n_ci.lo),
        None if n_ci.hi is None else math.exp(n_ci.hi),
        l_ci.lo,
        l_ci.hi,
    )


class Curve(Protocol):
    """A fitted loss against compute over the budgets it was fitted to."""

    budgets: tuple[float, ...]

    def loss(self, c: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class PowerLaw:
    e: float
    a: float
    alpha: float
    c0: float  # C is measured in units of c0 (the smallest budget) for a well-conditioned fit
    budgets: tuple[float, ...]

    def loss(self, c: np.ndarray) -> np.ndarray:
        return self.e + self.a * (np.asarray(c, dtype=float) / self.c0) ** (-self.alpha)


def fit_power_law(budgets: list[float], losses: list[float]) -> PowerLaw | None:
    """L*(C) = E + A·C^(−α) through the compute-optimal losses (E ≥ 0, A ≥ 0, 0 ≤ α ≤ 5), or None with fewer than
    four budgets (three parameters pass exactly through three points, leaving nothing to judge them by) or when the
    fit does not converge."""
    if len(budgets) < MIN_SATURATING_BUDGETS:
        return None
    from scipy.optimize import curve_fit  # scipy: loaded only when there is a curve to fit

    c = np.asarray(budgets, dtype=float)
    y = np.asarray(losses, dtype=float)
    c0 = float(c.min())

    def f(x: np.ndarray, e: float, a: float, alpha: float) -> np.ndarray:
        return e + a * x ** (-alpha)

    p0 = (max(0.0, float(y.min()) - 0.5), max(1e-3, float(y.max() - y.min()) + 0.5), 0.3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            popt, _ = curve_fit(f, c / c0, y, p0=p0, bounds=([0.0, 0.0, 0.0], [float(y.min()), np.inf, 5.0]))
    except (RuntimeError, ValueError):
        return None
    return PowerLaw(float(popt[0]), float(popt[1]), float(popt[2]), c0, tuple(float(b) for b in budgets))


@dataclass(frozen=True)
class Slope:
    """ln y = intercept + slope·ln C, least squares over the budgets, with the slope's t-interval over seeds: each
    seed's contributions to the budgets' ln y, weighted as the slope weighs them, paired across budgets (a seed's
    data stream is the same at every budget)."""

    slope: float
    intercept: float
    lo: float | None
    hi: float | None
    budgets: tuple[float, ...]  # the compute C of each point (FLOPs spent at N*)

    def loss(self, c: np.ndarray) -> np.ndarray:
        """y at C (named for the `Curve` protocol, which the crossing of two L* fits reads)."""
        return np.exp(self.intercept + self.slope * np.log(np.asarray(c, dtype=float)))


def fit_slope(cs: Sequence[float], ys: Sequence[float], terms: Sequence[Mapping[int, float]]) -> Slope | None:
    """The line through (ln C, ln y) with `terms[i]` each seed's contribution to ln y at C = cs[i]; None with fewer
    than three points (through two a line is exact)."""
    if len(cs) < MIN_SLOPE_BUDGETS:
        return None
    u = np.log(np.asarray(cs, dtype=float))
    y = np.asarray(ys, dtype=float)
    d = u - u.mean()
    w = d / float(d @ d)
    slope = float(w @ y)
    ci = stats.seed_ci(slope, [(float(wi), t) for wi, t in zip(w, terms)])
    return Slope(slope, float(y.mean() - slope * u.mean()), ci.lo, ci.hi, tuple(float(c) for c in cs))


def crossing(p: Curve, q: Curve) -> tuple[float, float, list[float]]:
    """(lo, hi, budgets) where the two fits cross inside the budgets both were measured at, [lo, hi]."""
    lo, hi = max(min(p.budgets), min(q.budgets)), min(max(p.budgets), max(q.budgets))
    if hi <= lo:
        return lo, hi, []
    grid = np.geomspace(lo, hi, 400)
    d = p.loss(grid) - q.loss(grid)
    flips = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    return lo, hi, [float(math.sqrt(grid[i] * grid[i + 1])) for i in flips]


def interp_loglog(x: Sequence[float], y: Sequence[float], at: float) -> tuple[float, float] | None:
    """(y, d ln y / d ln x) at x = `at` on the broken line through the points in log-log, its end segments extended;
    None with fewer than two distinct positive x. Piecewise rather than one straight line: non-embedding parameters
    are not a power law of all parameters (the embedding grows with the width, the blocks with its square)."""
    pts = sorted({float(a): float(b) for a, b in zip(x, y) if a > 0 and b > 0}.items())
    if len(pts) < 2 or not at > 0:
        return None
    lx = np.log([p[0] for p in pts])
    ly = np.log([p[1] for p in pts])
    t = math.log(at)
    i = int(np.clip(np.searchsorted(lx, t) - 1, 0, len(lx) - 2))
    k = float((ly[i + 1] - ly[i]) / (lx[i + 1] - lx[i]))
    return float(math.exp(ly[i] + k * (t - lx[i]))), k


# --------------------------------------------------------------------------------------------------------------------
# Frames


def points_frame(frames: Frames) -> pd.DataFrame:
    """One row per done run an IsoFLOP plan reached at this preset: its grid point (architecture entry, width,
    budget), seed, final loss, unique, non-embedding and effective parameters, tokens, epochs and the training FLOPs
    it spent. The reported plan's runs when it is an IsoFLOP plan, else every IsoFLOP plan's."""
    cols = ["plan", "name", "arch", "width", "budget", "seed", "run_id", "final", "params", "non_embedding"]
    cols += ["effective", "tokens", "epochs", "spent", "on_budget"]
    ctx, pr = frames.ctx, frames.data.plan_runs
    if pr is None or pr.empty or ctx.done.empty or "isoflop_budget" not in pr:
        return pd.DataFrame(columns=cols)
    pr = pr[(pr["preset"] == ctx.preset) & pr["isoflop_budget"].notna()]
    if pr.empty:
        return pd.DataFrame(columns=cols)
    # the reported plan if it is an IsoFLOP plan, else the one with most runs (two grids' points never mix)
    counts = pr.groupby("plan")["run_id"].nunique().sort_index()
    chosen = ctx.plan if ctx.plan in counts.index else str(counts.sort_values(ascending=False, kind="stable").index[0])
    pr = pr[pr["plan"] == chosen]
    done = ctx.done.set_index("id")
    spent = spent_flops(frames)
    acc = _accounting(frames)  # each model's parameters by component, from its config
    rows = []
    seen: set[tuple[str, float]] = set()
    for r in pr.to_dict("records"):
        rid = str(r["run_id"])
        if rid not in done.index or (rid, float(r["isoflop_budget"])) in seen:
            continue
        seen.add((rid, float(r["isoflop_budget"])))
        d = done.loc[rid]
        parts = acc.get(d["model"], {})
        total, emb = _num(parts.get("total_params")), _num(parts.get("embedding"))
        tokens = _num(d.get("tokens_seen"))
        split = _num(d.get("data_train_tokens"))
        fpt = _num(d.get("flops_per_token"))
        analytic = fpt * tokens if fpt and tokens else None
        rows.append(
            {
                "plan": r["plan"],
                "name": str(r["isoflop_arch"]),
                "arch": d["arch"],
                "width": int(r["isoflop_width"]),
                "budget": float(r["isoflop_budget"]),
                "seed": int(d["seed"]),
                "run_id": rid,
                "final": _num(d.get("final_val_loss")),
                "params": _num(d.get("n_params")),
                # without a rebuilt config (another benchctl's) the embedding's share is unknown
                "non_embedding": total - emb if total is not None and emb is not None else None,
                "effective": _num(d.get("effective_params")),
                "tokens": tokens,
                "epochs": tokens / split if tokens and split else None,
                "spent": spent.get(rid),
                # too few steps to come near the budget (two budgets can even give one run): listed, not fitted
                "on_budget": analytic is None or abs(analytic / float(r["isoflop_budget"]) - 1) <= OFF_BUDGET,
            }
        )
    df = pd.DataFrame(rows, columns=cols)
    return df[df["final"].notna() & df["params"].notna()].reset_index(drop=True)


def only_isoflop(frames: Frames) -> bool:
    """True when every done run of the report is a point of an IsoFLOP plan's grid: its models are sizes of a few
    architectures at several budgets, compared in the Scaling section rather than pairwise."""
    done = frames.ctx.done
    if done.empty:
        return False
    pts = frames.once("isoflop_points", lambda: points_frame(frames))
    return set(done["id"].astype(str)) <= set(pts["run_id"])


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def names_in_order(pts: pd.DataFrame) -> list[str]:
    """Architecture entries: the control first, then as the plan's runs first met them."""
    names = list(dict.fromkeys(pts["name"]))
    return sorted(names, key=lambda n: (n != CONTROL, names.index(n)))


OPTIMA_COLUMNS = ["name", "budget", "widths", "runs", "seeds", "max_epochs", "status", "problem", "n_star", "n_lo"]
OPTIMA_COLUMNS += ["n_hi", "ne_star", "ne_lo", "ne_hi", "l_star", "l_lo", "l_hi", "c_spent", "tok_per_param"]
OPTIMA_COLUMNS += ["tok_per_eff"]


@dataclass(frozen=True)
class Point:
    """One (architecture, budget)'s optimum with what the fits against compute read besides it: the FLOPs its runs
    spent at N* (the budget where a run recorded none), and ln N* (non-embedding) with each seed's contribution to
    it (those to ln N* and L* are the optimum's)."""

    opt: Optimum
    c_spent: float
    log_ne: float | None
    seeds_log_ne: Mapping[int, float]


def optima_frame(pts: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, float], Point]]:
    """One row per (architecture entry, budget): the widths fitted, the class of the fit and why, N* (unique and
    non-embedding) and L* with their CIs, the FLOPs spent at N*, tokens per unique and per effective parameter at
    N* and the most epochs of its runs. N* and L* are given for every fit with a minimum inside the widths, ok or
    not; only ok ones enter anything else."""
    rows = []
    points: dict[tuple[str, float], Point] = {}
    order = names_in_order(pts)
    for budget in sorted(set(pts["budget"])):
        for name in order:
            g = pts[(pts["budget"] == budget) & (pts["name"] == name) & pts["on_budget"].astype(bool)]
            if g.empty:
                continue
            o = optimum(g)
            row: dict[str, Any] = dict.fromkeys(OPTIMA_COLUMNS)
            row.update(
                {
                    "name": name,
                    "budget": budget,
                    "widths": g["width"].nunique(),
                    "runs": len(g),
                    "seeds": g["seed"].nunique(),
                    "max_epochs": g["epochs"].max() if g["epochs"].notna().any() else None,
                    "status": o.status,
                    "problem": "; ".join(o.reasons) if o.reasons else None,
                    "c_spent": budget,
                }
            )
            log_ne, seeds_ne = None, {}
            if o.has_vertex and o.fit is not None:
                n = o.fit.n_star
                row.update({"n_star": n, "n_lo": o.n_lo, "n_hi": o.n_hi, "l_star": o.fit.l_star})
                row.update({"l_lo": o.l_lo, "l_hi": o.l_hi})
                per_width = g[["width", "params", "non_embedding", "spent"]].apply(pd.to_numeric, errors="coerce")
                per_width = per_width.groupby("width").mean()
                ne = _at_size(per_width, "non_embedding", n)
                if ne is not None:
                    log_ne, seeds_ne = math.log(ne[0]), {s: ne[1] * v for s, v in o.seeds_log_n.items()}
                    row["ne_star"] = ne[0]
                    for end in ("lo", "hi"):  # a monotone map: the interval's ends map to the interval
                        got = _at_size(per_width, "non_embedding", row[f"n_{end}"])
                        row[f"ne_{end}"] = None if got is None else got[0]
                spent = _at_size(per_width, "spent", n)
                row["c_spent"] = budget if spent is None else spent[0]
                tokens = _loglog(g["params"], g["tokens"], n)
                eff = _loglog(g["params"], g["effective"], n)
                row["tok_per_param"] = tokens / n if tokens else None
                row["tok_per_eff"] = tokens / eff if tokens and eff else None
            points[(name, budget)] = Point(o, float(row["c_spent"]), log_ne, seeds_ne)
            rows.append(row)
    return pd.DataFrame(rows, columns=OPTIMA_COLUMNS), points


def _at_size(per_width: pd.DataFrame, col: str, n: Any) -> tuple[float, float] | None:
    """`interp_loglog` of a per-width column at size n; None when n is missing or a width lacks the column (a run
    that recorded no spent FLOPs, a config another benchctl wrote)."""
    if missing(n) or not per_width[col].notna().all():
        return None
    return interp_loglog(per_width["params"].tolist(), per_width[col].tolist(), float(n))


def _loglog(x: pd.Series, y: pd.Series, at: float) -> float | None:
    """y at x = `at` on the straight line through the points in log-log (tokens and effective parameters are close to
    power laws of the unique parameters across widths at one budget)."""
    xs, ys = pd.to_numeric(x, errors="coerce"), pd.to_numeric(y, errors="coerce")
    ok = xs.notna() & ys.notna() & (xs > 0) & (ys > 0)
    if xs[ok].nunique() < 2:
        return None
    k, m = np.polyfit(np.log(xs[ok].to_numpy(float)), np.log(ys[ok].to_numpy(float)), 1)
    return float(math.exp(k * math.log(at) + m))


@dataclass(frozen=True)
class Laws:
    """An architecture's fits against compute through its ok optima: N* ∝ C^a (unique and non-embedding
    parameters), L* ∝ C^b, and L* = E + A·C^(−α) from four budgets."""

    budgets: int  # ok optima
    n: Slope | None
    ne: Slope | None
    loss: Slope | None
    saturating: PowerLaw | None


def power_laws(points: dict[tuple[str, float], Point], order: list[str]) -> dict[str, Laws]:
    """Per architecture entry with any point, in `order`: its fits against compute, C the FLOPs spent at N*."""
    out: dict[str, Laws] = {}
    for name in order:
        mine = [p for (n, _), p in sorted(points.items(), key=lambda kv: kv[0][1]) if n == name]
        if not mine:  # no run of it near a budget
            continue
        ok = [p for p in mine if p.opt.ok and p.opt.fit is not None]
        cs = [p.c_spent for p in ok]
        fits = [p.opt.fit for p in ok if p.opt.fit is not None]
        n = fit_slope(cs, [f.vertex for f in fits], [p.opt.seeds_log_n for p in ok])
        with_ne = [p for p in ok if p.log_ne is not None]
        ne = (
            fit_slope(cs, [p.log_ne for p in ok if p.log_ne is not None], [p.seeds_log_ne for p in ok])
            if len(with_ne) == len(ok)
            else None
        )
        l_terms = [{s: v / f.l_star for s, v in p.opt.seeds_l.items()} for p, f in zip(ok, fits)]
        lo = fit_slope(cs, [math.log(f.l_star) for f in fits], l_terms) if all(f.l_star > 0 for f in fits) else None
        sat = fit_power_law(cs, [f.l_star for f in fits])
        out[str(name)] = Laws(len(ok), n, ne, lo, sat)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Section


def flops(x: float) -> str:
    """A FLOP count as the plan's budgets are written: 1e12, 2.5e12."""
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def _ci(lo: Any, hi: Any, fmt: Any) -> str:
    return "-" if missing(lo) or missing(hi) else f"{fmt(lo)} to {fmt(hi)}"


def _params(x: Any) -> str:
    if missing(x):
        return "-"
    if float(x) < 1e3:  # an interval's end extended below the widths can be this small
        return f"{float(x):,.0f}"
    return f"{float(x) / 1e6:,.2f} M" if float(x) >= 1e6 else f"{float(x) / 1e3:,.1f} k"


def _sig(x: Any) -> str:
    """A ratio to three significant digits (tokens per parameter span 0.01 to 1000 across presets)."""
    return "-" if missing(x) else f"{float(x):.3g}"


def scaling_section(frames: Frames) -> list[str]:
    pts = frames.once("isoflop_points", lambda: points_frame(frames))
    if pts.empty:
        return []
    out = ["## Scaling", ""]
    plans_ = sorted(set(pts["plan"]))
    out.append(
        f"IsoFLOP curves of plan{'s' if len(plans_) > 1 else ''} {', '.join(f'`{p}`' for p in plans_)}: at each "
        "training-compute budget C every architecture was trained at several widths, each on the tokens C buys "
        "(steps set from benchctl's analytic FLOP count; an architecture whose depth depends on the data spends at "
        "most that). The final validation loss is fitted with a parabola in ln N (N: unique parameters); its "
        "minimum is the compute-optimal size N*(C) and loss L*(C). 95% CIs are delta-method t-intervals over seeds "
        "(k − 1 degrees of freedom for k seeds): at one seed every width, budget and architecture trains on the "
        "same data stream, so the seed, not the run, is the independent unit; with one seed there is none. Each "
        "fit is classed degenerate (the parabola opens downward, or its minimum lies at or beyond the smallest or "
        "largest width), edge (its minimum lies between the two smallest or the two largest widths, or leaving out "
        "one width makes the fit degenerate: the grid does not pin it down), misfit (L* lies above the lowest width "
        "mean beyond the seeds' noise) or ok. Only ok fits enter the fits against compute and the comparisons with "
        "the control; the others are listed. The fits against compute place each optimum at the training FLOPs its "
        "runs spent at N*, not at the nominal budget: less than the budget for an architecture whose depth depends "
        "on the data."
    )
    out.append("")
    out += _points_table(pts)
    out += _time_lines(frames, pts)
    opt, points = optima_frame(pts)
    # one order of the architectures in every table and sentence (opt is budget-major, and a budget that only some
    # have reached yet would put those first)
    order = names_in_order(pts)
    laws = power_laws(points, order)
    frames.figures[FIGURE] = _figure_isoflop(frames, pts, opt, points, laws)
    out += [f"![IsoFLOP curves and compute-optimal loss](figures/{FIGURE})", ""]
    out += _optima_table(opt, pts)
    out += _law_table(laws)
    out += _sentences(opt, points, laws, order)
    return out


def _points_table(pts: pd.DataFrame) -> list[str]:
    headers = ["budget (FLOPs)", "architecture", "width", "unique params", "non-embedding", "effective params"]
    headers += ["tokens", "epochs", "spent / budget", "seeds", "final val loss (mean)", "min to max"]
    rows = []
    for (budget, name, width), g in pts.groupby(["budget", "name", "width"], sort=False):
        spent = g["spent"].dropna()
        rows.append(
            (
                budget,
                names_in_order(pts).index(name),
                width,
                [
                    flops(budget),
                    name,
                    width,
                    fint(g["params"].iloc[0]),
                    fint(g["non_embedding"].iloc[0]),
                    fint(g["effective"].iloc[0]),
                    fint(g["tokens"].mean()),
                    "-" if g["epochs"].isna().all() else fnum(g["epochs"].max(), 2),
                    ("-" if spent.empty else fnum(float(spent.mean()) / float(budget), 3))
                    + ("" if g["on_budget"].all() else " (too few steps: not fitted)"),
                    len(g),
                    fnum(g["final"].mean()),
                    f"{fnum(g['final'].min())} to {fnum(g['final'].max())}" if len(g) > 1 else "-",
                ],
            )
        )
    rows.sort(key=lambda r: r[:3])
    lines = ["### Runs", ""]
    lines += md_table(headers, [r[3] for r in rows], right=[0, *range(2, len(headers))]) + [""]
    lines.append(
        "Epochs are passes over the training split (tokens trained on / tokens in the split; '-' for runs trained "
        "before benchctl recorded the split's size). Spent / budget is the training FLOPs the runs recorded over the "
        "budget their steps were set for: 1 up to the rounding of the steps, below 1 for an architecture whose "
        f"depth depends on the data; a run whose analytic FLOPs miss the budget by more than {OFF_BUDGET:.0%} "
        "(too few steps) is listed but not fitted. Non-embedding parameters are the unique ones outside the token "
        "embedding (which the output head shares); effective parameters count every use of a shared block."
    )
    lines.append("")
    return lines


def _time_lines(frames: Frames, pts: pd.DataFrame) -> list[str]:
    """What the grid cost in time, from each run's own clock, per device, precision and number of jobs sharing it;
    and a warning when the grid's runs trained at more than one precision (`train.dtype=auto` resolves per machine,
    so a plan resumed on other hardware can mix them, and its points then differ by more than size and data).

    A plan that was stopped and resumed has no single start and end (a run's started_at is its last resume), so the
    wall time is the runs' own time over the jobs that ran at once: exact when the jobs were kept busy, which a
    plan's executor does until its last runs."""
    done = frames.ctx.done
    runs = done[done["id"].isin(set(pts["run_id"]))]
    if runs.empty:
        return []
    cols = [c for c in ("train_seconds", "warmup_seconds", "eval_seconds") if c in runs]
    secs = runs[cols].apply(pd.to_numeric, errors="coerce").fillna(0.0).sum(axis=1)
    device = [("an unrecorded device" if missing(d) else str(d)) for d in runs.get("device_name", [None] * len(runs))]
    jobs = [1 if missing(j) else int(j) for j in runs.get("concurrent_jobs", [None] * len(runs))]
    dtype = [("an unrecorded precision" if missing(d) else str(d)) for d in runs.get("dtype", [None] * len(runs))]
    by = pd.DataFrame({"secs": secs.to_numpy(), "device": device, "dtype": dtype, "jobs": jobs})
    groups = list(by.groupby(["device", "dtype", "jobs"], sort=True))
    parts = []
    for (dev, dt, n_jobs), g in groups:
        hours = float(g["secs"].sum()) / 3600
        at_once = "one job at a time" if n_jobs == 1 else f"{n_jobs} jobs at a time"
        where = f"on {dev} in {dt}, {at_once} (about {hours / n_jobs:.2f} h of wall time)"
        parts.append(where if len(groups) == 1 else f"{len(g)} run{'s' if len(g) != 1 else ''}, {hours:.2f} h {where}")
    total = float(by["secs"].sum()) / 3600
    return [
        f"Time: these {len(by)} runs took {total:.2f} h of their own time (optimizer steps, warm-up and "
        "evaluations; start-up and checkpoints not counted)"
        + (" " if len(groups) == 1 else ": ")
        + "; ".join(parts)
        + ". Wall time is the runs' time over the jobs that shared the machine, so it holds while the jobs were kept "
        "busy.",
        "",
    ] + (
        [
            "**Mixed precision**: the grid's runs trained in "
            + " and ".join(f"{dt} ({n} runs)" for dt, n in by["dtype"].value_counts().sort_index().items())
            + " (`train.dtype=auto` resolves per machine), so two points may differ by their precision as well as "
            "their size and data.",
            "",
        ]
        if by["dtype"].nunique() > 1
        else []
    )


def _fit_note(r: dict[str, Any]) -> str:
    problem = "" if missing(r["problem"]) else str(r["problem"])
    return str(r["status"]) + (f": {problem}" if problem else "")


def _optima_table(opt: pd.DataFrame, pts: pd.DataFrame) -> list[str]:
    headers = ["budget (FLOPs)", "architecture", "widths", "seeds", "N* (unique)", "95% CI", "N* (non-embedding)"]
    headers += ["95% CI", "L*", "95% CI", "C spent at N*", "tokens / N*", "tokens / effective N*", "max epochs", "fit"]
    rows = []
    for r in opt.to_dict("records"):
        rows.append(
            [
                flops(r["budget"]),
                r["name"],
                r["widths"],
                r["seeds"],
                _params(r["n_star"]),
                _ci(r["n_lo"], r["n_hi"], _params),
                _params(r["ne_star"]),
                _ci(r["ne_lo"], r["ne_hi"], _params),
                fnum(r["l_star"]),
                _ci(r["l_lo"], r["l_hi"], fnum),
                "-" if missing(r["n_star"]) else f"{flops(r['c_spent'])} ({r['c_spent'] / r['budget']:.2f})",
                _sig(r["tok_per_param"]),
                _sig(r["tok_per_eff"]),
                fnum(r["max_epochs"], 2),
                _fit_note(r),
            ]
        )
    lines = ["### Compute-optimal size and loss", ""]
    lines += md_table(headers, rows, right=[0, *range(2, len(headers) - 1)]) + [""]
    share = (1 - pd.to_numeric(pts["non_embedding"], errors="coerce") / pts["params"]).dropna()
    embedding = (
        f" The embedding is {share.min():.0%} to {share.max():.0%} of the unique parameters across this grid, so N* "
        "mostly follows the embedding's width; the non-embedding column shows what the blocks hold."
        if not share.empty
        else ""
    )
    lines.append(
        "N* and L* are the vertex of the parabola through the budget's runs, given for edge and misfit fits too (the "
        "grid does not support them); N* (non-embedding) is the parameters outside the embedding of a model of "
        "size N*, interpolated in log-log between the widths, its CI the ends of N*'s mapped the same way."
        + embedding
        + " C spent at N* is the training FLOPs of a run of size N* (interpolated between the widths' runs; in "
        "brackets over the budget): the budget within the rounding of the steps for a fixed-depth architecture, "
        "less for one whose depth depends on the data, whose runs are compared at their nominal budget but placed "
        "at what they spent in the fits against compute. Tokens / N* and tokens / effective N* are the tokens a "
        "run of size N* trains on at that budget (a straight line in log-log through the widths) per unique and "
        "per effective parameter. Max epochs is the most passes over the training split among the point's runs."
    )
    lines.append("")
    return lines


def _slope_cells(fit: Slope | None) -> list[str]:
    if fit is None:
        return ["-", "-"]
    return [fnum(fit.slope), _ci(fit.lo, fit.hi, fnum)]


def _law_table(laws: dict[str, Laws]) -> list[str]:
    lines = ["### Scaling with compute", ""]
    rows = []
    for name, law in laws.items():
        if law.saturating is None and law.budgets >= MIN_SATURATING_BUDGETS:
            sat = "did not converge"
        elif law.saturating is None:
            sat = f"needs {MIN_SATURATING_BUDGETS} budgets with an ok fit"
            if law.budgets == MIN_SATURATING_BUDGETS - 1:
                sat += f" (through {law.budgets} its 3 parameters are exact)"
        else:
            p = law.saturating
            sat = f"E = {fnum(p.e)}, A = {p.a:.3f} at C = {flops(p.c0)}, α = {fnum(p.alpha)}"
        rows.append([name, law.budgets, *_slope_cells(law.n), *_slope_cells(law.ne), *_slope_cells(law.loss), sat])
    headers = ["architecture", "ok budgets", "a: N* ∝ C^a", "95% CI", "a (non-embedding N*)", "95% CI"]
    headers += ["b: L* ∝ C^b", "95% CI", "L* = E + A·C^(−α)"]
    lines += md_table(headers, rows, right=range(1, 8)) + [""]
    lines.append(
        "Least squares of ln N*, ln N* (non-embedding) and ln L* on ln C over the budgets whose fit is ok (from "
        f"{MIN_SLOPE_BUDGETS} of them), with C the training FLOPs spent at N*. The 95% CIs are t-intervals over "
        "seeds: each seed's contribution to every budget's optimum, weighted as the slope weighs the budgets, summed "
        "seed by seed (a seed's data stream is the same at every budget). They cover the seeds' noise in the optima, "
        "not how far N*(C) is from a power law, and describe only the measured budgets. L* ∝ C^b is a local slope, "
        "since loss has a floor; E + A·C^(−α) models it, fitted by least squares from "
        f"{MIN_SATURATING_BUDGETS} ok budgets (E ≥ 0, 0 ≤ α ≤ 5, C in units of the smallest, A the excess over E "
        "there), as point estimates without CIs."
    )
    lines.append("")
    return lines


def _sentences(
    opt: pd.DataFrame, points: dict[tuple[str, float], Point], laws: dict[str, Laws], order: list[str]
) -> list[str]:
    names = [n for n in order if n in set(opt["name"])]
    if CONTROL not in names or len(names) < 2:
        return []
    lines = ["### Against the control", ""]
    for name in names:
        if name == CONTROL:
            continue
        parts = []
        for budget in sorted(set(opt["budget"])):
            a, c = points.get((name, budget)), points.get((CONTROL, budget))
            if a is None or c is None:
                continue
            parts.append(_at_budget(name, budget, a, c))
        law = laws[name].loss if name in laws else None
        base = laws[CONTROL].loss if CONTROL in laws else None
        if law is None or base is None:
            parts.append(
                f"Whether the L* ∝ C^b fits of {name} and the control cross cannot be said: "
                f"{_which_fit(name, law, base)}."
            )
        else:
            lo, hi, at = crossing(law, base)
            if hi <= lo:
                parts.append(f"{name} and the control share no measured compute range to compare their fits over.")
            elif at:
                where = ", ".join(f"C ≈ {flops(c)}" for c in at)
                parts.append(
                    f"The L* ∝ C^b fits of {name} and the control cross within the compute both spent ({flops(lo)} "
                    f"to {flops(hi)}) at {where}."
                )
            else:
                better = (
                    "below" if float(law.loss(np.array([lo]))[0]) < float(base.loss(np.array([lo]))[0]) else "above"
                )
                parts.append(
                    f"The L* ∝ C^b fits of {name} and the control do not cross within the compute both spent "
                    f"({flops(lo)} to {flops(hi)}): {name}'s stays {better} the control's there; beyond it the fits "
                    "say nothing."
                )
        lines.append(f"- **{name}**: " + " ".join(parts))
    lines.append("")
    lines.append(
        "Each difference is the other architecture's compute-optimal loss minus the control's at the same budget "
        "(negative: the other is better), with a 95% t-interval over seeds. At one seed both trained on the same "
        "data stream, so each seed's contributions to the two L* are paired, and what the seed does to both cancels "
        "(where the seeds differ the two are taken as independent). A difference is called one only when its CI "
        "excludes 0; these are separate intervals, not corrected for their number. An architecture whose depth "
        "depends on the data spent less than the budget it is compared at, as the sentence says."
    )
    lines.append("")
    return lines


_NOT_OK = {DEGENERATE: "degenerate", EDGE: "at the edge of its widths", MISFIT: "a misfit"}


def _at_budget(name: str, budget: float, a: Point, c: Point) -> str:
    at = f"At C = {flops(budget)}"
    oa, oc = a.opt, c.opt
    if not oa.ok or not oc.ok:
        if oa.fit is None and oc.fit is None:
            return f"{at} there is no comparison: neither {name} nor the control has a fit ({NO_FIT})."
        why = [
            f"{n} has no fit ({NO_FIT})" if o.fit is None else f"the fit of {n} is {_NOT_OK[o.status]}"
            for n, o in ((name, oa), ("the control", oc))
            if not o.ok
        ]
        return f"{at} there is no comparison: {' and '.join(why)}."
    assert oa.fit is not None and oc.fit is not None
    diff = oa.fit.l_star - oc.fit.l_star
    spent = ""
    ra, rc = a.c_spent / budget, c.c_spent / budget
    if abs(ra - 1) > SPENT_NOTE or abs(rc - 1) > SPENT_NOTE:
        spent = f"; {name} spent {ra:.2f} of the budget at its N*, the control {rc:.2f}"
    ci = stats.seed_ci(diff, [(1.0, oa.seeds_l), (-1.0, oc.seeds_l)])
    if ci.lo is None or ci.hi is None:
        return f"{at}, L* − L*(control) = {fnum(diff)} (no CI: needs two seeds of each{spent})."
    how = "" if ci.paired else ", seeds not paired"
    text = f"95% CI {fnum(ci.lo)} to {fnum(ci.hi)}{how}{spent}"
    if ci.lo > 0 or ci.hi < 0:
        word = "lower" if diff < 0 else "higher"
        return f"{at} its compute-optimal loss is {word} than the control's by {fnum(abs(diff))} ({text})."
    return f"{at} its compute-optimal loss is not distinguishable from the control's (difference {fnum(diff)}, {text})."


def _colour(name: str, arch: str, order: list[str]) -> str:
    if name == arch and arch in ARCH_COLOURS:
        return ARCH_COLOURS[arch]
    return EXTRA_COLOURS[order.index(name) % len(EXTRA_COLOURS)]


def _figure_isoflop(
    frames: Frames,
    pts: pd.DataFrame,
    opt: pd.DataFrame,
    points: dict[tuple[str, float], Point],
    laws: dict[str, Laws],
) -> Any:
    """One panel per budget (loss against unique parameters, log axis, seeds as dots, fitted parabola, optimum as a
    star), then L*(C) and N*(C) at the compute spent with their CIs and the fits through the ok optima."""
    budgets = sorted(set(pts["budget"]))
    names = names_in_order(pts)
    arch_of = dict(zip(pts["name"], pts["arch"]))
    colour = {n: _colour(n, str(arch_of[n]), names) for n in names}
    n_panels = len(budgets) + 2
    cols = min(3, n_panels)
    rows_ = math.ceil(n_panels / cols)
    line_style = {OK: "-", EDGE: "--", MISFIT: "--", DEGENERATE: ":"}
    with _style():
        fig = _figure(min(4.4 * cols, MAX_FIG_WIDTH), 3.7 * rows_ + 0.9)
        axes = np.atleast_1d(fig.subplots(rows_, cols)).ravel()
        for ax, budget in zip(axes, budgets):
            for name in names:
                g = pts[(pts["budget"] == budget) & (pts["name"] == name)]
                if g.empty:
                    continue
                on = g["on_budget"].astype(bool)
                ax.scatter(g.loc[on, "params"], g.loc[on, "final"], s=14, color=colour[name], alpha=0.75, label=name)
                if (~on).any():  # too few steps to reach the budget: drawn hollow, not fitted
                    ax.scatter(g.loc[~on, "params"], g.loc[~on, "final"], s=14, facecolors="none", color=colour[name])
                p = points.get((name, budget))
                if p is None or p.opt.fit is None:
                    continue
                f = p.opt.fit
                x = np.linspace(f.x_lo, f.x_hi, 100)
                ax.plot(np.exp(x), f.loss(x), line_style[p.opt.status], color=colour[name], linewidth=1.4)
                if p.opt.has_vertex:  # a filled star only where the optimum is relied on
                    ax.plot(
                        f.n_star,
                        f.l_star,
                        "*",
                        markersize=11,
                        zorder=4,
                        markeredgecolor="black" if p.opt.ok else colour[name],
                        markerfacecolor=colour[name] if p.opt.ok else "none",
                        markeredgewidth=0.5 if p.opt.ok else 1.2,
                    )
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(EngFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("unique parameters")
            ax.set_ylabel("final validation loss")
            ax.set_title(f"C = {flops(budget)} FLOPs", fontsize=11)
        ok = opt[opt["status"] == OK]
        for ax, col, lo_col, hi_col, title in (
            (axes[len(budgets)], "l_star", "l_lo", "l_hi", "L*(C) ± 95% CI, L* ∝ C^b"),
            (axes[len(budgets) + 1], "n_star", "n_lo", "n_hi", "N*(C) ± 95% CI, N* ∝ C^a"),
        ):
            if ok.empty:
                ax.text(
                    0.5,
                    0.5,
                    "no budget has an ok optimum",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=10,
                    color="#555555",
                )
            for name in names:
                g = ok[ok["name"] == name]
                if g.empty:
                    continue
                y = g[col].astype(float)
                lo = (y - g[lo_col].astype(float)).fillna(0).clip(lower=0)
                hi = (g[hi_col].astype(float) - y).fillna(0).clip(lower=0)
                ax.errorbar(g["c_spent"], y, yerr=[lo, hi], fmt="o", color=colour[name], capsize=3)
                law = laws.get(name)
                fit = None if law is None else (law.loss if col == "l_star" else law.n)
                if fit is not None:
                    c = np.geomspace(min(fit.budgets), max(fit.budgets), 100)
                    ax.plot(c, fit.loss(c), "-", color=colour[name], linewidth=1.2)
            ax.set_xscale("log")
            ax.set_xlabel("training FLOPs spent at N*")
            ax.set_ylabel("compute-optimal loss L*" if col == "l_star" else "compute-optimal size N*")
            ax.set_title(title, fontsize=11)
            if ok.empty:  # after the scale, which would bring its own ticks back
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            # ticks at the budgets (the points of an architecture that spent less sit left of theirs): a log axis
            # narrower than a decade would otherwise label its minor ticks over each other
            ax.set_xticks(budgets, [flops(b) for b in budgets])
            ax.xaxis.set_minor_formatter(NullFormatter())
            if col == "n_star":
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(EngFormatter())
                ax.yaxis.set_minor_formatter(NullFormatter())
        for extra in axes[n_panels:]:
            extra.set_visible(False)
        handles, labels = axes[0].get_legend_handles_labels()
        # below the panels, never over a curve
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize=9, frameon=True)
        fig.suptitle(
            f"IsoFLOP curves · preset {frames.ctx.preset}\n"
            # wrapped to the figure's width (about 9 bold characters to the inch at this size)
            + textwrap.fill(
                "dots = runs (hollow: off budget, not fitted), line = parabola in ln N (dashed: edge or misfit, "
                "dotted: degenerate), star = optimum (hollow: not ok)",
                width=int(9 * fig.get_size_inches()[0]),
            ),
            fontsize=12,
            fontweight="bold",
        )
    return fig


def _which_fit(name: str, law: object, base: object) -> str:
    """Which of the two has a power-law fit, when not both: 'neither has a power-law fit', 'only the control has
    one'."""
    if law is None and base is None:
        return "neither has a power-law fit"
    return f"only {'the control' if law is None else name} has one"
