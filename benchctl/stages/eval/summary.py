"""The closing tables of `benchctl eval`: one per task, a row per run, the task's headline metrics with ± stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchctl.stages.eval.engine import EvalSummary

_SHOW = {  # metrics shown per bundled task, in order (the others are in the database)
    "tinystories_ppl": ("bits_per_byte", "word_perplexity"),
    "tinystories_ending": ("acc", "acc_norm"),
    "tinystories_names": ("acc", "acc_norm"),
    "tinystories_order": ("acc",),
}


def _fmt(value: float | None, stderr: float | None, metric: str) -> str:
    if value is None:
        return "-"
    digits = 2 if "perplexity" in metric else 3
    text = f"{value:.{digits}f}"
    return text + (f" ± {stderr:.{digits}f}" if stderr is not None else "")


def summary_tables(summary: EvalSummary) -> list[tuple[str, list[str], list[list[str]]]]:
    """One (task, headers, rows) per task: a row per run, a column per metric with ± stderr (one table per task
    keeps the closing output inside an 80-column terminal)."""
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    metrics: dict[str, list[str]] = {}
    for row in summary.rows:
        task, metric = row["task"], row["metric"]
        if task in _SHOW and metric not in _SHOW[task]:
            continue
        if metric not in metrics.setdefault(task, []):
            metrics[task].append(metric)
        cells[(row["run_id"], task, metric)] = row
    order = {t: i for i, t in enumerate(summary.tasks)}
    short = {
        "bits_per_byte": "bits/byte",
        "word_perplexity": "word ppl",
        "byte_perplexity": "byte ppl",
        "acc_mutual_info": "acc_mi",
    }
    tables = []
    for task in sorted(metrics, key=lambda t: (order.get(t, len(order)), t)):
        shown = _SHOW.get(task, ())
        cols = sorted(metrics[task], key=lambda m: (shown.index(m) if m in shown else len(shown), m))
        headers = ["model", "seed", "n_recur"] + [short.get(m, m) for m in cols]
        rows = []
        for run in summary.runs:
            line = [run.get("variant") or run["arch"], str(run["seed"]), str(run["n_recur"])]
            for m in cols:
                c = cells.get((run["id"], task, m))
                line.append(_fmt(c["value"], c["stderr"], m) if c else "-")
            rows.append(line)
        tables.append((task, headers, rows))
    return tables
