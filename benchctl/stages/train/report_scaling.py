"""Report section "Scaling": IsoFLOP curves from an IsoFLOP plan's runs (benchctl.plans, kind = "isoflop").

At each training-compute budget C every architecture is trained at several widths, each on the tokens C buys. Per
(architecture, budget) the final validation loss is fitted with a parabola in log N (N: unique parameters); its
vertex is the compute-optimal size N*(C) and loss L*(C) (Hoffmann et al. 2022, approach 2). A fit whose parabola
opens downward, or whose vertex lies outside the measured widths (the minimum at the edge), has no optimum inside
the grid: it is reported as degenerate and enters nothing else. CIs come from a stratified bootstrap over the runs
(each width's seeds resampled with replacement, the fit redone). Where an architecture has non-degenerate optima at
three budgets or more, L*(C) = E + A·C^(−α) is fitted to them; two architectures' fits are compared only within the
budgets both were measured at, so nothing is said about a budget no run was trained at.

Everything comes from the database: the grid point of each run (plan_runs.isoflop_*), its final loss, unique and
effective parameters and tokens (runs), the training split's size (runs.data_train_tokens) for its epochs, and the
training FLOPs it spent (the train_flops metric).
"""

from __future__ import annotations

import math
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.ticker import EngFormatter, NullFormatter

from benchctl.report.context import ARCH_COLOURS, CONTROL, EXTRA_COLOURS
from benchctl.report.figures import _figure, _style
from benchctl.report.fmt import fint, fnum, md_table, missing
from benchctl.report.frames import Frames
from benchctl.stages.train.report_compute import spent_flops

BOOTSTRAP = 1000  # resamples per (architecture, budget): percentile CIs to about ±1 percentile point
BOOTSTRAP_SEED = 0  # fixed: the same database gives the same report
FIGURE = "isoflop.png"
NO_FIT = "fewer than 3 widths"  # a parabola needs three sizes
OFF_BUDGET = 0.10  # a run whose analytic training FLOPs miss its budget by more (too few steps) is not fitted


@dataclass(frozen=True)
class Fit:
    """A parabola L = a·x² + b·x + c in x = ln N and its vertex; `problem` says why it gives no optimum (else
    None)."""

    a: float
    b: float
    c: float
    x_lo: float  # the measured range of ln N
    x_hi: float
    problem: str | None

    @property
    def n_star(self) -> float:
        return math.exp(-self.b / (2 * self.a))

    @property
    def l_star(self) -> float:
        return self.c - self.b * self.b / (4 * self.a)

    def loss(self, x: np.ndarray) -> np.ndarray:
        return self.a * x * x + self.b * x + self.c


def fit_parabola(params: np.ndarray, loss: np.ndarray) -> Fit | None:
    """The least-squares parabola of loss in ln(params), or None with fewer than three distinct sizes (a parabola
    needs three). Degenerate (see `Fit.problem`) when it opens downward or has its vertex outside the sizes."""
    x = np.log(np.asarray(params, dtype=float))
    y = np.asarray(loss, dtype=float)
    if len(np.unique(x)) < 3:
        return None
    a, b, c = (float(v) for v in np.polyfit(x, y, 2))
    lo, hi = float(x.min()), float(x.max())
    problem = None
    if a <= 0:
        problem = "the parabola opens downward (no minimum)"
    else:
        v = -b / (2 * a)
        if v <= lo:
            problem = "the minimum is at the smallest width or below it"
        elif v >= hi:
            problem = "the minimum is at the largest width or above it"
    return Fit(a, b, c, lo, hi, problem)


@dataclass(frozen=True)
class Optimum:
    """The compute-optimal point of one (architecture, budget) with its bootstrap: percentile CIs over the resamples
    whose fit had a minimum inside the widths, and the share that did not."""

    fit: Fit | None
    n_lo: float | None
    n_hi: float | None
    l_lo: float | None
    l_hi: float | None
    boot_l: np.ndarray  # L* of each resample (NaN where the resample's fit was degenerate)
    degenerate_share: float | None  # of the resamples (None: no bootstrap, one seed per width)

    @property
    def ok(self) -> bool:
        return self.fit is not None and self.fit.problem is None


