"""`benchctl judge`: grade every generated story with a judge model (Gemini, or any OpenAI-compatible server) and
print a table per architecture."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from benchctl.core import paper
from benchctl.core.errors import JudgeError
from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.cli import DbOpt, JsonOpt, ProgressOpt, console, err_console, split_list
from benchctl.stages.judge.options import (
    AUTO,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    JudgeOptions,
)

app = typer.Typer()


@app.command(short_help="Grade the stories with a judge model.")
def judge(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Judge model: a Gemini model (gemini-2.5-flash), or openai:<name> for OpenAI or any OpenAI-compatible "
            "server (openai:gpt-4.1-mini; openai:Qwen/Qwen3-8B with --base-url).",
        ),
    ] = "gemini-2.5-flash",
    base_url: Annotated[
        str | None,
        typer.Option(
            "--base-url",
            help="The service's base URL, e.g. http://localhost:8000/v1 for vLLM [default: $OPENAI_BASE_URL or "
            "$GOOGLE_GEMINI_BASE_URL, else the backend's own service]. Part of an OpenAI-compatible judge's name.",
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Requests in flight at most.")] = 8,
    limit: Annotated[
        int | None,
        typer.Option("--limit", "-n", help="Grade only the first N samples (the first prompts of every run)."),
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", "-k", help="Grade each sample K times (judge reliability).")] = 1,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Count the requests and estimate tokens and cost; send nothing, no key needed."),
    ] = False,
    runs: Annotated[str | None, typer.Option("--runs", help="Only these run ids (comma list).")] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Judge sampling temperature (stored per request).")
    ] = 0.0,
    seed: Annotated[
        int,
        typer.Option("--seed", help="Judge sampling seed, sent and stored per request (repeat k is sent seed + k)."),
    ] = 0,
    thinking_budget: Annotated[
        int | None,
        typer.Option(
            "--thinking-budget",
            help="Gemini only: thinking tokens allowed [default: 0 on gemini-2.5-flash(-lite), the model's own "
            "default elsewhere].",
        ),
    ] = None,
    max_output_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-output-tokens",
            help="Output limit per answer [default: 2048 for assess, 1024 for json with thinking off; 8192 when the "
            "judge may think or reason]. An answer cut off at the limit is stored as a failure.",
        ),
    ] = None,
    max_attempts: Annotated[
        int, typer.Option("--max-attempts", help="Calls per grade at most; 429, 5xx and connection errors are retried.")
    ] = 6,
    protocol: Annotated[
        str,
        typer.Option(
            "--protocol",
            help="assess: the judge writes its general assessment of the story, then the grades (the study's "
            "wording; the assessment is stored); json: the grades only. Each protocol is graded and cached apart.",
        ),
    ] = "assess",
    skip_failed: Annotated[
        bool, typer.Option("--skip-failed", help="Keep stored failures instead of regrading them.")
    ] = False,
    connect_timeout: Annotated[
        float,
        typer.Option(
            "--connect-timeout",
            help="Seconds a call waits for the connection (a host that is down costs this per attempt).",
        ),
    ] = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout: Annotated[
        float,
        typer.Option(
            "--read-timeout",
            help="Seconds a call waits for the answer, which comes whole: raise it for a slow server (a large "
            "model that reasons), lower it to give up sooner on one that accepts and never answers.",
        ),
    ] = DEFAULT_READ_TIMEOUT_S,
    allow_insecure_key: Annotated[
        bool,
        typer.Option(
            "--allow-insecure-key",
            help="Send the API key over plain http to another machine (refused otherwise: only https or this "
            "machine's loopback addresses get it). For a network you trust end to end.",
        ),
    ] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Grade generated stories with a judge model: grammar, creativity, consistency, plot (1-10) per sample.

    Gemini needs GEMINI_API_KEY (or GOOGLE_API_KEY). openai:<name> needs OPENAI_API_KEY for OpenAI's own service;
    a local server (vLLM, SGLang, Ollama, llama.cpp, LM Studio) at --base-url needs none. Every request and answer
    is cached in results.db by (judge, prompt-file and protocol hash, sample, repeat) — an OpenAI-compatible judge's
    name carries its server's host, so two servers are two judges, never mixed: a
    rerun skips every grade already stored as ok and regrades the failed ones (rate-limited, truncated,
    unparseable...), so after an interruption just run the same command again. Answers that are not valid scores are
    stored as failures, never as scores. `--protocol assess` (default) has the judge write its general assessment of
    the story before the grades, as the study's grading text asks; `--repeats 2`, a second `--model` or the other
    `--protocol` on the same samples feed the report's judge reliability section. A key is sent over https or to
    this machine only (--allow-insecure-key to send it over plain http elsewhere). When not a single grade could be
    obtained (a server that is down or never answers), the failures are stored and the command exits with code 6.
    """
    opts = JudgeOptions(
        select=RunSelection(run_ids=split_list(runs)),
        judge_model=model,
        base_url=base_url,
        judge_seed=seed,
        max_output_tokens=max_output_tokens,
        concurrency=concurrency,
        repeats=repeats,
        limit=limit,
        dry_run=dry_run,
        temperature=temperature,
        thinking_budget=AUTO if thinking_budget is None else thinking_budget,
        max_attempts=max_attempts,
        retry_failed=not skip_failed,
        protocol=protocol,
        connect_timeout_s=connect_timeout,
        read_timeout_s=read_timeout,
        allow_insecure_key=allow_insecure_key,
    )
    # google.genai, and sqlite_utils with pandas: kept out of 'benchctl --help'
    from benchctl import stages
    from benchctl.stages.judge import api as engine

    if not dry_run:  # before opening anything: a missing key, or one that must not travel there, costs nothing
        engine.require_key(engine.resolve(model, base_url), allow_insecure_key)
    database = stages.connect(db, create=False, readonly=dry_run)  # a dry run changes nothing, not even the schema
    summary = engine.judge_all(
        database,
        opts,
        progress=Progress(enabled=progress and not as_json, console=err_console),  # stderr: stdout is the result
    )
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2, default=str))
    else:
        print_summary(summary)
    failed = summary.nothing_graded()
    if failed is not None:
        raise JudgeError(failed)


