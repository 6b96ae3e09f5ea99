"""Report section of the eval stage: lm-eval results per model, evaluation depth and document limit."""

from __future__ import annotations

from benchctl.report.fmt import fnum, md_table, missing, need
from benchctl.report.frames import Frames, eval_frame


def eval_section(frames: Frames) -> list[str]:
    ctx, data = frames.ctx, frames.data
    out = ["## lm-eval", ""]
    ev = eval_frame(ctx, data.evals)
    if ev.empty:
        return out + need("No lm-eval results: `benchctl eval` produces them.")
    metrics = sorted({(t, m) for t, m in zip(ev["task"], ev["metric"])})
    keys = []
    for r in ev.itertuples():
        k = (r.model, r.n_recur, r.limit_n)
        if k not in keys:
            keys.append(k)
    headers = ["model", "n_recur", "limit", "seeds"] + [f"{t} {m}" for t, m in metrics]
    rows = []
    for m, r, lim in keys:
        g = ev[(ev["model"] == m) & (ev["n_recur"] == r) & (ev["limit_n"] == lim)]
        trained = g["trained_n_recur"].iloc[0]
        row = [m, f"{r}" + ("" if missing(trained) or int(trained) == r else f" (trained {int(trained)})"),
               "all" if lim == 0 else f"{lim:,}", int(g["seeds"].max())]
        for t, met in metrics:
            c = g[(g["task"] == t) & (g["metric"] == met)]
            if c.empty:
                row.append("-")
            else:
                v, se = c["value"].iloc[0], c["stderr"].iloc[0]
                row.append(fnum(v, 4) + ("" if missing(se) else f" ± {fnum(se, 4)}"))
        rows.append(row)
    out += md_table(headers, rows, right=range(1, len(headers))) + [""]
    out.append("value = mean over seeds; ± = lm-eval's standard error of one run (averaged over seeds when there "
               "are several); limit = documents per task (all = the full task).")
    out.append("")
    return out
