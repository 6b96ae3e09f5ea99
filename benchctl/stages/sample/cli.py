"""`benchctl sample`: complete the fixed prompt set with every finished run and store the samples.

See `benchctl.stages.sample.engine` for the prompt rule, the generation procedure and how seeds make samples
reproducible.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.cli import DbOpt, YesOpt, console, db_path_of, split_list, terminal_confirm
from benchctl.stages.sample import options as opt

app = typer.Typer()


@app.command(short_help="Complete the same story beginnings with every run.")
def sample(
    n_prompts: Annotated[int, typer.Option("--n-prompts", help="Story beginnings per model.")] = opt.DEFAULT_N_PROMPTS,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")
    ] = opt.DEFAULT_TEMPERATURE,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")] = opt.DEFAULT_TOP_K,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Nucleus sampling: keep the smallest set with this mass.")
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-new-tokens",
            help="Token limit of a completion (default: what the model's context leaves after the prompt; a larger "
            "limit slides the window past the context, with a warning).",
        ),
    ] = opt.DEFAULT_MAX_NEW_TOKENS,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = opt.DEFAULT_SEED,
    runs: Annotated[str | None, typer.Option("--runs", help="Only these run ids (comma list).")] = None,
    archs: Annotated[str | None, typer.Option("--archs", help="Only these architectures (comma list).")] = None,
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only runs of this preset.")] = None,
    n_recur: Annotated[
        int | None,
        typer.Option(
            "--n-recur",
            help="Test-time recurrence override (default: as trained; the maximum depth with --exit); at most 1024. "
            "Sampling estimated at over an hour asks first.",
        ),
    ] = None,
    extrapolate: Annotated[
        str | None,
        typer.Option(
            "--extrapolate",
            help="Passes past the trained depth: frailt last|cycle|none (default last), relaxed "
            "cycle|last|none (default cycle).",
        ),
    ] = None,
    exit_rule: Annotated[
        str | None,
        typer.Option("--exit", help="Per-token adaptive exit: kl (next-token distributions) or latent (state change)."),
    ] = None,
    threshold: Annotated[
        float | None, typer.Option("--threshold", help=f"Exit threshold (default {opt.DEFAULT_EXIT_THRESHOLD:g}).")
    ] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Prompts generated together (recorded: it fixes three-part's noise).")
    ] = opt.DEFAULT_BATCH_SIZE,
    precision: Annotated[
        str,
        typer.Option(
            "--precision",
            help="Weights' dtype for generation, cast once: auto (the fastest bench --decode measured on this "
            "hardware; float32 without a measurement), float32, bfloat16 or float16.",
        ),
    ] = "auto",
    compile_step: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="Compile the per-token decode step with torch.compile (falls back to eager, saying why).",
        ),
    ] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = "auto",
    jobs: Annotated[
        str,
        typer.Option(
            "--jobs",
            "-j",
            help="Runs sampled at once, each share in its own process with its share of the cores: a "
            "number, or auto (one per core on a CPU, one per GPU on a GPU machine).",
        ),
    ] = "1",
    db: DbOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a live progress bar.")] = True,
    yes: YesOpt = False,
) -> None:
    """Complete the same story beginnings with every finished run; rerunning with the same settings adds nothing."""
    # torch, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.sample import engine as smp

    opts = opt.SampleOptions(
        select=RunSelection(run_ids=split_list(runs), archs=split_list(archs), preset=preset),
        n_prompts=n_prompts,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        n_recur=n_recur,
        batch_size=batch_size,
        extrapolate=extrapolate,
        exit_rule=exit_rule,
        exit_threshold=threshold,
        precision=precision,
        compile=compile_step,
        device=device,
        jobs=jobs,
        yes=yes,
    )
    path = db_path_of(db)
    handle = stages.connect(path, create=False)
    s = smp.sample_all(
        handle, path, opts, progress=Progress(enabled=progress, console=console), confirm=terminal_confirm()
    )
    t = Table(
        title=f"samples — prompt set {', '.join(s.prompt_sets)}, settings {s.settings_hash}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    exiting = s.settings.exit_rule is not None
    heads = ("model", "seed", "R", "samples", "new", "mean tokens", "ended", "tok/s") + (
        ("mean depth",) if exiting else ()
    )
    for head in heads:
        t.add_column(head, justify="left" if head == "model" else "right", no_wrap=True)
    for r in s.runs:
        t.add_row(
            r.variant or r.arch,
            str(r.seed),
            str(r.n_recur),
            str(r.n_samples),
            str(r.generated),
            "-" if r.mean_tokens is None else f"{r.mean_tokens:.1f}",
            "-" if r.eos_share is None else f"{100 * r.eos_share:.0f}%",
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            *(("-" if r.mean_depth is None else f"{r.mean_depth:.2f}",) if exiting else ()),
        )
    console.print(t)
    st = s.settings
    knobs = (
        f"temperature {st.temperature}, top-k {st.top_k or 'off'}, top-p {st.top_p or 'off'}, "
        f"max {'what the context leaves' if st.max_new_tokens is None else st.max_new_tokens} new tokens, "
        f"seed {st.seed}, batch {st.batch_size}, device {s.device}, precision {st.precision}"
    )
    if exiting:
        knobs += (
            f"; adaptive exit {st.exit_rule} < {st.exit_threshold:g} (R = maximum depth; mean depth = mean exit "
            "iteration over the positions processed: every iteration is still computed, so it is what "
            "skipping exited tokens would spend)"
        )
    console.print(
        f"{s.generated} generated, {s.skipped} already stored. {knobs}. R = recurrence used; ended = share that "
        "ended the story (BOS) before the token limit; tok/s = generation speed of this call.",
        highlight=False,
    )
    if s.example:
        ex = s.example
        console.print(f"\nexample ({ex['arch']}, {ex['n_tokens']} tokens, {ex['finish_reason']}):", highlight=False)
        story = Text(ex["prompt"], style="bold")  # Text, not markup: stories may contain brackets
        story.append(ex["completion"])
        console.print(story)
