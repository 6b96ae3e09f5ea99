"""`benchctl plans` (the built-in study plans) and `benchctl plans show NAME|PATH` (a plan's resolved variants)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl import plans as pl
from benchctl.stages.cli import PresetOpt, console, parse_seeds

app = typer.Typer()

plans_app = typer.Typer(help="Study plans: which models `benchctl study --plan` trains.", rich_markup_mode=None)
app.add_typer(plans_app, name="plans")


@plans_app.callback(invoke_without_command=True)
def plans(ctx: typer.Context) -> None:
    """List the built-in plans (name, description, variants); `benchctl plans show NAME` resolves one."""
    if ctx.invoked_subcommand is not None:
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("plan", "variants", "description"):
        t.add_column(head, justify="right" if head == "variants" else "left", no_wrap=head != "description")
    for p in (pl.read(n) for n in pl.builtin_names()):  # read: listing them needs no models (no torch)
        t.add_row(p.name, str(len(p.variants)), p.description)
    console.print(t)
    console.print(
        f"default: {pl.DEFAULT_PLAN}. Run one with 'benchctl study --plan NAME' (or a path to a plan file); "
        "'benchctl plans show NAME' lists its variants."
    )


@plans_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A built-in plan's name or a plan file's path.")],
    preset: Annotated[str | None, PresetOpt.__metadata__[0]] = None,
    seeds: Annotated[
        str | None,
        typer.Option("--seeds", help="Comma list or range (default: the plan's); at most 1000 seeds."),
    ] = None,
) -> None:
    """Resolve a plan at a preset: each variant's architecture, overrides, steps, parameters and training FLOPs."""
    # torch: kept out of 'benchctl plans' and 'benchctl --help'
    from benchctl.core import accounting
    from benchctl.stages.retrofit.engine import has_lora

    plan, preset_, runs = pl.planned_runs(name, preset, None, parse_seeds(seeds))
    seeds_ = sorted({r.cfg.seed for r in runs})
    convs = pl.conversions(plan, preset_, seeds_[:1])
    console.print(f"plan {plan.name} ({plan.path}, sha256 {plan.sha256[:12]}): {plan.description}")
    console.print(f"preset {preset_}, seeds {', '.join(map(str, seeds_))}")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("variant", "arch", "steps", "params", "MFLOP/token", "train TFLOP", "set"):
        t.add_column(head, justify="left" if head in ("variant", "arch", "set") else "right", no_wrap=head != "set")
    cfgs = {r.variant: r.cfg for r in runs if r.cfg.seed == seeds_[0]} | {c.variant: c.cfg for c in convs}
    for v in plan.variants:
        if v.name not in cfgs:
            continue
        cfg = cfgs[v.name]
        row = accounting.describe(cfg)
        fpt = float(row["flops_per_token"])
        sets = [f"{k}={x}" for k, x in v.sets.items()]
        sets += [f"steps: {v.match_train_flops}'s training FLOPs"] if v.match_train_flops else []
        lora = f"+{v.lora_init or 'svd'}" if has_lora(cfg) else ""
        sets = [f"from {v.parent} ({v.init}{lora})"] + sets if v.parent else sets
        t.add_row(
            v.name,
            cfg.arch,
            f"{cfg.train.max_steps:,}",
            f"{row['total_params']:,}",
            f"{fpt / 1e6:.3f}",
            f"{fpt * cfg.train.max_steps * cfg.tokens_per_step / 1e12:.3f}",
            ", ".join(sets) or "-",
        )
    console.print(t)
    console.print(
        "FLOPs: the analytic count of matmuls (attention scores and the tied head included), forward + "
        "backward = 3x forward where gradients flow; train FLOPs = FLOPs/token x steps x tokens/step."
    )
    if convs:
        console.print(
            "A variant 'from' another is converted from that variant's trained weights at each seed, after "
            "it is trained; its train TFLOP are the healing steps' alone (the parent's are its own row's)."
        )
