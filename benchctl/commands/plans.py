"""`benchctl plans` (the built-in study plans) and `benchctl plans show NAME|PATH` (a plan's resolved variants)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl import plans as pl
from benchctl.stages.cli import (
    DataOpt,
    DbOpt,
    PresetOpt,
    SetOpt,
    TaskOpt,
    console,
    db_path_of,
    overrides_with_data,
    parse_seeds,
)

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


@plans_app.command("show", short_help="A plan at a preset: its variants, parameters and FLOPs.")
def show(
    name: Annotated[str, typer.Argument(help="A built-in plan's name or a plan file's path.")],
    preset: Annotated[str | None, PresetOpt.__metadata__[0]] = None,
    seeds: Annotated[
        str | None,
        typer.Option("--seeds", help="Comma list or range (default: the plan's); at most 1000 seeds."),
    ] = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    task: TaskOpt = None,
    db: DbOpt = None,
) -> None:
    """Resolve a plan at a preset: each variant's architecture, overrides, steps, parameters and training FLOPs. An
    IsoFLOP plan lists every run's width, parameters, tokens, passes over the training data (of --data, prepared
    if needed, else the hub's data if already prepared) and estimated training time: per architecture and width, at
    the speed that shape's finished runs of the preset in results.db trained at, else timed here."""
    # torch: kept out of 'benchctl plans' and 'benchctl --help'
    import architectures
    from benchctl.core import accounting
    from benchctl.stages.retrofit.engine import has_lora

    overrides = overrides_with_data(set_, data, task)
    plan, preset_, runs = pl.planned_runs(name, preset, None, parse_seeds(seeds), overrides)
    if plan.isoflop is not None:
        _show_isoflop(plan, preset_, runs, db_path_of(db))
        return
    seeds_ = sorted({r.cfg.seed for r in runs})
    convs = pl.conversions(plan, preset_, seeds_[:1], overrides)
    console.print(f"plan {plan.name} ({plan.path}, sha256 {plan.sha256[:12]}): {plan.description}")
    console.print(f"preset {preset_}, seeds {', '.join(map(str, seeds_))}")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for head in ("variant", "arch", "steps", "params", "MFLOP/token", "train TFLOP", "set"):
        t.add_column(head, justify="left" if head in ("variant", "arch", "set") else "right", no_wrap=head != "set")
    cfgs = {r.variant: r.cfg for r in runs if r.cfg.seed == seeds_[0]} | {c.variant: c.cfg for c in convs}
    archs = {v.name: cfgs[v.name].arch for v in plan.variants if v.name in cfgs}
    bounded = []  # (variant, the adaptive variant it matches)
    for v in plan.variants:
        if v.name not in cfgs:
            continue
        cfg = cfgs[v.name]
        row = accounting.describe(cfg)
        fpt = float(row["flops_per_token"])
        sets = [f"{k}={x}" for k, x in v.sets.items()]
        if v.match_train_flops:
            adaptive = v.match_train_flops in archs and architectures.get(archs[v.match_train_flops]).adaptive_compute
            bound = " (analytic upper bound)" if adaptive else ""
            sets += [f"steps: {v.match_train_flops}'s training FLOPs{bound}"]
            bounded += [(v.name, v.match_train_flops)] if adaptive else []
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
    for name, other in bounded:
        console.print(
            f"{name} matches {other}'s analytic training FLOPs, an upper bound: {other} ({archs[other]}) gives "
            f"each token a depth that depends on the data, and the count takes every token at full depth. What "
            f"{other} spends is at most that (its runs record it as train_flops), so {name} trains with at least "
            f"the compute {other} uses.",
            highlight=False,
        )
    if convs:
        console.print(
            "A variant 'from' another is converted from that variant's trained weights at each seed, after "
            "it is trained; its train TFLOP are the healing steps' alone (the parent's are its own row's)."
        )


OFF_BUDGET = 0.05  # an IsoFLOP run whose training FLOPs differ from its budget by more is flagged


