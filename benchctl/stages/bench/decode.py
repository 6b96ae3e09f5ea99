"""Decode benchmark (`benchctl bench --decode`): how fast each architecture generates, on the zoo's decode path and
on the reference path, with the tokens checked against the reference in float32 in the same run.

Per architecture, at its trained depth, the model is built from the preset's config under the bench seed (random
weights: speed does not depend on what the weights say) and cast once to float32. For each batch size, every row's
prompt is `prompt_tokens` random ids (the same for every architecture) and the generation greedy with no stop ids,
so every row runs to its limit: `new_tokens`, or by default what the context leaves after the prompt. Subjects:

- `decode`: `architectures.generate.generate` on the decode path (compiled with `--compile`);
- `decode-reference`: the same call with `fast=False`, the plain eager loop, in float32.

Warm-up generations (compilation happens there) are excluded; then the subjects take turns generation by generation
for `repeats` rounds, so load on a shared machine falls on both alike. Each generation is split into its prefill
(the forward over the prompts) and its decode phase (everything after), timed apart (`DecodeReport` timing); rows
hold the median tokens per second of each phase over the repeats, the decode phase's slowest and fastest repeat, and
`agreement`: the share of generated tokens equal to the reference path's in float32 (1 = token for token).

Further implementations of the same weights (transformers, llama2.c's run.c on an exported checkpoint) belong beside
these two as more `impl` values of the same rows; they need an export that does not exist yet.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import architectures
from architectures.generate import DecodeReport, cast_for_inference, generate
from benchctl.core import db as dbm
from benchctl.core import telemetry
from benchctl.core.config import RunConfig, make_config
from benchctl.core.runtime import resolve_device
from benchctl.stages.bench.options import BenchOptions

IMPLS = ("decode", "decode-reference")


@dataclass
class DecodeSubject:
    arch: str
    impl: str
    cfg: RunConfig
    model: torch.nn.Module
    batch: int
    prompts: list[list[int]]
    new_tokens: int
    compile: bool
    warmup_seconds: float = 0.0
    reports: list[DecodeReport] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # what the last repeat generated

    def generate(self, seed: int) -> tuple[list[list[int]], DecodeReport]:
        rep = DecodeReport(timing=True)
        torch.manual_seed(seed)  # random initial states (three-part) draw the same numbers on both paths
        outs = generate(
            self.model,
            self.prompts,
            max_new_tokens=self.new_tokens,
            temperature=0.0,
            fast=self.impl == "decode",
            compile=self.compile,
            report=rep,
        )
        return [g.tokens for g in outs], rep


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Share of positions where two generations of the same prompts hold the same token (missing ones differ)."""
    total = sum(max(len(a), len(b)) for a, b in zip(got, ref))
    same = sum(x == y for a, b in zip(got, ref) for x, y in zip(a, b))
    return same / total if total else 1.0


def run_decode(opts: BenchOptions, log: Callable[[str], None] = lambda _m: None) -> list[dict[str, Any]]:
    """Benchmark generation for every architecture of `opts` (see the module docstring); returns the bench rows."""
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    names = opts.archs or architectures.names()
    cfgs = [make_config(opts.preset, a, opts.seed, opts.overrides) for a in names]
    device = resolve_device(cfgs[0].train.device if opts.device == "auto" else opts.device)
    bench_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    rows: list[dict[str, Any]] = []
    for cfg in cfgs:
        torch.manual_seed(opts.seed)
        model = cast_for_inference(architectures.build(cfg.arch, cfg.model).to(device), torch.float32)
        ctx = cfg.model.max_seq_len
        n_prompt = min(opts.decode_prompt_tokens, ctx)
        n_new = opts.decode_new_tokens or ctx + 1 - n_prompt
        for batch in opts.decode_batches:
            g = torch.Generator().manual_seed(opts.seed)
            prompts = torch.randint(3, cfg.model.vocab_size, (batch, n_prompt), generator=g).tolist()
            compiled = bool(opts.compile)
            subjects = [
                DecodeSubject(cfg.arch, impl, cfg, model, batch, prompts, n_new, compiled and impl == "decode")
                for impl in IMPLS
            ]
            log(f"{cfg.arch}: batch {batch}, {n_prompt} prompt + {n_new} new tokens per row")
            for s in subjects:
                t0 = time.perf_counter()
                for _ in range(opts.warmup):
                    s.generate(opts.seed)
                s.warmup_seconds = time.perf_counter() - t0
            loads = []
            for _ in range(opts.repeats):
                for s in subjects:
                    s.tokens, rep = s.generate(opts.seed)
                    s.reports.append(rep)
                loads.append(_load())
            ref = subjects[1].tokens  # the reference path in float32
            rows += [_row(s, bench_id, opts, device, agreement(s.tokens, ref), loads) for s in subjects]
    return rows


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _row(
    s: DecodeSubject,
    bench_id: str,
    opts: BenchOptions,
    device: torch.device,
    agree: float,
    loads: list[float | None],
) -> dict[str, Any]:
    decode = [r.decode_tokens / r.decode_seconds for r in s.reports if r.decode_seconds > 0]
    prefill = [r.prefill_tokens / r.prefill_seconds for r in s.reports if r.prefill_seconds > 0]
    last = s.reports[-1]
    env = telemetry.environment(device)
    known = [x for x in loads if x is not None]
    how = "compiled" if last.compiled else f"eager ({last.reason})" if s.impl == "decode" else "eager"
    notes = [
        f"threads={torch.get_num_threads()}",
        f"{last.path} path, {how}",
        "greedy, no stop ids: every row runs to its limit; random weights",
    ]
    return {
        "bench_id": bench_id,
        "arch": s.arch,
        "preset": opts.preset,
        "mode": "decode",
        "impl": s.impl,
        "compiled": int(last.compiled),
        "dtype": last.dtype,
        "device": device.type,
        "device_name": env["device_name"],
        "repeats": opts.repeats,
        "warmup_steps": opts.warmup,
        "warmup_seconds": s.warmup_seconds,
        "batch": s.batch,
        "prompt_tokens": len(s.prompts[0]),
        "new_tokens": s.new_tokens,
        "tokens_per_s": statistics.median(decode) if decode else None,
        "tokens_per_s_min": min(decode) if decode else None,
        "tokens_per_s_max": max(decode) if decode else None,
        "prefill_tokens_per_s": statistics.median(prefill) if prefill else None,
        "agreement": agree,
        "load_avg": statistics.mean(known) if known else None,
        "threads": torch.get_num_threads(),
        "note": "; ".join(notes),
        "config_json": s.cfg.to_json(),
        "torch_version": env["torch_version"],
        "git_commit": env["git_commit"],
        "created_at": dbm.now(),
    }
