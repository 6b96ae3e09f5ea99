"""Running a judge job: pick the keys still to grade, send them concurrently, store each answer as it arrives.

Keys that already have a grade with status 'ok' are skipped; failed ones are retried by default, so a run that was
killed or rate-limited picks up where it stopped and a rerun never pays twice for a good grade. An interrupted run
drops the answers still in flight; their keys stay pending for the next run.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from benchctl.core.errors import JudgeError
from benchctl.core.progress import Progress, as_progress
from benchctl.stages.judge import judges
from benchctl.stages.judge.client import (
    ASSESS_OUTPUT_TOKENS_ESTIMATE,
    CHARS_PER_TOKEN,
    MAX_OUTPUT_ASSESS_NO_THINKING,
    MAX_OUTPUT_NO_THINKING,
    MAX_OUTPUT_THINKING,
    OUTPUT_TOKENS_ESTIMATE,
    Job,
    Settings,
    Timeouts,
    WorkItem,
    estimate_cost,
)
from benchctl.stages.judge.judges import JudgeSpec
from benchctl.stages.judge.options import JudgeOptions
from benchctl.stages.judge.prompt import Template, load_template
from benchctl.stages.judge.storage import Database, existing_status, record, select_samples
from benchctl.stages.judge.summary import JudgeSummary, summarize


def reporter(progress: bool | Progress) -> Progress:
    """The given Progress, or one built from a flag: True draws on stderr (stdout stays for results), False is
    silent."""
    return as_progress(progress, stderr=True)


def backend_module(backend: str) -> Any:
    """The module of a backend (`gemini` or `openai_chat`), imported only when a job is sent: each loads its SDK."""
    if backend == judges.GEMINI:
        from benchctl.stages.judge import gemini

        return gemini
    from benchctl.stages.judge import openai_chat

    return openai_chat


def require_key(spec: JudgeSpec, allow_insecure_key: bool = False) -> str:
    """The key a judge's requests carry; a JudgeError naming the variable to set when it needs one and none is set,
    or the variable whose key would go to another machine over plain http (unless `allow_insecure_key`)."""
    return str(backend_module(spec.backend).require_key(spec, allow_insecure_key))


def has_key(spec: JudgeSpec) -> bool:
    """True when a job with this judge can be sent (its key is set, or it needs none)."""
    return judges.has_key(spec)


def max_output_tokens(opts: JudgeOptions, budget: int | None) -> int:
    """The output limit sent: the option's, else room for the protocol's answer, and room to think unless thinking
    is known to be off (a Gemini budget of 0)."""
    if opts.max_output_tokens is not None:
        return opts.max_output_tokens
    no_thinking = MAX_OUTPUT_ASSESS_NO_THINKING if opts.protocol == "assess" else MAX_OUTPUT_NO_THINKING
    return no_thinking if budget == 0 else MAX_OUTPUT_THINKING


async def judge_all_async(db: Database, opts: JudgeOptions, *, progress: bool | Progress = True) -> JudgeSummary:
    """Async form of `judge_all` (same arguments), for callers that already run an event loop."""
    spec = judges.resolve(opts.judge_model, opts.base_url)
    # before any work, so a missing key, or one that must not travel there, never costs a thing
    key = None if opts.dry_run else require_key(spec, opts.allow_insecure_key)
    t0 = time.monotonic()
    template = load_template(opts.prompt_path, opts.protocol)
    budget = _thinking_budget(spec, opts)
    s = Settings(
        spec.name,
        template.hash,
        opts.temperature,
        budget,
        max_output_tokens(opts, budget),
        opts.max_attempts,
        opts.base_delay,
        opts.max_delay,
        opts.protocol,
        backend=spec.backend,
        model=spec.model,
        endpoint=spec.endpoint,
        seed=opts.judge_seed,
    )

    samples = _selected(select_samples(db, opts.select.run_ids, opts.limit), opts)
    if not samples:
        scope = f" for run(s) {', '.join(opts.select.run_ids)}" if opts.select.run_ids else ""
        raise JudgeError(f"no samples to judge{scope}; run 'benchctl sample' first")
    todo = _todo(db, samples, template, s, opts.repeats, opts.retry_failed)
    n_keys = len(samples) * opts.repeats
    summary = JudgeSummary(
        judge_model=spec.name,
        prompt_hash=template.hash,
        prompt_path=str(template.path),
        dry_run=opts.dry_run,
        temperature=opts.temperature,
        thinking_budget=budget,
        repeats=opts.repeats,
        n_samples=len(samples),
        n_keys=n_keys,
        n_cached=n_keys - len(todo),
        n_todo=len(todo),
        protocol=opts.protocol,
        backend=spec.backend,
        model=spec.model,
        endpoint=spec.endpoint,
        seed=opts.judge_seed,
    )
    if opts.dry_run:
        _estimate(todo, s, summary)
    elif todo:
        await _run(
            db,
            todo,
            s,
            summary,
            spec=spec,
            key=key,
            timeouts=Timeouts(opts.connect_timeout_s, opts.read_timeout_s),
            concurrency=opts.concurrency,
            seed=opts.seed,
            progress=reporter(progress),
        )

    summarize(db, samples, s, opts.repeats, summary)
    summary.elapsed_s = time.monotonic() - t0
    return summary


def _thinking_budget(spec: JudgeSpec, opts: JudgeOptions) -> int | None:
    """The thinking budget sent: Gemini's (auto: 0 where the model allows it); none for an OpenAI-compatible judge
    (the chat-completions protocol has no such setting)."""
    if spec.backend != judges.GEMINI:
        return None
    if isinstance(opts.thinking_budget, str):  # AUTO, the only text the option takes
        return judges.default_thinking_budget(spec.model)
    return opts.thinking_budget


def _selected(samples: list[dict[str, Any]], opts: JudgeOptions) -> list[dict[str, Any]]:
    """The samples of the runs `opts` selects by architecture and preset (by run id: already in the query)."""
    sel = opts.select
    return [
        r
        for r in samples
        if (not sel.archs or r["arch"] in sel.archs) and (sel.preset is None or r["preset"] == sel.preset)
    ]


def _todo(
    db: Database, samples: list[dict[str, Any]], template: Template, s: Settings, repeats: int, retry_failed: bool
) -> list[WorkItem]:
    """The keys to grade: every (sample, repeat) without an ok grade (nor a failed one unless `retry_failed`)."""
    status = existing_status(db, s.judge_model, s.prompt_hash)
    skip = {"ok"} | (set() if retry_failed else {"failed"})
    todo: list[WorkItem] = []
    for row in samples:
        filled = template.fill(row["beginning"], row["completion"])
        for r in range(repeats):
            if status.get((row["sample_id"], r)) not in skip:
                todo.append(WorkItem(row["sample_id"], row["run_id"], row["arch"], r, filled))
    return todo


def _estimate(todo: list[WorkItem], s: Settings, summary: JudgeSummary) -> None:
    """A dry run's token and cost estimate for the keys it would send (retries and thinking by default excluded)."""
    budget = s.thinking_budget
    per_answer = ASSESS_OUTPUT_TOKENS_ESTIMATE if s.protocol == "assess" else OUTPUT_TOKENS_ESTIMATE
    summary.estimated_prompt_tokens = sum(math.ceil(len(it.prompt) / CHARS_PER_TOKEN) for it in todo)
    summary.estimated_output_tokens = len(todo) * (per_answer + (budget or 0))
    summary.estimated_cost_usd = estimate_cost(
        s.judge_model, summary.estimated_prompt_tokens, summary.estimated_output_tokens
    )
    summary.notes.append(
        f"estimate only: prompt tokens ~ characters/{CHARS_PER_TOKEN:g}, output ~ {per_answer} tokens "
        "per request"
        + (f" + a thinking budget of {budget}" if budget else "")
        + ("; thinking tokens not included (the model thinks by default)" if budget is None else "")
        + "; retries not included"
    )


