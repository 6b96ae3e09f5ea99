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


@app.command()
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
    parts = Table(title="unique parameters by component", title_justify="left", box=box.SIMPLE_HEAD)
    compute = Table(title="depth and compute", title_justify="left", box=box.SIMPLE_HEAD)
    for head in ("arch", "unique params", "study", ""):
        counts.add_column(head, justify="left" if head == "arch" else "right", no_wrap=True)
    parts.add_column("component", justify="left", no_wrap=True)
    for r in rows:
        parts.add_column(r["arch"], justify="right", no_wrap=True)
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
    for i, c in enumerate(names):
        parts.add_row(c, *(f"{r[c]:,}" if c in r else "-" for r in rows), end_section=i == len(names) - 1)
    parts.add_row("total", *(f"{r['total_params']:,}" for r in rows))
    console.print(counts)
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
