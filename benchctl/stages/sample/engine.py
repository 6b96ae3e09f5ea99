"""Story sampling: a fixed, versioned prompt set from the validation split, and batched KV-cached generation for every
finished run, stored in the `prompts` and `samples` tables of results.db.

Follows the TinyStories paper's protocol (every model completes the same story beginnings taken from held-out
stories, and a judge grades the completions) with karpathy/llama2.c's sampler (`sample.py`, `run.c`): temperature,
top-k (llama2.c's `sample.py` uses temperature 1.0, top-k 300) and optional nucleus top-p, and a story ends when the
model emits BOS — in the pretokenized data every story is `[BOS] + tokens` with no EOS, so BOS is what a trained
model emits at the end of a story (llama2.c's `run.c` stops on BOS too); EOS (id 2) stops as well, for safety.

Prompt set (rule `opening-sentences-v1`). Validation stories are read in their stored order (as `prepare` kept them).
For each story, the prompt is its shortest opening made of whole sentences with at least `MIN_PROMPT_WORDS` (16)
words — one sentence of TinyStories ("Once upon a time, there was a little girl named Lily.") is nearly the same for
every story, two give the judge a beginning the completion can be consistent with. A sentence ends at `.`, `!` or
`?` (runs of them, plus closing quotes) followed by whitespace. A story is skipped when that opening has more than
`MAX_PROMPT_WORDS` (60) words, when fewer than `MIN_CONTINUATION_WORDS` (24) words follow it (no real continuation
to write), or when its opening repeats an earlier prompt word for word. The first N stories that qualify give
prompts 0..N-1, so a larger set extends a smaller one. The text is the story's own characters, stripped. The set's
version id `prompt_set` hashes (data fingerprint, rule name and parameters, N); it is stored once in `prompts`
(ids `"{prompt_set}:{idx}"`) and reused by every model and every later call.

Generation. Per run, prompts are taken in batches of `batch_size` consecutive prompt indices (batch k holds prompts
kB .. kB+B-1). Prompts are encoded with a leading BOS and need not have equal lengths: the batch starts at the
shortest prompt and feeds each longer prompt's remaining tokens in place of samples ("ragged prefill"), so every row
is exactly its own prompt followed by its own samples, with no padding and no mask. One forward per token step with
the model's KV cache (recurrent models cache every pass), on the zoo's decode path (`architectures.generate`:
inference mode, a static cache, finished rows dropped every few tokens; `--compile` compiles its step); each sample
records the path that ran (`decode`).

Context. By default a completion gets what the model's context leaves after its prompt (`options.context_limit`), so
every token is predicted from a window the model was trained on. An explicit `--max-new-tokens` past that is honoured
with a warning: from the end of the context the window slides as in llama2.c (the last `max_seq_len` tokens
re-encoded every step, without a cache: slower, and text the model never learned to continue).

Precision. The weights are cast once to the inference precision (`--precision`, default `auto`: the precision
`bench --decode` measured fastest on this hardware, float32 without a measurement;
`benchctl.stages.bench.precision`), never autocast per call; each sample records the dtype (`dtype`) and why
(`dtype_reason`). Tokens are drawn from float32 probabilities either way.

Seeds. Each row draws its tokens from its own generator seeded by f(seed, prompt index), so a control, FraiLT or
relaxed sample does not depend on which other prompts share its batch (up to floating-point differences between
batch shapes), and every model sees the same random numbers for the same prompt. Three-part draws its initial state
s0 from the global torch RNG at every forward, with a shape that includes the batch; that RNG is seeded per batch
from (seed, the batch's prompt indices) inside `torch.random.fork_rng`, so three-part samples are reproducible for a
given batch composition — which is why `batch_size` is part of the recorded settings and of the sample id.
Samples are reproducible on the same device type; CPU and CUDA differ in floating point.

Idempotence. A sample id hashes (run, prompt, settings); existing ids are skipped before any generation, and each
batch is written in one transaction, so a killed run keeps its finished batches and a rerun generates only the rest
(a batch is always regenerated whole, keeping its composition, hence its three-part samples, unchanged).
`settings_json` holds the requested settings (`n_recur` null = each run's trained recurrence); the `n_recur` column
holds the recurrence that ran.

Test-time depth. `n_recur` may exceed the trained depth (FraiLT and relaxed then follow `extrapolate`, default their
own rule), and `exit_rule`/`exit_threshold` turn on the per-token adaptive exit with `n_recur` as the maximum depth
(see `architectures.base.BaseLM.iterate`). These settings enter the settings hash only when set, so default-depth
samples keep their ids and never mix with depth-tagged ones; the samples' `extrapolate`, `exit_rule`,
`exit_threshold` and `mean_depth` columns record what ran (mean depth: the mean exit iteration over every position
the model processed for that sample).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import architectures
from architectures.base import ExitRule
from architectures.generate import DecodeReport, Generation, cast_for_inference, generate
from benchctl.core import checkpoint, data
from benchctl.core import db as dbm
from benchctl.core.config import RunConfig
from benchctl.core.data import Tokenizer
from benchctl.core.errors import ConfigError, DataError
from benchctl.core.progress import Progress, as_progress, confirm_long, inference_seconds, silent
from benchctl.core.runtime import resolve_device
from benchctl.stages import RunSelection
from benchctl.stages.bench.precision import choose_precision
from benchctl.stages.sample import tables as sample_tables
from benchctl.stages.sample.options import DEFAULT_TEMPERATURE, SampleOptions
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.executors.local import in_shares

RULE = "opening-sentences-v1"
MIN_PROMPT_WORDS = 16
MAX_PROMPT_WORDS = 60
MIN_CONTINUATION_WORDS = 24

BOS_ID, EOS_ID = 1, 2  # the ids data.tokenizer_spec fixes; a story ends with BOS (see the module docstring)

_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)]*(?=\s)")


# --------------------------------------------------------------------------------------------------------------------
# Prompt set


@dataclass(frozen=True)
class Prompt:
    id: str  # f"{prompt_set}:{idx}"
    idx: int
    text: str
    source_story: int  # index into the validation stories


@dataclass(frozen=True)
class PromptSet:
    id: str
    rule: str
    data_fingerprint: str
    prompts: tuple[Prompt, ...]


def _words(text: str) -> int:
    return len(text.split())


def story_opening(story: str) -> str | None:
    """The rule's prompt for one story, or None when the story does not qualify (see the module docstring)."""
    for m in _SENTENCE_END.finditer(story):
        head = story[: m.end()]
        n = _words(head)
        if n < MIN_PROMPT_WORDS:
            continue
        if n > MAX_PROMPT_WORDS or _words(story[m.end() :]) < MIN_CONTINUATION_WORDS:
            return None
        return head.strip()
    return None