def _show_isoflop(plan: pl.Plan, preset: str, runs: list[pl.PlannedRun], db_path: Path) -> None:
    """An IsoFLOP plan: one row per (architecture, width, budget) with what it trains on and how long it takes."""
    from benchctl.core import accounting, data
    from benchctl.core.progress import format_duration
    from benchctl.stages.train import estimate

    iso = plan.isoflop
    assert iso is not None
    seeds_ = sorted({r.cfg.seed for r in runs})
    first = [r for r in runs if r.cfg.seed == seeds_[0]]
    cfg0 = first[0].cfg
    src = str(cfg0.data.source)
    prepared = (
        data.find_prepared(cfg0.data, cfg0.model.vocab_size)
        if src == "hub"
        else data.prepare(cfg0.data, cfg0.model.vocab_size, progress=False)
    )
    split = prepared.n_train_tokens if prepared is not None else None
    # each shape at the speed its finished runs trained at, else a few steps of it timed here now, with the threads
    # each of two jobs gets (what the wall-time line assumes)
    est = estimate.estimate([r.cfg for r in first], db_path, preset, estimate.half_the_cores())
    console.print(f"plan {plan.name} ({plan.path}, sha256 {plan.sha256[:12]}): {plan.description}")
    console.print(
        f"preset {preset}, seeds {', '.join(map(str, seeds_))}; IsoFLOP grid: {len(iso.archs)} architecture(s) x "
        f"{len(iso.widths)} widths x {len(iso.budgets)} budgets = {len(first)} runs per seed, {len(runs)} in all"
    )
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    heads = ("variant", "arch", "width", "heads", "FFN", "steps", "warm-up", "unique params", "effective params")
    heads += ("tokens", "epochs", "train TFLOP", "est. time")
    for head in heads:
        t.add_column(head, justify="left" if head in ("variant", "arch") else "right", no_wrap=True)
    total = 0.0
    over: list[str] = []
    off: list[str] = []  # too few steps to come within OFF_BUDGET of the budget
    most = 0.0
    for r in first:
        cfg = r.cfg
        row = accounting.describe(cfg)
        tokens = cfg.train.max_steps * cfg.tokens_per_step
        ep = pl.epochs(cfg, split) if split else None
        most = max(most, ep or 0.0)
        if ep is not None and ep > iso.max_epochs:
            over.append(r.variant)
        secs = est.run_seconds(cfg)
        point = next(v.point for v in plan.variants if v.name == r.variant)
        ratio = accounting.training_flops(cfg) / point.budget if point is not None else 1.0
        if abs(ratio - 1) > OFF_BUDGET:
            off.append(r.variant)
        total += secs * len(seeds_)
        t.add_row(
            r.variant,
            cfg.arch,
            str(cfg.model.dim),
            str(cfg.model.n_heads),
            str(cfg.model.hidden_dim),
            f"{cfg.train.max_steps:,}",
            str(cfg.train.warmup_steps),
            f"{row['total_params']:,}",
            f"{row['effective_params']:,}",
            f"{tokens:,}",
            "-" if ep is None else f"{ep:.2f}" + (" !" if ep > iso.max_epochs else ""),
            f"{accounting.training_flops(cfg) / 1e12:.3f}" + (" ~" if abs(ratio - 1) > OFF_BUDGET else ""),
            format_duration(secs),
        )
    console.print(t)
    console.print(
        f"Steps make each run's analytic training FLOPs (FLOPs/token x steps x tokens/step) equal its budget, to the "
        f"nearest step; an architecture whose depth depends on the data spends at most that. Heads = width / "
        f"{pl.head_dim_of(plan, preset)}, FFN width by llama2.c's rule; warm-up, evaluation and checkpoint intervals "
        "keep the preset's share of the steps. Effective params count every use of a shared block."
    )
    if split is None:
        console.print(
            "epochs: the training data is not prepared yet; pass --data DIR (or run 'benchctl prepare') to count them"
        )
    else:
        console.print(
            f"epochs: passes over the {split:,}-token training split ({prepared.source if prepared else ''}); "
            f"at most {most:.2f}, the plan allows {iso.max_epochs:g}."
        )
    if off:
        console.print(
            f"~ {len(off)} run(s) train for so few steps that their FLOPs miss the budget by more than "
            f"{OFF_BUDGET:.0%} ({', '.join(off[:4])}{', ...' if len(off) > 4 else ''}); the report shows each point's "
            "spent / budget"
        )
    if over:
        console.print(
            f"[bold]! {len(over)} run(s) exceed max_epochs = {iso.max_epochs:g}[/] ({', '.join(over[:4])}"
            f"{', ...' if len(over) > 4 else ''}): 'benchctl study' refuses the plan on this data."
        )
    how = f"each of the {len(est.per_step)} model shapes (architecture, width, settings) {est.how()}"
    console.print(
        f"estimated training time: {format_duration(total)} for all {len(runs)} runs one after another, about "
        f"{format_duration(total / 2)} of wall time with --jobs 2 if each run keeps its speed ({how})"
    )