def _money(x: float | None) -> str:
    return "unknown (no price for this model)" if x is None else f"${x:,.4f}"


def _mean(stat) -> str:
    return "-" if stat.mean is None else f"{stat.mean:.2f}"


def _half_width(stat) -> str:
    """Half-width of the 95% CI; 'n/a' with fewer than two samples (no interval is invented)."""
    if stat.mean is None:
        return "-"
    return "n/a" if stat.ci_low is None else f"±{(stat.ci_high - stat.ci_low) / 2:.2f}"


def print_summary(summary) -> None:
    from benchctl.stages.judge.client import CRITERIA  # pydantic: kept out of 'benchctl --help'

    s = summary
    thinking = "model default" if s.thinking_budget is None else s.thinking_budget
    head = (
        f"{s.judge_model} (backend {s.backend}, model {s.model}, at {s.endpoint}), protocol {s.protocol}, prompt "
        f"{s.prompt_hash}, temperature {s.temperature:g}, seed {'none' if s.seed is None else s.seed}"
        + (f", thinking {thinking}" if s.backend == "gemini" else "")
        + f", repeats {s.repeats}"
    )
    console.print(head, highlight=False)
    if s.dry_run:
        console.print(
            f"dry run: {s.n_todo} request(s) would be sent ({s.n_cached} of {s.n_keys} grades already stored); "
            f"estimated {s.estimated_prompt_tokens:,} prompt + {s.estimated_output_tokens:,} output tokens, "
            f"estimated cost {_money(s.estimated_cost_usd)}",
            highlight=False,
        )
    else:
        console.print(
            f"{s.n_ok} graded, {s.n_failed} failed, {s.n_cached} already stored; {s.n_requests} request(s) sent "
            f"in {s.elapsed_s:.1f} s",
            highlight=False,
        )
    # Two narrow tables (means; CI half-widths) with the study's short headers stay inside 80 columns for any
    # number of architectures.
    keys = (*CRITERIA, "average")
    means = Table(title="judge grades per model (mean over samples)", title_justify="left", box=box.SIMPLE_HEAD)
    cis = Table(title="± half-width of the 95% CI (t, over samples)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("model", "n", "G", "Cr", "Co", "P", "avg", "failed", "study avg"):
        means.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for col in ("model", "G", "Cr", "Co", "P", "avg"):
        cis.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for a in s.per_arch:
        # the study's average belongs to its own four models, not to a plan's other variants of an architecture
        named_as_study = a.label.split(" (")[0] == a.arch
        study = paper.JUDGE.get(a.arch, {}).get("average") if named_as_study else None
        means.add_row(
            a.label,
            str(a.n_samples),
            *(_mean(a.stats[c]) for c in keys),
            str(a.n_failed),
            "-" if study is None else f"{study:.2f}",
        )
        cis.add_row(a.label, *(_half_width(a.stats[c]) for c in keys))
    console.print(means)
    console.print(cis)
    console.print(
        "G grammar, Cr creativity, Co consistency, P plot (1-10), avg their mean; a sample's repeats are averaged "
        f"first. n = samples with a grade; failed = grades stored as failures (never scored); study avg = the "
        f"study's published average ({paper.JUDGE_MODEL}, paper preset).",
        highlight=False,
    )
    pending = sum(a.n_pending for a in s.per_arch)
    if pending and not s.dry_run:
        console.print(f"{pending} grade(s) not attempted yet; rerun to grade them.", highlight=False)
    if not s.dry_run:
        u, t = s.usage, s.usage_total
        console.print(
            f"tokens this run: {u.prompt_tokens:,} prompt, {u.output_tokens:,} output, {u.thinking_tokens:,} thinking "
            f"(cost {_money(s.cost_usd)}); all grades in scope: {t.prompt_tokens:,} / {t.output_tokens:,} / "
            f"{t.thinking_tokens:,} (cost {_money(s.cost_total_usd)})",
            highlight=False,
        )
    for note in s.notes:
        console.print(f"note: {note}", highlight=False)
    if s.failures:
        err_console.print(f"[yellow]{len(s.failures)} grade(s) failed[/] (stored with their error; rerun to retry):")
        for f in s.failures[:10]:
            err_console.print(f"  {f['arch']} {f['sample_id']} repeat {f['repeat']}: {f['error']}", highlight=False)
        if len(s.failures) > 10:
            err_console.print(f"  ... and {len(s.failures) - 10} more (see judge_grades.error)", highlight=False)