def select_prompts(stories: Sequence[str], n: int) -> list[tuple[int, str]]:
    """(story index, prompt text) for the first `n` stories that qualify, in order."""
    out: list[tuple[int, str]] = []
    seen: set[str] = set()
    for i, story in enumerate(stories):
        text = story_opening(story)
        if text is None or text in seen:
            continue
        seen.add(text)
        out.append((i, text))
        if len(out) == n:
            break
    return out


def rule_spec() -> dict[str, Any]:
    return {
        "rule": RULE,
        "min_prompt_words": MIN_PROMPT_WORDS,
        "max_prompt_words": MAX_PROMPT_WORDS,
        "min_continuation_words": MIN_CONTINUATION_WORDS,
    }


def prompt_set_id(data_fingerprint: str, n: int) -> str:
    blob = json.dumps({"data": data_fingerprint, **rule_spec(), "n": n}, sort_keys=True)
    return "ps-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_prompt_set(stories: Sequence[str], data_fingerprint: str, n: int) -> PromptSet:
    """The deterministic prompt set of `n` beginnings from the validation stories of one prepared dataset."""
    if n < 1:
        raise ConfigError(f"--n-prompts must be >= 1, got {n}")
    chosen = select_prompts(stories, n)
    if len(chosen) < n:
        raise DataError(
            f"only {len(chosen)} of {len(stories)} validation stories qualify as prompts under rule {RULE} "
            f"(an opening of {MIN_PROMPT_WORDS}-{MAX_PROMPT_WORDS} words followed by at least "
            f"{MIN_CONTINUATION_WORDS}); ask for --n-prompts {len(chosen)} or fewer, or use a larger validation split"
        )
    ps = prompt_set_id(data_fingerprint, n)
    prompts = tuple(Prompt(f"{ps}:{i}", i, text, story) for i, (story, text) in enumerate(chosen))
    return PromptSet(ps, RULE, data_fingerprint, prompts)