async def _run(
    db: Database,
    todo: list[WorkItem],
    s: Settings,
    summary: JudgeSummary,
    *,
    spec: JudgeSpec,
    key: str,
    timeouts: Timeouts,
    concurrency: int,
    seed: int | None,
    progress: Progress,
) -> None:
    """Grade every key of `todo`, storing each outcome as it completes; raise JudgeError if the service refused."""
    module = backend_module(spec.backend)
    backend = module.make_backend(spec, key, s, timeouts)
    job = Job(backend, s, concurrency, seed)
    bar = progress.task(f"{s.judge_model} judging", total=len(todo), ok=0, failed=0)
    tasks = [asyncio.create_task(job.grade(it)) for it in todo]
    try:
        for fut in asyncio.as_completed(tasks):
            o = await fut
            if o is None:
                continue
            record(db, o, s)
            summary.usage += o.billed
            if o.grade is not None:
                summary.n_ok += 1
            else:
                summary.n_failed += 1
                summary.failures.append(
                    {"sample_id": o.item.sample_id, "repeat": o.item.repeat, "arch": o.item.arch, "error": o.error}
                )
            bar.update(advance=1, ok=summary.n_ok, failed=summary.n_failed)
    finally:
        for t in tasks:  # only left over when interrupted: in-flight answers are dropped, their keys stay pending
            t.cancel()
        bar.close()
        await backend.aclose()
    summary.n_requests = job.n_requests
    if job.unreachable is not None:
        summary.stopped_unanswered = job.n_unanswered
    if job.refused is not None:
        raise JudgeError(
            f"the judge service refused the job ({job.refused}); {module.refused_hint(spec)}. "
            f"{summary.n_ok} grade(s) stored; rerun to continue"
        )


def judge_all(db: Database, opts: JudgeOptions, *, progress: bool | Progress = True) -> JudgeSummary:
    """Grade the samples in `db` as `opts` says (see JudgeOptions); `progress`: a Progress to report through, or True
    (bars on stderr) / False (silent).

    Raises JudgeError without an API key (unless a dry run) before any work, when there are no samples, and when the
    service refuses the job (bad key, no permission, unknown model) — after storing what was finished.
    """
    return asyncio.run(judge_all_async(db, opts, progress=progress))