def optimum(points: pd.DataFrame, n_boot: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED) -> Optimum:
    """Fit one (architecture, budget)'s points (columns params, final, width) and bootstrap it: each width's runs
    resampled with replacement, as many as it has. Without two runs at every width there is no bootstrap."""
    fit = fit_parabola(points["params"].to_numpy(float), points["final"].to_numpy(float))
    empty = np.full(0, np.nan)
    groups = [g for _, g in points.groupby("width", sort=True)]
    if fit is None or fit.problem is not None or min(len(g) for g in groups) < 2:
        return Optimum(fit, None, None, None, None, empty, None)
    rng = np.random.default_rng(seed)
    ns, ls = np.full(n_boot, np.nan), np.full(n_boot, np.nan)
    # each width's columns as arrays once: read from the frame inside the loop they cost more than the fits
    cols = [(g["params"].to_numpy(float), g["final"].to_numpy(float)) for g in groups]
    for i in range(n_boot):
        idx = [rng.integers(0, len(gp), len(gp)) for gp, _ in cols]
        p = np.concatenate([gp[j] for (gp, _), j in zip(cols, idx)])
        y = np.concatenate([gy[j] for (_, gy), j in zip(cols, idx)])
        f = fit_parabola(p, y)
        if f is not None and f.problem is None:
            ns[i], ls[i] = f.n_star, f.l_star
    good = ~np.isnan(ns)
    share = 1.0 - float(good.mean())
    if good.sum() < 2:
        return Optimum(fit, None, None, None, None, ls, share)
    n_lo, n_hi = np.percentile(ns[good], [2.5, 97.5])
    l_lo, l_hi = np.percentile(ls[good], [2.5, 97.5])
    return Optimum(fit, float(n_lo), float(n_hi), float(l_lo), float(l_hi), ls, share)


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
    three budgets or when the fit does not converge."""
    if len(budgets) < 3:
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


def crossing(p: PowerLaw, q: PowerLaw) -> tuple[float, float, list[float]]:
    """(lo, hi, budgets) where the two fits cross inside the budgets both were measured at, [lo, hi]."""
    lo, hi = max(min(p.budgets), min(q.budgets)), min(max(p.budgets), max(q.budgets))
    if hi <= lo:
        return lo, hi, []
    grid = np.geomspace(lo, hi, 400)
    d = p.loss(grid) - q.loss(grid)
    flips = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    return lo, hi, [float(math.sqrt(grid[i] * grid[i + 1])) for i in flips]


# --------------------------------------------------------------------------------------------------------------------
# Frames


def points_frame(frames: Frames) -> pd.DataFrame:
    """One row per done run an IsoFLOP plan reached at this preset: its grid point (architecture entry, width,
    budget), seed, final loss, unique and effective parameters, tokens, epochs and the training FLOPs it spent. The
    reported plan's runs when it is an IsoFLOP plan, else every IsoFLOP plan's."""
    cols = ["plan", "name", "arch", "width", "budget", "seed", "run_id", "final", "params", "effective", "tokens"]
    cols += ["epochs", "spent", "on_budget"]
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
    rows = []
    seen: set[tuple[str, float]] = set()
    for r in pr.to_dict("records"):
        rid = str(r["run_id"])
        if rid not in done.index or (rid, float(r["isoflop_budget"])) in seen:
            continue
        seen.add((rid, float(r["isoflop_budget"])))
        d = done.loc[rid]
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


OPTIMA_COLUMNS = ["name", "budget", "widths", "runs", "max_epochs", "n_star", "l_star", "n_lo", "n_hi", "l_lo", "l_hi"]
OPTIMA_COLUMNS += ["tok_per_param", "tok_per_eff", "degenerate_share", "problem"]


def optima_frame(pts: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, float], Optimum]]:
    """One row per (architecture entry, budget): the widths fitted, N* and L* with their CIs, tokens per unique and
    per effective parameter at N*, the most epochs of its runs and why the fit is degenerate (if it is)."""
    rows = []
    opts: dict[tuple[str, float], Optimum] = {}
    order = names_in_order(pts)
    for budget in sorted(set(pts["budget"])):
        for name in order:
            g = pts[(pts["budget"] == budget) & (pts["name"] == name) & pts["on_budget"].astype(bool)]
            if g.empty:
                continue
            o = optimum(g)
            opts[(name, budget)] = o
            row: dict[str, Any] = {
                "name": name,
                "budget": budget,
                "widths": g["width"].nunique(),
                "runs": len(g),
                "max_epochs": g["epochs"].max() if g["epochs"].notna().any() else None,
                "n_star": None,
                "l_star": None,
                "n_lo": o.n_lo,
                "n_hi": o.n_hi,
                "l_lo": o.l_lo,
                "l_hi": o.l_hi,
                "tok_per_param": None,
                "tok_per_eff": None,
                "degenerate_share": o.degenerate_share,
                "problem": NO_FIT if o.fit is None else o.fit.problem,
            }
            if o.ok and o.fit is not None:
                n = o.fit.n_star
                row["n_star"], row["l_star"] = n, o.fit.l_star
                tokens = _loglog(g["params"], g["tokens"], n)
                eff = _loglog(g["params"], g["effective"], n)
                row["tok_per_param"] = tokens / n if tokens else None
                row["tok_per_eff"] = tokens / eff if tokens and eff else None
            rows.append(row)
    return pd.DataFrame(rows, columns=OPTIMA_COLUMNS), opts


def _loglog(x: pd.Series, y: pd.Series, at: float) -> float | None:
    """y at x = `at` on the straight line through the points in log-log (tokens and effective parameters are close to
    power laws of the unique parameters across widths at one budget)."""
    xs, ys = pd.to_numeric(x, errors="coerce"), pd.to_numeric(y, errors="coerce")
    ok = xs.notna() & ys.notna() & (xs > 0) & (ys > 0)
    if xs[ok].nunique() < 2:
        return None
    k, m = np.polyfit(np.log(xs[ok].to_numpy(float)), np.log(ys[ok].to_numpy(float)), 1)
    return float(math.exp(k * math.log(at) + m))


def power_laws(opt: pd.DataFrame, order: list[str]) -> dict[str, PowerLaw | None]:
    """Per architecture entry, in `order`: the power law through its usable optima (None with fewer than 3)."""
    out: dict[str, PowerLaw | None] = {}
    for name in order:
        if name not in set(opt["name"]):  # no run of it near a budget
            continue
        g = opt[(opt["name"] == name) & opt["l_star"].notna()]
        out[str(name)] = fit_power_law(list(g["budget"]), list(g["l_star"]))
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
        "minimum is the compute-optimal size N*(C) and loss L*(C). 95% CIs are percentile intervals of a bootstrap "
        f"over the runs ({BOOTSTRAP} resamples, each width's seeds drawn with replacement); with one seed per width "
        "there is none. A fit whose parabola opens downward or whose minimum lies at or beyond the smallest or "
        "largest width is degenerate: it is listed, and used nowhere else."
    )
    out.append("")
    out += _points_table(pts)
    out += _time_lines(frames, pts)
    opt, opts = optima_frame(pts)
    # one order of the architectures in every table and sentence (opt is budget-major, and a budget that only some
    # have reached yet would put those first)
    order = names_in_order(pts)
    laws = power_laws(opt, order)
    frames.figures[FIGURE] = _figure_isoflop(frames, pts, opt, opts, laws)
    out += [f"![IsoFLOP curves and compute-optimal loss](figures/{FIGURE})", ""]
    out += _optima_table(opt)
    out += _law_table(opt, laws)
    out += _sentences(opt, opts, laws, order)
    return out


def _points_table(pts: pd.DataFrame) -> list[str]:
    headers = ["budget (FLOPs)", "architecture", "width", "unique params", "effective params", "tokens", "epochs"]
    headers += ["spent / budget", "seeds", "final val loss (mean)", "min to max"]
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
        "(too few steps) is listed but not fitted. Effective parameters count every use of a shared block."
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


def _optima_table(opt: pd.DataFrame) -> list[str]:
    headers = ["budget (FLOPs)", "architecture", "widths", "N* (unique)", "95% CI", "L*", "95% CI"]
    headers += ["tokens / N*", "tokens / effective N*", "max epochs", "fit"]
    rows = []
    for r in opt.to_dict("records"):
        # pandas stores a text column's None as NaN once any row has a text: `missing`, not `is None`
        problem = None if missing(r["problem"]) else str(r["problem"])
        note = "ok" if problem is None else f"degenerate: {problem}"
        if problem == NO_FIT:
            note = f"no fit: {NO_FIT}"
        if problem is None and not missing(r["degenerate_share"]) and r["degenerate_share"] > 0:
            note += f" ({r['degenerate_share']:.0%} of resamples degenerate, left out of the CIs)"
        rows.append(
            [
                flops(r["budget"]),
                r["name"],
                r["widths"],
                _params(r["n_star"]),
                _ci(r["n_lo"], r["n_hi"], _params),
                fnum(r["l_star"]),
                _ci(r["l_lo"], r["l_hi"], fnum),
                _sig(r["tok_per_param"]),
                _sig(r["tok_per_eff"]),
                fnum(r["max_epochs"], 2),
                note,
            ]
        )
    lines = ["### Compute-optimal size and loss", ""]
    lines += md_table(headers, rows, right=[0, *range(2, len(headers) - 1)]) + [""]
    lines.append(
        "N* and L* are the vertex of the parabola through the budget's runs; tokens / N* and tokens / effective N* "
        "are the tokens a run of size N* trains on at that budget (interpolated in log-log between the widths) per "
        "unique and per effective parameter. Max epochs is the most passes over the training split among the "
        "point's runs."
    )
    lines.append("")
    return lines


def _law_table(opt: pd.DataFrame, laws: dict[str, PowerLaw | None]) -> list[str]:
    lines = ["### L*(C) = E + A·C^(−α)", ""]
    rows = []
    for name, law in laws.items():
        n_ok = int(opt[(opt["name"] == name)]["l_star"].notna().sum())
        if law is None:
            why = "fewer than 3 budgets with an optimum" if n_ok < 3 else "the fit did not converge"
            rows.append([name, n_ok, "-", "-", "-", why])
            continue
        exact = " (3 points, 3 parameters: an exact fit, nothing left to judge it by)" if n_ok == 3 else ""
        rows.append([name, n_ok, fnum(law.e), f"{law.a:.3f} at C = {flops(law.c0)}", fnum(law.alpha), f"fitted{exact}"])
    lines += md_table(["architecture", "budgets", "E", "A", "α", "fit"], rows, right=range(1, 5)) + [""]
    lines.append(
        "Fitted by least squares to the compute-optimal losses of the budgets whose fit is not degenerate, with "
        "C in units of the smallest such budget (A is the excess over E there); E and α are point estimates "
        "without CIs, and describe only the measured budgets."
    )
    lines.append("")
    return lines


def _sentences(
    opt: pd.DataFrame, opts: dict[tuple[str, float], Optimum], laws: dict[str, PowerLaw | None], order: list[str]
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
            a, c = opts.get((name, budget)), opts.get((CONTROL, budget))
            if a is None or c is None:
                continue
            parts.append(_at_budget(name, budget, a, c))
        law, base = laws.get(name), laws.get(CONTROL)
        if law is None or base is None:
            parts.append(
                f"Whether the L*(C) fits of {name} and the control cross cannot be said: {_which_fit(name, law, base)}."
            )
        else:
            lo, hi, at = crossing(law, base)
            if hi <= lo:
                parts.append(f"{name} and the control share no measured budget range to compare their fits over.")
            elif at:
                where = ", ".join(f"C ≈ {flops(c)}" for c in at)
                parts.append(
                    f"The L*(C) fits of {name} and the control cross within the measured budgets ({flops(lo)} to "
                    f"{flops(hi)}) at {where}."
                )
            else:
                better = (
                    "below" if float(law.loss(np.array([lo]))[0]) < float(base.loss(np.array([lo]))[0]) else "above"
                )
                parts.append(
                    f"The L*(C) fits of {name} and the control do not cross within the measured budgets "
                    f"({flops(lo)} to {flops(hi)}): {name}'s stays {better} the control's there; beyond them the fits "
                    "say nothing."
                )
        lines.append(f"- **{name}**: " + " ".join(parts))
    lines.append("")
    lines.append(
        "Each difference is the recurrent architecture's compute-optimal loss minus the control's at the same "
        "budget (negative: the recurrent one is better), with a 95% percentile CI from resampling both "
        "architectures' runs independently; a difference is called one only when its CI excludes 0. These are "
        "separate intervals, not corrected for their number."
    )
    lines.append("")
    return lines


def _at_budget(name: str, budget: float, a: Optimum, c: Optimum) -> str:
    at = f"At C = {flops(budget)}"
    if not a.ok or not c.ok:
        if a.fit is None and c.fit is None:
            return f"{at} there is no comparison: neither {name} nor the control has a fit ({NO_FIT})."
        why = [
            f"{n} has no fit ({NO_FIT})" if o.fit is None else f"the fit of {n} is degenerate"
            for n, o in ((name, a), ("the control", c))
            if not o.ok
        ]
        return f"{at} there is no comparison: {' and '.join(why)}."
    assert a.fit is not None and c.fit is not None
    diff = a.fit.l_star - c.fit.l_star
    both = ~np.isnan(a.boot_l) & ~np.isnan(c.boot_l) if len(a.boot_l) and len(c.boot_l) else np.zeros(0, bool)
    if both.sum() < 2:
        return f"{at}, L* − L*(control) = {fnum(diff)} (no CI: needs two seeds at every width of both)."
    lo, hi = np.percentile(a.boot_l[both] - c.boot_l[both], [2.5, 97.5])
    ci = f"95% CI {fnum(lo)} to {fnum(hi)}"
    if lo > 0 or hi < 0:
        word = "lower" if diff < 0 else "higher"
        return f"{at} its compute-optimal loss is {word} than the control's by {fnum(abs(diff))} ({ci})."
    return f"{at} its compute-optimal loss is not distinguishable from the control's (difference {fnum(diff)}, {ci})."


def _colour(name: str, arch: str, order: list[str]) -> str:
    if name == arch and arch in ARCH_COLOURS:
        return ARCH_COLOURS[arch]
    return EXTRA_COLOURS[order.index(name) % len(EXTRA_COLOURS)]


def _figure_isoflop(
    frames: Frames,
    pts: pd.DataFrame,
    opt: pd.DataFrame,
    opts: dict[tuple[str, float], Optimum],
    laws: dict[str, PowerLaw | None],
) -> Any:
    """One panel per budget (loss against unique parameters, log axis, seeds as dots, fitted parabola, optimum as a
    star) and a last panel with L*(C), its CIs and the power-law fits."""
    budgets = sorted(set(pts["budget"]))
    names = names_in_order(pts)
    arch_of = dict(zip(pts["name"], pts["arch"]))
    colour = {n: _colour(n, str(arch_of[n]), names) for n in names}
    n_panels = len(budgets) + 1
    cols = min(3, n_panels)
    rows_ = math.ceil(n_panels / cols)
    with _style():
        fig = _figure(4.6 * cols, 3.9 * rows_ + 0.8)
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
                o = opts.get((name, budget))
                if o is not None and o.fit is not None:
                    x = np.linspace(o.fit.x_lo, o.fit.x_hi, 100)
                    style = "-" if o.ok else ":"
                    ax.plot(np.exp(x), o.fit.loss(x), style, color=colour[name], linewidth=1.4)
                    if o.ok:
                        ax.plot(
                            o.fit.n_star,
                            o.fit.l_star,
                            "*",
                            color=colour[name],
                            markersize=11,
                            zorder=4,
                            markeredgecolor="black",
                            markeredgewidth=0.5,
                        )
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(EngFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("unique parameters")
            ax.set_ylabel("final validation loss")
            ax.set_title(f"C = {flops(budget)} FLOPs", fontsize=11)
        ax = axes[len(budgets)]
        if not opt["l_star"].notna().any():
            ax.text(
                0.5,
                0.5,
                "no budget has a usable optimum\n(every fit is degenerate)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=10,
                color="#555555",
            )
            ax.set_yticks([])
            ax.set_xticks([])
        for name in names:
            g = opt[(opt["name"] == name) & opt["l_star"].notna()]
            if g.empty:
                continue
            lo = (g["l_star"] - g["l_lo"].astype(float)).fillna(0).clip(lower=0)
            hi = (g["l_hi"].astype(float) - g["l_star"]).fillna(0).clip(lower=0)
            ax.errorbar(g["budget"], g["l_star"], yerr=[lo, hi], fmt="o", color=colour[name], capsize=3, label=name)
            law = laws.get(name)
            if law is not None:
                c = np.geomspace(min(law.budgets), max(law.budgets), 100)
                ax.plot(c, law.loss(c), "-", color=colour[name], linewidth=1.2)
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel("compute-optimal loss L*")
        ax.set_title("L*(C) ± 95% CI, power-law fit", fontsize=11)
        for extra in axes[n_panels:]:
            extra.set_visible(False)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize=9, frameon=True)
        fig.suptitle(
            f"IsoFLOP curves · preset {frames.ctx.preset}\n"
            # wrapped to the figure's width (about 9 bold characters to the inch at this size)
            + textwrap.fill(
                "dots = runs (hollow: off budget, not fitted), line = parabola in ln N (dotted: degenerate), "
                "star = optimum",
                width=int(9 * 4.6 * cols),
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