def store_prompt_set(db, pset: PromptSet) -> int:
    """Insert the set's prompts that are not stored yet; returns how many were inserted (0 when reused)."""
    created = dbm.now()
    return sample_tables.insert_prompts(
        db,
        [
            {
                "id": p.id,
                "prompt_set": pset.id,
                "idx": p.idx,
                "text": p.text,
                "source_story": p.source_story,
                "rule": pset.rule,
                "data_fingerprint": pset.data_fingerprint,
                "created_at": created,
            }
            for p in pset.prompts
        ],
    )


def sample_id(run_id: str, prompt_id: str, settings_hash: str) -> str:
    return hashlib.sha256(f"{run_id}|{prompt_id}|{settings_hash}".encode()).hexdigest()[:20]


def _derive_seed(*parts: Any) -> int:
    """A 60-bit seed from a tuple of values (torch generators take any non-negative 64-bit integer)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16)


def row_seed(seed: int, prompt_idx: int) -> int:
    return _derive_seed("row", seed, prompt_idx)


def batch_seed(seed: int, prompt_idxs: Sequence[int]) -> int:
    return _derive_seed("batch", seed, tuple(prompt_idxs))


# --------------------------------------------------------------------------------------------------------------------
# Generation


def generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (BOS_ID, EOS_ID),
    n_recur: int | None = None,
    generators: Sequence[torch.Generator] | None = None,
    extrapolate: str | None = None,
    exit: Any = None,
    compile: bool = False,
    report: DecodeReport | None = None,
) -> list[Generation]:
    """Complete each prompt (token ids, BOS included) with the zoo's generation routine; see the module docstring.

    Prompts may differ in length (ragged prefill, no padding). Row b samples from `generators[b]` (None: the global
    RNG); temperature 0 is greedy. A row stops at a token in `stop_ids` (excluded from its tokens; by default the
    end-of-story ids BOS and EOS) or after `max_new_tokens` new tokens (one limit, or one per prompt). `extrapolate`
    and `exit` (an ExitRule) are the test-time depth options of `architectures.generate.generate`; `compile` and
    `report` its decode path's.
    """
    return generate(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stop_ids,
        n_recur=n_recur,
        generators=generators,
        extrapolate=extrapolate,
        exit=exit,
        compile=compile,
        report=report,
    )


def decode_label(rep: DecodeReport, compile_asked: bool) -> str:
    """What the `decode` column records: "fast compiled", "fast eager" (with the reason when compiling was asked
    for), or "reference: <why>"."""
    if rep.path != "fast":
        return f"reference: {rep.reason}"
    if rep.compiled:
        return "fast compiled"
    return f"fast eager: {rep.reason}" if compile_asked else "fast eager"


def exit_rule(settings: SampleOptions) -> ExitRule | None:
    """The generation routine's per-token exit for these options, or None."""
    if settings.exit_rule is None:
        return None
    return ExitRule(settings.exit_rule, float(settings.exit_threshold))


