"""Inference cost: what each finished run spends and keeps when it generates under each inference setting, and what
its recurrent state does across iterations.

For every finished run and every setting the options declare (`settings_for`), on the same prompts (the first
`batch` validation windows of the run's fixed set, cut to `prompt_tokens`; runs on the same data get the same
prompts) it measures, with `architectures.inference`:

- decode speed at batch 1 (the first `single` prompts, one generation each) and at batch `batch` (all prompts in one
  generation): prefill and decode are timed apart and the tokens per second of the decode phase is the headline;
  one warm-up generation per setting comes first and is not timed, and each timed generation is repeated `repeats`
  times: the median rate is stored with its range;
- with `paired` (the default), the speed-up over full depth: each repeat also times full depth on the same prompts
  right beside the setting (in alternating order), and the ratio of the two decode rates is kept per repeat, so the
  machine's drift between settings measured minutes apart does not enter it; the median ratio is stored with its
  range and every repeat's ratio;
- what the timings were measured under: the machine's mean 1-minute load average and logical cores, and the
  process's CPU share of the timed generations (CPU time over wall time times threads), so the report can flag
  rows timed on a contended machine as it flags contended training runs;
- the KV-cache bytes the batched generation holds, per 1,000 cached tokens; its peak memory (CUDA: torch's peak
  allocation; CPU: the process's peak RSS, since reset where Linux allows it);
- FLOPs spent per generated token and the mean depth, as the engine counts them (tokens that exited are not
  computed further, so this is what was spent, not an estimate from the mean depth);
- the teacher-forced validation loss under the same setting on the first `windows` validation windows, with its own
  FLOPs spent and mean depth (a speculative setting's output is the full-depth output: its loss is the verifier's);
- agreement: the share of the batched generation's greedy tokens equal to the run's full-depth greedy
  continuation of the same prompts (1 for full depth itself; read back from the stored full-depth row on a rerun).

Generation and loss run in float32 without autocast, under `torch.no_grad()`, with the torch RNG seeded from the
run's `eval.val_seed` before every call, so every setting of a run sees the same numbers. A setting a run cannot
run (`architectures.inference.supports`) is skipped with its reason, not failed; an architecture without the
iteration hooks (the control) gets the full-depth row only: it is the reference row of the comparison.

The latent view: for the first `latent_sequences` validation windows, the state after each iteration at the trained
depth (the `prelude` / `core_step` hooks of `architectures.base.BaseLM`): per position the relative change
||s_i - s_(i-1)|| / ||s_i|| for i = 1..n, and for `latent_tokens` evenly spaced positions their states at
iterations 0..n projected on the first two principal components of those states.

Rows go to `inference_results` (one per run, setting and measurement sizes, written as soon as measured) and
`inference_latents` (a run's windows in one transaction); a rerun measures only what is missing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import architectures
from architectures import inference as inf
from benchctl.core import checkpoint, data, telemetry
from benchctl.core.config import RunConfig
from benchctl.core.errors import ConfigError, EvalError
from benchctl.core.progress import Progress, as_progress, silent
from benchctl.core.runtime import resolve_device
from benchctl.stages.infer import tables as infer_tables
from benchctl.stages.infer.latent import trace_latents
from benchctl.stages.infer.options import InferOptions
from benchctl.stages.train import tables as train_tables

FULL = "full depth"


@dataclass(frozen=True)
class Measured:
    """One setting of a run: a plain generation setting, or speculative drafting (`draft` set, verified at full
    depth with `k` tokens drafted per verification)."""

    setting: Any  # architectures.inference.InferenceSetting: the generation's (speculative: the verifier's)
    draft: Any = None  # speculative: the draft's InferenceSetting
    k: int = 0

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    @property
    def label(self) -> str:
        if self.speculative:
            return f"speculative draft {self.draft.label()} k={self.k}"
        return FULL if self.setting == inf.InferenceSetting() else self.setting.label()


def settings_for(arch_cls: Any, opts: InferOptions) -> list[Measured]:
    """The settings to measure for a run of `arch_cls`: full depth first (the reference every other setting's
    agreement is taken against), then for an architecture with iteration hooks every exit threshold under every
    KV strategy (threshold 0 with `full` is full depth itself), optionally each again with the warm start, and the
    speculative drafts."""
    out = [Measured(inf.InferenceSetting())]
    if not arch_cls.iterable():
        return out
    warm = (False, True) if opts.warm_start else (False,)
    for w in warm:
        for thr in opts.thresholds:
            for kv in opts.kv:
                if thr == 0 and kv == "full" and not w:
                    continue
                rule = opts.exit_rule if thr > 0 else None  # threshold 0: no token exits, whatever the rule
                out.append(Measured(inf.InferenceSetting(exit_threshold=thr, exit_rule=rule, kv=kv, warm_start=w)))
    out += [Measured(inf.InferenceSetting(), inf.InferenceSetting(n_recur=d), opts.spec_k) for d in opts.drafts]
    return out


def agreement(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Share of positions where two generations of the same prompts hold the same token (missing ones differ)."""
    total = sum(max(len(a), len(b)) for a, b in zip(got, ref))
    same = sum(x == y for a, b in zip(got, ref) for x, y in zip(a, b))
    return same / total if total else 1.0


