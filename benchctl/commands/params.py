"""`benchctl params`: parameters by component, effective parameters and FLOPs/token per architecture."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich import box
from rich.table import Table

from benchctl.cli import JsonOpt, PresetOpt, SetOpt, app, console, split_list
from benchctl.config import parse_set


@app.command()
def params(
    preset: PresetOpt = "paper",
    arch: Annotated[Optional[str], typer.Option("--arch", "-a", help="One architecture, or a comma list.")] = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Parameter accounting per architecture, with the study's published totals beside ours."""
    from benchctl import accounting

    rows = accounting.table(preset, split_list(arch), parse_set(set_))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    short = {"depth_encoding": "enc", "adapter": "adapter", "recurrent_norm": "rec-norm", "lora": "lora"}
    counts = Table(title=f"unique parameters — preset '{preset}'", title_justify="left", box=box.SIMPLE_HEAD)
    compute = Table(title="depth and compute", title_justify="left", box=box.SIMPLE_HEAD)
    for head in ("arch", "unique params", "study", "", "own extras"):
        counts.add_column(head, justify="left" if head in ("arch", "own extras") else "right", no_wrap=True)
    for head in ("arch", "depth", "effective params", "training MFLOP/token"):
        compute.add_column(head, justify="left" if head == "arch" else "right", no_wrap=True)
    for r in rows:
        extras = "\n".join(f"{short[c]} {r[c]:,}" for c in accounting.COMPONENTS if c in short and r[c])
        study = f"{r['paper_total_params']:,}" if r["paper_total_params"] else "-"
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: ""}[r["matches_paper"]]
        counts.add_row(r["arch"], f"{r['total_params']:,}", study, mark, extras or "-")
        compute.add_row(
            r["arch"], str(r["effective_depth"]), f"{r['effective_params']:,}", f"{r['flops_per_token'] / 1e6:.1f}"
        )
    console.print(counts)
    console.print(compute)
    r0 = rows[0]
    console.print(
        f"Every model has the tied embedding ({r0['embedding']:,}), {r0['blocks']:,} in its unique blocks and the "
        f"final norm ({r0['final_norm']:,}); 'own extras' are the architecture's additions. "
        "✓ = equals the study's published total. depth = block applications per token; effective = parameters "
        f"applied per token, unrolled. MFLOP/token = training FLOPs (forward + backward, attention over "
        f"seq_len {r0['seq_len']} included)."
    )
    overrides = parse_set(set_)
    if overrides.get("model.recur_sampling", "fixed") != "fixed":
        console.print("Sampled depth is on: depth and effective params are at the configured recurrence, training "
                      "MFLOP/token is the expectation over the sampled depths (mean recurrence + 1).")
