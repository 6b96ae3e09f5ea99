"""`benchctl infer`: inference cost of finished runs per inference setting, and their latent view.

Thin: parse the options, call `benchctl.stages.infer.engine.infer_all`, print the rows measured. What is measured and
stored is described in `benchctl.stages.infer.engine`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.cli import DbOpt, console, db_path_of, split_list
from benchctl.stages.infer.options import InferOptions

app = typer.Typer()


@app.command(short_help="Generation cost per inference setting.")
def infer(
    runs: Annotated[str | None, typer.Option("--runs", help="Only these run ids (comma list).")] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Only these architectures (comma list).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only runs of this preset.")] = None,
    thresholds: Annotated[
        str | None, typer.Option("--thresholds", help="Exit thresholds (comma list; default 0,1e-3,1e-2).")
    ] = None,
    exit_rule: Annotated[str, typer.Option("--exit", help="Exit criterion of the thresholds: kl or latent.")] = "kl",
    kv: Annotated[
        str | None,
        typer.Option(
            "--kv",
            help="KV strategies crossed with the thresholds: full, last, budget:K, first "
            "(comma list; default full,last,budget:2,first).",
        ),
    ] = None,
    drafts: Annotated[
        str | None, typer.Option("--drafts", help="Speculative draft depths (comma list; default 1,2; '' for none).")
    ] = None,
    spec_k: Annotated[int, typer.Option("--spec-k", help="Tokens drafted per verification.")] = 4,
    warm_start: Annotated[
        bool, typer.Option("--warm-start", help="Also measure every exit setting with the warm start.")
    ] = False,
    batch: Annotated[int, typer.Option("--batch", help="Prompts, generated as one batch.")] = 16,
    single: Annotated[int, typer.Option("--single", help="The first N prompts, generated one at a time.")] = 4,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Tokens per prompt (at most half the context).")
    ] = 16,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Greedy tokens generated per prompt.")] = 16,
    windows: Annotated[int, typer.Option("--windows", help="Validation windows of the teacher-forced loss.")] = 16,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Timed generations per setting; speeds stored are their median.")
    ] = 3,
    paired: Annotated[
        bool,
        typer.Option(
            "--paired/--no-paired",
            help="Time full depth beside every other setting in each repeat and store the speed-up ratio.",
        ),
    ] = True,
    latent_sequences: Annotated[
        int, typer.Option("--latent-sequences", help="Validation windows traced for the latent view (0: none).")
    ] = 2,
    latent_tokens: Annotated[
        int, typer.Option("--latent-tokens", help="Positions per traced window whose trajectories are projected.")
    ] = 4,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    db: DbOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress.")] = True,
) -> None:
    """Inference cost per setting (decode speed, KV cache, FLOPs spent, loss, agreement) for every finished run; reruns
    skip stored rows."""
    # option errors first, before the database is opened
    opts = InferOptions(
        select=RunSelection(run_ids=split_list(runs), archs=split_list(archs), preset=preset),
        thresholds=thresholds,
        exit_rule=exit_rule,
        kv=kv,
        drafts=drafts,
        spec_k=spec_k,
        warm_start=warm_start,
        batch=batch,
        single=single,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        windows=windows,
        repeats=repeats,
        paired=paired,
        latent_sequences=latent_sequences,
        latent_tokens=latent_tokens,
        device=device,
    )
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.infer import engine

    path = db_path_of(db)
    s = engine.infer_all(
        stages.connect(path, create=False), path, opts, progress=Progress(enabled=progress, console=console)
    )
    t = Table(title="inference cost (rows measured by this call)", title_justify="left", box=box.SIMPLE_HEAD)
    heads = (
        "run",
        "setting",
        "tok/s b1",
        "× full b1",
        f"tok/s b{opts.batch}",
        "KV KB/1k",
        "MFLOP/tok",
        "depth",
        "loss",
        "agree",
    )
    for head in heads:  # the settings' labels are long: they wrap, the numbers do not
        t.add_column(head, justify="left" if head in ("run", "setting") else "right", no_wrap=head != "setting")

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in s.rows:
        t.add_row(
            f"{r['arch']} s{r['seed']}",
            r["setting"],
            num(r["tokens_per_s_1"], ",.0f"),
            num(r.get("speedup_1"), ".2f"),
            num(r["tokens_per_s_batch"], ",.0f"),
            num(None if r["kv_bytes_per_1k"] is None else r["kv_bytes_per_1k"] / 1e3, ",.1f"),
            num(r["flops_per_token"] / 1e6, ".3f"),
            num(r["mean_depth"], ".2f"),
            num(r["val_loss"], ".4f"),
            num(r["agreement"], ".3f"),
        )
    console.print(t)
    for run_id, setting, reason in s.unsupported:
        console.print(f"skipped {setting} for {run_id}: {reason}", highlight=False, soft_wrap=True)
    console.print(
        f"{len(s.rows)} measured, {s.skipped} already stored, {s.latents} run(s) traced for the latent view, "
        f"{s.seconds:.1f} s. Decode tokens/s exclude prefill and the warm-up; × full b1 is the median ratio to full "
        f"depth timed beside it. All rows: sqlite-utils {path} "
        "'select * from inference_results' --table",
        highlight=False,
        soft_wrap=True,
    )