def decode_completion(tok, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text the new tokens add to the prompt, so that prompt text + completion is the story as generated.

    Decoding the new tokens alone would drop the leading space of their first piece (SentencePiece strips it).
    """
    head = tok.decode(list(prompt_ids))
    full = tok.decode(list(prompt_ids) + list(new_ids))
    if full.startswith(head):
        return full[len(head) :]
    return tok.decode(list(new_ids))  # a byte-fallback sequence split at the boundary; rare


# --------------------------------------------------------------------------------------------------------------------
# Runs and the pipeline


def select_runs(db, select: RunSelection) -> list[dict[str, Any]]:
    """The finished runs to sample, in architecture order then seed; clear errors for unknown or unfinished ones."""
    return train_tables.finished_runs(
        db,
        run_ids=select.run_ids,
        archs=select.archs,
        preset=select.preset,
        purpose="to sample",
        kind="stories",
    )


def _check_n_recur(row: dict[str, Any], cfg, settings: SampleOptions) -> tuple[int, str | None]:
    """(recurrence, extrapolation rule applied or None) this run will sample with; an impossible setting is a
    ConfigError, before any work."""
    n_recur = settings.n_recur
    model = architectures.build_shapes(cfg.arch, cfg.model)
    try:
        n = model.resolve_n_recur(n_recur)
    except architectures.RecurrenceError as e:
        raise ConfigError(
            f"--n-recur {n_recur} cannot run on {row['id']}: {e}; choose another value or narrow "
            "the runs with --archs / --runs"
        ) from None
    if settings.exit_rule is not None and not model.iterable():
        raise ConfigError(
            f"--exit cannot run on {row['id']}: {cfg.arch} runs at a fixed depth; narrow the runs with --archs / --runs"
        )
    rule = None
    if model.extrapolate_rules:
        try:
            rule = model.resolve_extrapolate(settings.extrapolate)
        except architectures.RecurrenceError as e:
            raise ConfigError(f"--extrapolate on {row['id']}: {e}") from None
    return n, (rule if n > cfg.model.n_recur else None)


@dataclass
class RunPlan:
    row: dict[str, Any]
    pset: PromptSet
    n_recur: int  # resolved
    extrapolate: str | None  # the rule applied past the trained depth (None: none applied)
    batches: list[list[Prompt]]  # batches with at least one missing sample, each whole
    missing: int
    existing: int


@dataclass
class RunSamples:
    """Per run: what this call did, and the stored samples for these settings."""

    run_id: str
    arch: str
    preset: str
    seed: int
    n_recur: int
    generated: int = 0
    skipped: int = 0
    n_samples: int = 0  # stored for (prompt set, settings)
    mean_tokens: float | None = None
    eos_share: float | None = None
    mean_depth: float | None = None  # with an adaptive exit: mean of the stored samples' mean depths
    new_tokens: int = 0  # tokens generated by this call (stop tokens included)
    variant: str = ""  # the run's model name (a plan's variant; its architecture's name otherwise)
    gen_seconds: float = 0.0  # wall time inside generation (model load and database writes excluded)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.gen_seconds if self.gen_seconds > 0 else None


@dataclass
class SampleSummary:
    settings: SampleOptions  # the options sampled with (their `to_dict` is what each sample records)
    settings_hash: str
    device: str
    prompt_sets: list[str]
    runs: list[RunSamples] = field(default_factory=list)
    example: dict[str, Any] | None = None  # {arch, run_id, prompt, completion, finish_reason, n_tokens}

    @property
    def generated(self) -> int:
        return sum(r.generated for r in self.runs)

    @property
    def skipped(self) -> int:
        return sum(r.skipped for r in self.runs)

    @property
    def tokens_per_s(self) -> float | None:
        secs = sum(r.gen_seconds for r in self.runs)
        return sum(r.new_tokens for r in self.runs) / secs if secs > 0 else None


def plan(
    db, rows: list[dict[str, Any]], settings: SampleOptions, n_prompts: int, *, progress: bool = False
) -> list[RunPlan]:
    """Prompt sets (stored), resolved recurrences and missing batches for every run — all checks before any work."""
    prepared_by_key: dict[str, Any] = {}
    psets: dict[str, PromptSet] = {}
    plans = []
    cfgs = [RunConfig.from_json(row["config_json"]) for row in rows]
    resolved = [_check_n_recur(row, cfg, settings) for row, cfg in zip(rows, cfgs)]
    for row, cfg, (n_recur, rule) in zip(rows, cfgs, resolved):
        prepared = data.prepared_for_run(
            prepared_by_key,
            row["id"],
            row.get("data_fingerprint"),
            cfg.data,
            cfg.model.vocab_size,
            progress=progress,
            to=" to sample it",
        )
        if prepared.fingerprint not in psets:
            pset = build_prompt_set(prepared.valid_stories(), prepared.fingerprint, n_prompts)
            store_prompt_set(db, pset)
            psets[prepared.fingerprint] = pset
        pset = psets[prepared.fingerprint]
        ids = [sample_id(row["id"], p.id, settings.hash) for p in pset.prompts]
        have = sample_tables.sample_ids(db, row["id"], settings.hash, pset.id)
        B = settings.batch_size
        batches = [list(pset.prompts[i : i + B]) for i in range(0, len(pset.prompts), B)]
        todo = [b for b in batches if any(sample_id(row["id"], p.id, settings.hash) not in have for p in b)]
        existing = sum(1 for i in ids if i in have)
        plans.append(RunPlan(row, pset, n_recur, rule, todo, len(ids) - existing, existing))
    return plans


def sample_run(
    db,
    db_path: Path,
    p: RunPlan,
    settings: SampleOptions,
    device: torch.device,
    result: RunSamples,
    on_batch: Callable[[int], None] = lambda n: None,
    log: Callable[[str], None] = lambda msg: None,
) -> None:
    """Generate and store the missing batches of one run, one transaction per batch."""
    run_id = p.row["id"]
    model, cfg, tok_path = checkpoint.load_model(
        checkpoint.run_dir(db_path, run_id) / checkpoint.CKPT_NAME, device, p.row
    )
    dtype, dtype_reason = choose_precision(db, settings.precision, device)
    cast_for_inference(model, dtype)  # once, for every batch: no autocast re-casting the weights at every step
    ctx = cfg.model.max_seq_len
    tok = Tokenizer(tok_path)
    stop_ids = (tok.bos_id, tok.eos_id)
    # warm-up (kernel selection, allocator) so the measured speed is the steady state
    with torch.inference_mode():
        model(torch.ones(1, 1, dtype=torch.long, device=device), n_recur=p.n_recur, extrapolate=p.extrapolate)
    encoded_all = {q.id: tok.encode(q.text, bos=True, eos=False) for b in p.batches for q in b}
    if settings.max_new_tokens is not None:
        past = [e for e in encoded_all.values() if len(e) + settings.max_new_tokens - 1 > ctx]
        if past:
            log(
                f"warning: --max-new-tokens {settings.max_new_tokens} runs past the {ctx}-token context of {run_id} "
                f"for {len(past)} of {len(encoded_all)} prompts: from there the window slides, re-encoding the last "
                f"{ctx} tokens every step without a cache (slower, and text the model was never trained to continue)"
            )
    for batch in p.batches:
        ids = [sample_id(run_id, q.id, settings.hash) for q in batch]
        encoded = [encoded_all[q.id] for q in batch]
        limits = [settings.new_token_limit(len(e), ctx) for e in encoded]
        rep = DecodeReport()
        # Three-part's s0 comes from the global RNG (sample_all runs inside fork_rng, so this does not leak).
        torch.manual_seed(batch_seed(settings.seed, [q.idx for q in batch]))
        gens = [torch.Generator(device=device).manual_seed(row_seed(settings.seed, q.idx)) for q in batch]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        outs = generate_batch(
            model,
            encoded,
            max_new_tokens=limits,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            stop_ids=stop_ids,
            n_recur=p.n_recur,
            generators=gens,
            extrapolate=p.extrapolate,
            exit=exit_rule(settings),
            compile=settings.compile,
            report=rep,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.gen_seconds += time.perf_counter() - t0
        result.new_tokens += sum(len(o.tokens) + (o.finish_reason == "eos") for o in outs)
        now = dbm.now()
        added = sample_tables.insert_samples(
            db,
            [
                {
                    "id": sid,
                    "run_id": run_id,
                    "prompt_id": q.id,
                    "prompt_set": p.pset.id,
                    "completion": decode_completion(tok, ids_in, o.tokens),
                    "settings_json": settings.to_json(),
                    "settings_hash": settings.hash,
                    "temperature": settings.temperature,
                    "top_k": settings.top_k,
                    "top_p": settings.top_p,
                    "max_new_tokens": limit,
                    "seed": settings.seed,
                    "n_recur": p.n_recur,
                    "batch_size": settings.batch_size,
                    "device": device.type,
                    "dtype": rep.dtype,
                    "n_tokens": len(o.tokens),
                    "finish_reason": o.finish_reason,
                    "created_at": now,
                    "extrapolate": p.extrapolate,
                    "exit_rule": settings.exit_rule,
                    "exit_threshold": settings.exit_threshold,
                    "mean_depth": o.mean_depth,
                    "dtype_reason": dtype_reason,
                    "decode": decode_label(rep, settings.compile),
                }
                for sid, q, ids_in, o, limit in zip(ids, batch, encoded, outs, limits)
            ],
        )
        result.generated += added
        on_batch(len(batch))


def sample_all(
    db,
    db_path: str | Path,
    opts: SampleOptions,
    *,
    progress: bool | Progress = True,
    confirm: Callable[[str], bool] | None = None,
) -> SampleSummary:
    """Complete the prompt set with every finished run `opts` selects; stored samples are skipped. See the docstring.

    `progress`: a `Progress` to report on (one task over every sample to generate), or True / False for a default
    reporter / none. `opts.jobs` (a number or "auto", as for training): runs sampled at once, each share of the runs
    in its own process with its share of the cores; a sample does not depend on which process drew it (every batch
    seeds its own generators)."""
    reporter = as_progress(progress)
    settings = opts  # the options' sample settings (`to_dict`, `hash`) are what every sample records
    dev = resolve_device(opts.device, option="--device")
    rows = select_runs(db, opts.select)
    plans = plan(db, rows, settings, opts.n_prompts, progress=reporter.enabled)
    todo = sum(len(b) for p in plans for b in p.batches)
    if todo and opts.n_recur is not None:  # a depth of the user's choosing: ask before what would take hours
        confirm_long(
            estimate_seconds(plans, settings),
            f"sampling {todo} completion(s) at --n-recur {opts.n_recur}",
            yes=opts.yes,
            confirm=confirm,
        )
    summary = SampleSummary(settings, settings.hash, dev.type, sorted({p.pset.id for p in plans}))
    elsewhere = _sample_in_jobs(db_path, plans, opts, reporter)
    plans_here = [p for p in plans if p.row["id"] not in elsewhere]
    total = sum(len(b) for p in plans_here for b in p.batches)
    bar = reporter.task("sampling", total=total, **{"tok/s": "-"}) if total else silent().task("sampling")
    cuda_ids = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    # Model building and the per-batch seeding use the global RNG: keep the caller's streams untouched.
    with torch.random.fork_rng(devices=cuda_ids), bar:
        for p in plans:
            r = p.row
            res = elsewhere.get(r["id"]) or RunSamples(
                r["id"],
                r["arch"],
                r["preset"],
                r["seed"],
                p.n_recur,
                skipped=p.existing,
                variant=r.get("variant") or r["arch"],
            )
            summary.runs.append(res)
            if p.batches and r["id"] not in elsewhere:
                label = f"{r['arch']} s{r['seed']}"
                sample_run(
                    db,
                    Path(db_path),
                    p,
                    settings,
                    dev,
                    res,
                    log=reporter.log,
                    on_batch=lambda n, label=label, res=res: bar.update(
                        advance=n, description=label, **{"tok/s": _rate(res.tokens_per_s)}
                    ),
                )
            res.n_samples, res.mean_tokens, res.eos_share = sample_tables.sample_stats(
                db, r["id"], p.pset.id, settings.hash
            )
            res.mean_depth = sample_tables.sample_mean_depth(db, r["id"], p.pset.id, settings.hash)
    summary.example = _example(db, plans[0], settings)
    return summary


def estimate_seconds(plans: list[RunPlan], settings: SampleOptions) -> float:
    """About how long generating the missing samples of `plans` takes: each new token one forward at the run's
    depth, at the rate its training reached (`benchctl.core.progress.inference_seconds`); a rough figure, for the
    confirmation before long work."""
    total = 0.0
    for p in plans:
        cfg = RunConfig.from_json(p.row["config_json"])
        model = architectures.build_shapes(cfg.arch, cfg.model)
        T = cfg.model.max_seq_len
        flops = model.flops_per_token(T, p.n_recur, training=False)
        new = settings.max_new_tokens or T
        total += inference_seconds(p.row, sum(len(b) for b in p.batches) * new, flops)
    return total


def _sample_in_jobs(
    db_path: str | Path, plans: list[RunPlan], opts: SampleOptions, reporter: Progress
) -> dict[str, RunSamples]:
    """With more than one job, the runs that have samples to generate, split into that many shares of about equal
    work, each sampled by `sample_all` in its own process (benchctl.stages.train.executors.local.in_shares): run id ->
    what its process did. Empty when everything runs here."""
    busy = [p for p in plans if p.batches]
    work = [sum(len(b) for b in p.batches) * float(p.row.get("flops_per_token") or 1.0) * p.n_recur for p in busy]
    summaries = in_shares(
        sample_all,
        [p.row["id"] for p in busy],
        work,
        lambda ids: {"opts": replace(opts, select=RunSelection(run_ids=ids), jobs=1, yes=True)},
        jobs=opts.jobs,
        db_path=Path(db_path),
        device_spec=opts.device,
        progress=reporter,
        log=reporter.log,
        what="sampling",
    )
    if summaries is None:
        return {}
    return {r.run_id: r for s in summaries for r in s.runs}


def _rate(tokens_per_s: float | None) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s else "-"


def _example(db, first: RunPlan, settings: SampleOptions) -> dict[str, Any] | None:
    """The first run's completion of the first prompt, for the closing output."""
    ex = sample_tables.first_sample(db, first.row["id"], settings.hash, first.pset.id)
    if ex is None:
        return None
    return {
        "arch": first.row["arch"],
        "run_id": first.row["id"],
        "prompt": ex["text"],
        "completion": ex["completion"],
        "finish_reason": ex["finish_reason"],
        "n_tokens": ex["n_tokens"],
    }