@dataclass
class InferSummary:
    rows: list[dict[str, Any]] = field(default_factory=list)  # measured by this call
    skipped: int = 0  # already stored
    unsupported: list[tuple[str, str, str]] = field(default_factory=list)  # (run id, setting, reason)
    latents: int = 0  # runs traced by this call
    seconds: float = 0.0


@dataclass
class _RunPlan:
    row: dict[str, Any]
    cfg: Any
    todo: list[Measured]
    sizes: dict[str, int]  # the key's measurement sizes: prompts, single, prompt_tokens, new_tokens, windows
    windows: torch.Tensor  # (max(batch, windows, latent_sequences), T+1): the run's first validation windows
    latent: list[int]  # window indices still to trace
    latent_tokens: int
    repeats: int  # timed generations per setting (not part of the key: a stored row keeps its own)
    paired: bool  # time full depth beside every other setting and store the ratio


def _sizes(cfg: Any, opts: InferOptions, run: str = "") -> dict[str, int]:
    """Measurement sizes for one run: the prompt takes at most half the context, the generation the rest; a size
    the run's context cannot hold is refused (measuring a shorter one under the asked-for name would mislabel it)."""
    ctx = int(cfg.model.max_seq_len)
    half = max(1, ctx // 2)
    if opts.prompt_tokens > half:
        raise ConfigError(
            f"--prompt-tokens {opts.prompt_tokens}: {run or 'the run'} has a context of {ctx} tokens, and a prompt "
            f"takes at most half of it ({half})"
        )
    if opts.new_tokens > ctx - opts.prompt_tokens:
        raise ConfigError(
            f"--new-tokens {opts.new_tokens}: {run or 'the run'} has a context of {ctx} tokens, "
            f"{opts.prompt_tokens} of them the prompt; at most {ctx - opts.prompt_tokens} new tokens"
        )
    return {
        "prompts": opts.batch,
        "single": opts.single,
        "prompt_tokens": opts.prompt_tokens,
        "new_tokens": opts.new_tokens,
        "windows": min(opts.windows, int(cfg.eval.val_windows)),
    }


def _key(m: Measured, sizes: dict[str, int]) -> tuple[Any, ...]:
    return (m.label, *(sizes[k] for k in infer_tables.INFERENCE_RESULTS.pk[2:]))


def plan(
    db: Any, rows: list[dict[str, Any]], opts: InferOptions, *, progress: bool = False
) -> tuple[list[_RunPlan], int]:
    """Settings still to measure and windows still to trace per run (every check done before any work), and how
    many rows are already stored."""
    plans, skipped, prepared_by_key = [], 0, {}
    for row in rows:
        cfg = RunConfig.from_json(row["config_json"])
        cls = architectures.get(cfg.arch)
        sizes = _sizes(cfg, opts, row["id"])
        have = infer_tables.result_keys(db, row["id"])
        settings = settings_for(cls, opts)
        todo = [m for m in settings if _key(m, sizes) not in have]
        skipped += len(settings) - len(todo)
        n_rec = int(cfg.model.n_recur)
        traced = infer_tables.latent_keys(db, row["id"])
        latent = [i for i in range(opts.latent_sequences) if (i, n_rec) not in traced] if cls.iterable() else []
        if not todo and not latent:
            continue
        prepared = data.prepared_for_run(
            prepared_by_key, row["id"], row.get("data_fingerprint"), cfg.data, cfg.model.vocab_size, progress=progress
        )
        # the run's fixed validation set (as `train` evaluates on), longer only when the prompts need more windows
        need = max(opts.batch, sizes["windows"], opts.latent_sequences, 1)
        win = data.val_windows(
            prepared.valid_tokens(), cfg.model.max_seq_len, max(need, cfg.eval.val_windows), cfg.eval.val_seed
        )
        plans.append(_RunPlan(row, cfg, todo, sizes, win[:need], latent, opts.latent_tokens, opts.repeats, opts.paired))
    return plans, skipped


# ---- measurements ----------------------------------------------------------------------------------------------------


def _generate(model: Any, m: Measured, prompts: list[list[int]], new: int, seed: int) -> Any:
    torch.manual_seed(seed)  # random initial states (three-part) draw the same numbers for every setting
    with torch.no_grad():
        if m.speculative:
            return inf.speculative_generate(model, prompts, new, draft=m.draft, k=m.k)  # verified at full depth
        return inf.generate_adaptive(model, prompts, new, m.setting, temperature=0.0)


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _summary(name: str, values: Sequence[float | None]) -> dict[str, float | None]:
    """The median of a rate's repeats and their range."""
    values = [v for v in values if v is not None]
    return {
        name: _median(values),
        f"{name}_min": min(values) if values else None,
        f"{name}_max": max(values) if values else None,
    }


def _peak_start(device: torch.device) -> bool:
    """Start a peak-memory phase; False where only the process's lifetime peak can be read."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return telemetry.reset_peak_rss()


def _peak(device: torch.device, phase: bool) -> tuple[int | None, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda-allocated"
    return telemetry.run_peak_rss_bytes(), "process-rss" if phase else "process-rss-lifetime"


def teacher_forced(model: Any, windows: torch.Tensor, batch_size: int, setting: Any, seed: int) -> dict[str, float]:
    """Loss, FLOPs spent per token and mean depth of a setting over the windows (N, T+1), token-weighted."""
    total = {"loss": 0.0, "flops": 0.0, "depth": 0.0}
    count = 0
    torch.manual_seed(seed)
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            w = windows[i : i + batch_size]
            loss, flops, depth = inf.evaluate_adaptive(model, w[:, :-1], w[:, 1:], setting)
            n = w[:, 1:].numel()
            total["loss"] += float(loss) * n
            total["flops"] += float(flops) * n
            total["depth"] += float(depth) * n
            count += n
    return {
        "val_loss": total["loss"] / count,
        "val_flops_per_token": total["flops"] / count,
        "val_mean_depth": total["depth"] / count,
    }


def measure(
    model: Any,
    m: Measured,
    prompts: list[list[int]],
    sizes: dict[str, int],
    windows: torch.Tensor,
    cfg: Any,
    device: torch.device,
    reference: list[list[int]] | None,
    repeats: int = 1,
    paired: Measured | None = None,
) -> dict[str, Any]:
    """Every number of one (run, setting) row but its key (see the module docstring)."""
    seed, new = int(cfg.eval.val_seed), sizes["new_tokens"]
    t0 = time.perf_counter()
    _generate(model, m, prompts[:1], min(new, 4), seed)  # warm-up: first-call costs stay out of the timings
    if paired is not None:
        _generate(model, paired, prompts[:1], min(new, 4), seed)
    # Each timing is a fraction of a second of a small model's decode, so one alone moves by tens of percent with
    # whatever else the machine does: every generation is repeated and the median rate kept, with its range.
    # Greedy decoding under a fixed seed makes the same tokens every time; the first repeat's are stored.
    # A rate measured minutes after full depth's also carries the machine's drift in between, so with `paired` (full
    # depth) each repeat times the reference right beside the setting, in alternating order, and keeps the ratio.
    rates = {which: {"single": [], "batch": []} for which in ("setting", "paired")}
    prefill: dict[str, list[float]] = {"single": [], "batch": []}
    outs, peaks = [], []
    # What the timings were measured under, as training records it: the machine's load, and the share of the
    # timed span the process's threads really ran (a process waiting for a core accrues no CPU time).
    load = telemetry.LoadSampler().start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        for rep in range(repeats):
            order = [("setting", m), ("paired", paired)] if rep % 2 == 0 else [("paired", paired), ("setting", m)]
            for which, mm in order:
                if mm is None:
                    continue
                singles = [_generate(model, mm, [p], new, seed) for p in prompts[: sizes["single"]]]
                phase = _peak_start(device)
                batched = _generate(model, mm, prompts, new, seed)
                if which == "setting":
                    outs.append(batched)
                    peaks.append(_peak(device, phase))
                for size, gens, prompt_tokens in (
                    ("single", singles, sum(len(p) for p in prompts[: len(singles)])),
                    ("batch", [batched], sum(len(p) for p in prompts)),
                ):
                    rates[which][size].append(
                        _rate(sum(o.new_tokens for o in gens), sum(o.decode_seconds for o in gens))
                    )
                    if which == "setting":
                        prefill[size].append(_rate(prompt_tokens, sum(o.prefill_seconds for o in gens)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        load.stop()
    threads = torch.get_num_threads()
    speedups = {
        size: [s / f for s, f in zip(rates["setting"][size], rates["paired"][size]) if s is not None and f]
        for size in ("single", "batch")
    }
    batched, (peak, source) = outs[0], peaks[0]
    tf = teacher_forced(model, windows[: sizes["windows"]], int(cfg.eval.val_batch_size), m.setting, seed)
    row = {
        "kind": "speculative" if m.speculative else "plain",
        "n_recur": int(m.setting.n_recur or cfg.model.n_recur),
        "exit_rule": (m.setting.exit_rule or "") if m.setting.exit_threshold > 0 else "",
        "exit_threshold": float(m.setting.exit_threshold),
        "kv": m.setting.kv,
        "warm_start": int(m.setting.warm_start),
        "draft_n_recur": int(m.draft.n_recur) if m.speculative else 0,
        "spec_k": m.k,
        "device": device.type,
        "threads": threads,
        "repeats": repeats,
        **_summary("tokens_per_s_1", rates["setting"]["single"]),
        "prefill_tokens_per_s_1": _median(prefill["single"]),
        **_summary("tokens_per_s_batch", rates["setting"]["batch"]),
        "prefill_tokens_per_s_batch": _median(prefill["batch"]),
        "peak_mem_bytes": peak,
        "peak_mem_source": source,
        "kv_bytes": int(batched.kv_bytes),
        # per cached position and row, as the strategy declares it (the engine's tests hold kv_bytes to it)
        "kv_bytes_per_1k": 1000.0 * inf.kv_bytes_per_token(model, m.setting),
        "flops_per_token": float(batched.flops_per_token),
        "mean_depth": float(batched.mean_depth),
        "mean_exit_depth": float(batched.mean_exit_depth),
        **tf,
        # full depth is its own reference; without a stored full-depth row there is nothing to agree with
        "agreement": 1.0 if m.label == FULL else None if reference is None else agreement(batched.tokens, reference),
        "proposed": getattr(batched, "proposed", None),
        "accepted": getattr(batched, "accepted", None),
        "acceptance_rate": getattr(batched, "acceptance_rate", None),
        "tokens_json": json.dumps(batched.tokens),
        **_summary("speedup_1", speedups["single"]),
        **_summary("speedup_batch", speedups["batch"]),
        "speedups_json": json.dumps(speedups) if paired is not None else None,
        "load_avg": load.total / load.n if load.n else None,
        "cores": os.cpu_count(),
        "cpu_share": cpu / (wall * threads) if wall > 0 else None,
    }
    row["seconds"] = time.perf_counter() - t0
    return row


def measure_run(
    db: Any,
    db_path: Path,
    p: _RunPlan,
    device: torch.device,
    summary: InferSummary,
    on_row: Callable[[dict[str, Any] | None], None],
) -> None:
    """Load one run's model, trace its missing latent windows, and measure (and store) each missing setting."""
    model, cfg, _ = checkpoint.load_model(
        checkpoint.run_dir(db_path, p.row["id"]) / checkpoint.CKPT_NAME, device, p.row
    )
    model = model.float().eval()
    seed = int(cfg.eval.val_seed)
    if p.latent:
        rows = trace_latents(model, p.windows[p.latent].to(device), p.latent_tokens, seed)
        infer_tables.record_latents(db, [{"run_id": p.row["id"], "sequence": i, **r} for i, r in zip(p.latent, rows)])
        summary.latents += 1
    prompts = p.windows[: p.sizes["prompts"], : p.sizes["prompt_tokens"]].tolist()
    windows = p.windows.to(device)
    full_key = _key(Measured(inf.InferenceSetting()), p.sizes)
    reference = infer_tables.stored_tokens(db, p.row["id"], full_key)
    for m in p.todo:
        reason = inf.supports(model, m.draft if m.speculative else m.setting)
        if reason is None and m.speculative:
            reason = inf.supports(model, m.setting)
        if reason is not None:
            summary.unsupported.append((p.row["id"], m.label, reason))
            on_row(None)
            continue
        paired = Measured(inf.InferenceSetting()) if p.paired and m.label != FULL else None
        row = measure(model, m, prompts, p.sizes, windows, cfg, device, reference, p.repeats, paired)
        if m.label == FULL:
            reference = json.loads(row["tokens_json"])
        row = {"run_id": p.row["id"], "setting": m.label, **p.sizes, **row}
        infer_tables.record_inference_result(db, row)
        on_row({**row, "arch": p.row["arch"], "seed": p.row["seed"]})


def infer_all(db: Any, db_path: str | Path, opts: InferOptions, *, progress: bool | Progress = True) -> InferSummary:
    """Measure every finished run `opts` selects at every declared setting and trace its latent view; what is stored
    is skipped (see the module docstring)."""
    reporter = as_progress(progress)
    dev = resolve_device(opts.device, option="--device")
    sel = opts.select
    rows = train_tables.finished_runs(
        db,
        run_ids=sel.run_ids,
        archs=sel.archs,
        preset=sel.preset,
        none_left=EvalError,
        purpose="to measure",
        kind="stories",
    )
    plans, skipped = plan(db, rows, opts, progress=reporter.enabled)
    summary = InferSummary(skipped=skipped)
    total = sum(len(p.todo) for p in plans)
    bar = reporter.task("infer", total=total) if total else silent().task("infer")
    t0 = time.perf_counter()
    with bar:
        for p in plans:
            label = f"{p.row['arch']} s{p.row['seed']}"

            def on_row(r: dict[str, Any] | None, label: str = label) -> None:
                if r is not None:
                    summary.rows.append(r)
                bar.update(advance=1, description=label)

            measure_run(db, Path(db_path), p, dev, summary, on_row)
    summary.seconds = time.perf_counter() - t0
    return summary
