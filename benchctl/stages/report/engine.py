"""The report's top level: header, then every registered stage's sections in study order; save to disk.

Nothing here names a stage or a section: a stage module under benchctl.stages contributes its sections (and the
figure files they may write), so a new stage appears in the report without touching this module. The pieces the
sections are built from (loading, models and colours, frames, formatting, figures) are the benchctl.report package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchctl import stages
from benchctl.core import liveness
from benchctl.core.errors import ConfigError
from benchctl.report.context import Context, build_context
from benchctl.report.figures import save_figures
from benchctl.report.fmt import escape_html, need
from benchctl.report.frames import Frames
from benchctl.report.load import Data, read
from benchctl.stages.report.options import ReportOptions


@dataclass
class Rendered:
    markdown: str
    figures: dict[str, Any]  # file name -> matplotlib Figure
    preset: str | None
    other_presets: list[tuple[str, int, int]]


def figure_names() -> tuple[str, ...]:
    """Every figure file a report can contain (the registered stages declare them)."""
    return stages.figure_names()


def header(ctx: Context) -> list[str]:
    title = f"# benchctl report: preset `{ctx.preset}`" if ctx.preset else "# benchctl report"
    out = [title, ""]
    out.append(
        "Every number below is computed from results.db by `benchctl report`; only runs with status `done` "
        "enter the statistics. 95% CIs are t-intervals over training seeds unless a table says otherwise, and "
        "cover that variation only: every run is scored on one fixed validation sample (see Loss)."
    )
    out.append("")
    if ctx.preset is None:
        out += need(
            "The database has no runs yet: `benchctl train-all --preset tiny` (or `benchctl study`) produces them."
        )
        return out
    st = ctx.runs["status"].value_counts()
    counts = ", ".join(f"{int(st[s])} {s}" for s in sorted(st.index, key=_status_rank))
    out.append(f"Runs of preset `{ctx.preset}`: {counts or 'none'}.")
    if ctx.other_presets:
        others = "; ".join(f"`{p}` ({d} done of {n})" for p, d, n in ctx.other_presets)
        out.append(f"Other presets in the database: {others}. Report one with `benchctl report --preset NAME`.")
    out.append("")
    return out


def _status_rank(s: str) -> tuple[int, str]:
    order = ["done", "running", liveness.INTERRUPTED, "pending", "failed"]
    return (order.index(s), s) if s in order else (len(order), s)


def render(data: Data, preset: str | None = None, plan: str | None = None) -> Rendered:
    """The whole report as markdown plus figures, from loaded tables. Pure: the same data gives the same output.
    `plan` names models by that plan's variant names first (see build_context)."""
    ctx = build_context(data.runs, preset, data.plan_runs, plan)
    frames = Frames(ctx, data)
    lines = header(ctx)
    for stage in stages.registered():
        for section in stage.sections:
            lines += section(frames)
    while lines and lines[-1] == "":
        lines.pop()
    return Rendered(escape_html("\n".join(lines)) + "\n", frames.figures, ctx.preset, ctx.other_presets)


def build(
    db: str | os.PathLike | Any, preset: str | None = None, plan: str | None = None, only_plan: bool = False
) -> Rendered:
    """Read results.db (a path, opened read-only, or an open connection) and render the report in memory.
    `only_plan` keeps just the runs `plan` reached (a database often holds several plans' runs of one preset)."""
    data = with_run_states(read(db, stages.tables()))
    if only_plan and plan is not None:
        data = plan_only(data, plan)
    return render(data, preset, plan)


def with_run_states(data: Data) -> Data:
    """The runs as they stand now: a running run whose process is gone shows as interrupted (benchctl.core.liveness).
    A fact of this machine and this moment, not of the database, so it is settled here, where the file is read, and
    `render` stays a function of the data alone."""
    runs = data.runs
    if runs.empty or "status" not in runs:
        return data
    runs = runs.copy()
    runs["status"] = [liveness.run_state(r) for r in runs.to_dict("records")]
    return data.replace(runs=runs)


def plan_only(data: Data, plan: str) -> Data:
    """The data with only the runs `plan` reached; a plan with no runs in the database is a ConfigError naming the
    plans that have some."""
    pr = data.plan_runs
    known = sorted(set(pr["plan"])) if not pr.empty else []
    if plan not in known:
        have = f"plans with runs here: {', '.join(known)}" if known else "no plan has runs here yet"
        raise ConfigError(f"the database has no runs of plan '{plan}' ({have})")
    ids = set(pr.loc[pr["plan"] == plan, "run_id"].astype(str))
    return data.replace(
        runs=data.runs[data.runs["id"].astype(str).isin(ids)].reset_index(drop=True),
        plan_runs=pr[pr["plan"] == plan].reset_index(drop=True),
    )


def save(rendered: Rendered, out_dir: str | os.PathLike) -> Path:
    """Write out_dir/report.md and out_dir/figures/*.png; figures of sections without data any more are removed."""
    out = Path(out_dir)
    figdir = out / "figures"
    try:
        figdir.mkdir(parents=True, exist_ok=True)
        return _save(rendered, out, figdir)
    except OSError as e:  # a file where the folder should be, a read-only or pseudo file system, a full disk
        why = e.strerror or str(e)
        raise ConfigError(
            f"cannot write the report into {out} ({why}: {e.filename or out}); pass another --out"
        ) from None


def _save(rendered: Rendered, out: Path, figdir: Path) -> Path:
    for name in figure_names():
        if name not in rendered.figures and (figdir / name).exists():
            (figdir / name).unlink()  # a stale figure from an earlier report would contradict this one
    save_figures(rendered.figures, figdir)
    path = out / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(rendered.markdown, encoding="utf-8")
    tmp.replace(path)
    return path


def write_report(
    db: str | os.PathLike | Any,
    out_dir: str | os.PathLike,
    preset: str | None = None,
    plan: str | None = None,
    only_plan: bool = False,
) -> Path:
    """results.db -> out_dir/report.md (+ out_dir/figures/*.png); returns the path of report.md.

    preset=None reports the preset with most finished runs (the report names it and lists the others); `plan`
    names the models by that plan's variant names first, and with `only_plan` the report shows its runs alone."""
    return save(build(db, preset, plan, only_plan), out_dir)


def run(db: str | os.PathLike | Any, opts: ReportOptions) -> tuple[Rendered, Path]:
    """The report `opts` asks for, from results.db (a path, opened read-only, or an open connection), written to
    `opts.out_dir`: what was rendered, and the path of report.md."""
    rendered = build(db, opts.preset, opts.plan, opts.only_plan)
    return rendered, save(rendered, opts.out_dir)
