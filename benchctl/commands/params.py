"""`benchctl params`: parameters by component, effective parameters and FLOPs/token per architecture."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.config import parse_set
from benchctl.stages.cli import JsonOpt, PresetOpt, SetOpt, console, split_list

app = typer.Typer()


@app.command(short_help="Parameters and FLOPs per architecture, beside the paper's.")
def params(
    preset: PresetOpt = "paper",
    arch: Annotated[str | None, typer.Option("--arch", "-a", help="One architecture, or a comma list.")] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Parameter accounting per architecture, with the study's published totals beside ours."""
    from benchctl.core import accounting  # torch: kept out of 'benchctl --help'

    rows = accounting.table(preset, split_list(arch), parse_set(set_))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    counts = Table(title=f"unique parameters — preset '{preset}'", title_justify="left", box=box.SIMPLE_HEAD)
    compute = Table(title="depth and compute", title_justify="left", box=box.SIMPLE_HEAD)
    for head in ("arch", "unique params", "study", ""):
        counts.add_column(head, justify="left" if head == "arch" else "right", no_wrap=True)
    for head in ("arch", "depth", "effective params", "training MFLOP/token"):
        compute.add_column(head, justify="left" if head == "arch" else "right", no_wrap=True)
    for r in rows:
        study = f"{r['paper_total_params']:,}" if r["paper_total_params"] else "-"
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: ""}[r["matches_paper"]]
        counts.add_row(r["arch"], f"{r['total_params']:,}", study, mark)
        compute.add_row(
            r["arch"], str(r["effective_depth"]), f"{r['effective_params']:,}", f"{r['flops_per_token'] / 1e6:.1f}"
        )
    names = accounting.component_names(rows)
    console.print(counts)
    # one column per architecture: as many tables as it takes to fit the terminal, so no count is ever cut short
    for i, group in enumerate(_fitting_groups(rows, names, console.width)):
        title = "unique parameters by component" + (" (continued)" if i else "")
        parts = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, min_width=len(title) + 2)
        parts.add_column("component", justify="left", no_wrap=True)
        for r in group:
            parts.add_column(r["arch"], justify="right", no_wrap=True)
        for j, c in enumerate(names):
            parts.add_row(c, *(f"{r[c]:,}" if c in r else "-" for r in group), end_section=j == len(names) - 1)
        parts.add_row("total", *(f"{r['total_params']:,}" for r in group))
        console.print(parts)
    console.print(compute)
    console.print(
        "Every model has the tied embedding, its unique blocks and the final norm; the other components are the "
        "architecture's own, and each column adds up to its total. "
        "✓ = equals the study's published total. depth = block applications per token; effective = parameters "
        f"applied per token, unrolled. MFLOP/token = training FLOPs (forward + backward, attention over "
        f"seq_len {rows[0]['seq_len']} included)."
    )
    overrides = parse_set(set_)
    if overrides.get("model.recur_sampling", "fixed") != "fixed":
        console.print(
            "Sampled depth is on: depth and effective params are at the configured recurrence, training "
            "MFLOP/token is the expectation over the sampled depths (mean recurrence + 1)."
        )


def _fitting_groups(rows: list[dict], names: list[str], width: int) -> list[list[dict]]:
    """The architectures' rows in consecutive groups whose component table fits `width` columns (at least one
    architecture a group): each column is as wide as its widest cell plus the table's padding."""
    pad = 3  # a column's padding and separator in box.SIMPLE_HEAD
    first = max(len(c) for c in [*names, "component", "total"]) + pad + 2
    groups: list[list[dict]] = [[]]
    used = first
    for r in rows:
        cells = [r["arch"], f"{r['total_params']:,}", *(f"{r[c]:,}" for c in names if c in r)]
        w = max(len(c) for c in cells) + pad
        if groups[-1] and used + w > width:
            groups.append([])
            used = first
        groups[-1].append(r)
        used += w
    return groups
