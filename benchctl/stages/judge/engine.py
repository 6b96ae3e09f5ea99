"""Running a judge job: pick the keys still to grade, send them concurrently, store each answer as it arrives.

Keys that already have a grade with status 'ok' are skipped; failed ones are retried by default, so a run that was
killed or rate-limited picks up where it stopped and a rerun never pays twice for a good grade. An interrupted run
drops the answers still in flight; their keys stay pending for the next run.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, Sequence

from benchctl.core.errors import ConfigError, JudgeError
from benchctl.stages.judge.client import (
    ASSESS_OUTPUT_TOKENS_ESTIMATE,
    AUTO,
    CHARS_PER_TOKEN,
    DEFAULT_MODEL,
    DEFAULT_PROTOCOL,
    DEFAULT_TEMPERATURE,
    MAX_OUTPUT_ASSESS_NO_THINKING,
    MAX_OUTPUT_NO_THINKING,
    MAX_OUTPUT_THINKING,
    OUTPUT_TOKENS_ESTIMATE,
    PROTOCOLS,
    Job,
    Settings,
    WorkItem,
    default_thinking_budget,
    estimate_cost,
    make_client,
    require_api_key,
)
from benchctl.stages.judge.prompt import Template, load_template
from benchctl.stages.judge.storage import Database, existing_status, record, select_samples
from benchctl.stages.judge.summary import JudgeSummary, summarize
from benchctl.core.progress import Progress, as_progress


def _validate(judge_model: str, concurrency: int, repeats: int, limit: int | None, max_attempts: int,
              protocol: str) -> None:
    if not judge_model or not judge_model.strip():
        raise ConfigError("--model must name a Gemini model, e.g. gemini-2.5-flash")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    if max_attempts < 1:
        raise ConfigError(f"--max-attempts must be at least 1, got {max_attempts}")


def reporter(progress: bool | Progress) -> Progress:
    """The given Progress, or one built from a flag: True draws on stderr (stdout stays for results), False is silent."""
    return as_progress(progress, stderr=True)


async def judge_all_async(
    db: Database,
    *,
    judge_model: str = DEFAULT_MODEL,
    concurrency: int = 8,
    repeats: int = 1,
    limit: int | None = None,
    run_ids: Sequence[str] | None = None,
    dry_run: bool = False,
    base_url: str | None = None,
    progress: bool | Progress = True,
    temperature: float = DEFAULT_TEMPERATURE,
    thinking_budget: int | None | str = AUTO,
    max_output_tokens: int | None = None,
    retry_failed: bool = True,
    max_attempts: int = 6,
    base_delay: float = 1.0,
    max_delay: float = 60.0,
    timeout_s: float = 120.0,
    prompt_path: str | os.PathLike | None = None,
    seed: int | None = None,
    protocol: str = DEFAULT_PROTOCOL,
) -> JudgeSummary:
    """Async form of `judge_all` (same arguments), for callers that already run an event loop."""
    _validate(judge_model, concurrency, repeats, limit, max_attempts, protocol)
    key = None if dry_run else require_api_key()  # before any work, so a missing key never costs a thing
    t0 = time.monotonic()
    template = load_template(prompt_path, protocol)
    budget = default_thinking_budget(judge_model) if thinking_budget == AUTO else thinking_budget
    if max_output_tokens is None:
        no_thinking = MAX_OUTPUT_ASSESS_NO_THINKING if protocol == "assess" else MAX_OUTPUT_NO_THINKING
        max_output_tokens = no_thinking if budget == 0 else MAX_OUTPUT_THINKING
    s = Settings(
        judge_model, template.hash, temperature, budget, max_output_tokens, max_attempts, base_delay, max_delay,
        protocol,
    )

    samples = select_samples(db, run_ids, limit)
    if not samples:
        scope = f" for run(s) {', '.join(run_ids)}" if run_ids else ""
        raise JudgeError(f"no samples to judge{scope}; run 'benchctl sample' first")
    todo = _todo(db, samples, template, s, repeats, retry_failed)
    n_keys = len(samples) * repeats
    summary = JudgeSummary(
        judge_model=judge_model,
        prompt_hash=template.hash,
        prompt_path=str(template.path),
        dry_run=dry_run,
        temperature=temperature,
        thinking_budget=budget,
        repeats=repeats,
        n_samples=len(samples),
        n_keys=n_keys,
        n_cached=n_keys - len(todo),
        n_todo=len(todo),
        protocol=protocol,
    )
    if dry_run:
        _estimate(todo, s, summary)
    elif todo:
        await _run(db, todo, s, summary, key=key, base_url=base_url, timeout_s=timeout_s, concurrency=concurrency,
                   seed=seed, progress=reporter(progress))

    summarize(db, samples, s, repeats, summary)
    summary.elapsed_s = time.monotonic() - t0
    return summary


def _todo(db: Database, samples: list[dict[str, Any]], template: Template, s: Settings, repeats: int,
          retry_failed: bool) -> list[WorkItem]:
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
        "per request" + (f" + a thinking budget of {budget}" if budget else "")
        + ("; thinking tokens not included (the model thinks by default)" if budget is None else "")
        + "; retries not included"
    )


async def _run(db: Database, todo: list[WorkItem], s: Settings, summary: JudgeSummary, *, key: str,
               base_url: str | None, timeout_s: float, concurrency: int, seed: int | None, progress: Progress) -> None:
    """Grade every key of `todo`, storing each outcome as it completes; raise JudgeError if the service refused."""
    client = make_client(key, base_url, timeout_s)
    job = Job(client.aio, s, concurrency, seed)
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
        await client.aio.aclose()
    summary.n_requests = job.n_requests
    if job.refused is not None:
        raise JudgeError(
            f"the judge service refused the job ({job.refused}); check the key in GEMINI_API_KEY / GOOGLE_API_KEY "
            f"and the model name '{s.judge_model}'. {summary.n_ok} grade(s) stored; rerun to continue"
        )


def judge_all(
    db: Database,
    *,
    judge_model: str = DEFAULT_MODEL,
    concurrency: int = 8,
    repeats: int = 1,
    limit: int | None = None,
    run_ids: Sequence[str] | None = None,
    dry_run: bool = False,
    base_url: str | None = None,
    progress: bool | Progress = True,
    temperature: float = DEFAULT_TEMPERATURE,
    thinking_budget: int | None | str = AUTO,
    max_output_tokens: int | None = None,
    retry_failed: bool = True,
    max_attempts: int = 6,
    base_delay: float = 1.0,
    max_delay: float = 60.0,
    timeout_s: float = 120.0,
    prompt_path: str | os.PathLike | None = None,
    seed: int | None = None,
    protocol: str = DEFAULT_PROTOCOL,
) -> JudgeSummary:
    """Grade the samples in `db` (all, those of `run_ids`, or the first `limit`) `repeats` times with `judge_model`.

    concurrency: requests in flight at most. thinking_budget: "auto" = 0 on the 2.5-flash models, the model's
    default elsewhere; None = never send one; an int = that budget. max_output_tokens None = 1024 with thinking off,
    8192 otherwise. retry_failed: regrade keys whose stored grade failed (True) or keep them (False).
    max_attempts / base_delay / max_delay (seconds): the retry policy for 429, 5xx and connection errors.
    base_url: the service root (default: $GOOGLE_GEMINI_BASE_URL, else Google's endpoint). seed: the jitter RNG.
    protocol: "assess" (the judge writes its general assessment, stored in judge_grades.assessment, then the grades;
    output limit 2048 with thinking off) or "json" (grades only). Each protocol is its own prompt version (hash), so
    a grade cached under one is never reused for the other.
    progress: a Progress to report through, or True (bars on stderr) / False (silent).

    Raises JudgeError without an API key (unless dry_run) before any work, when there are no samples, and when the
    service refuses the job (bad key, no permission, unknown model) — after storing what was finished.
    """
    return asyncio.run(
        judge_all_async(
            db, judge_model=judge_model, concurrency=concurrency, repeats=repeats, limit=limit, run_ids=run_ids,
            dry_run=dry_run, base_url=base_url, progress=progress, temperature=temperature,
            thinking_budget=thinking_budget, max_output_tokens=max_output_tokens, retry_failed=retry_failed,
            max_attempts=max_attempts, base_delay=base_delay, max_delay=max_delay, timeout_s=timeout_s,
            prompt_path=prompt_path, seed=seed, protocol=protocol,
        )
    )
