"""Decode benchmark (`benchctl bench --decode`): how fast each architecture generates, on the zoo's decode path and
on the reference path, with the tokens checked against the reference in float32 in the same run.

Per architecture, at its trained depth, the model is built from the preset's config under the bench seed (random
weights: speed does not depend on what the weights say), its matrices scaled up (`widen`: so that greedy
continuations vary and the agreement check compares real choices) and cast once to float32. For each batch size,
every row's prompt is `prompt_tokens` random ids (the same for every architecture) and the generation greedy with
no stop ids, so every row runs to its limit: `new_tokens`, or by default what the context leaves after the prompt.
Subjects:

- `decode`: `architectures.generate.generate` on the decode path (compiled with `--compile`), the model prepared
  for inference as sample and eval prepare it (`cast_for_inference`: cast once, linear weights laid out);
- `decode-reference`: the same call with `fast=False`, the plain eager loop, in float32, on the weights as training
  leaves them;
- `decode` again for every other precision of `--precisions`, the weights cast once to it (what sample and eval
  choose from: `benchctl.stages.bench.precision`).

Warm-up generations (compilation happens there) are excluded; then the subjects take turns generation by generation
for `repeats` rounds, so load on a shared machine falls on all alike. Each generation is split into its prefill
(the forward over the prompts) and its decode phase (everything after), timed apart (`DecodeReport` timing); rows
hold the median tokens per second of each phase over the repeats, the decode phase's slowest and fastest repeat, and
`agreement`: the share of generated tokens equal to the reference path's in float32 (1 = token for token).

Beside them, for an architecture that exports as a plain Llama, the same weights in other implementations
(`benchctl.stages.bench.external`): `transformers` (when installed) on the same prompts, and `llama2c-runfast` (with
`--llama2c DIR`, on a CPU, batch 1 and one thread) on a text prompt, each with its agreement with the reference
path in float32 checked in the same run.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import architectures
from architectures.generate import DecodeReport, cast_for_inference, generate
from benchctl.core import db as dbm
from benchctl.core import telemetry
from benchctl.core.config import RunConfig, make_config
from benchctl.core.errors import ConfigError
from benchctl.core.runtime import INFERENCE_DTYPES, resolve_device
from benchctl.stages.bench import external as X
from benchctl.stages.bench.options import BenchOptions

IMPLS = ("decode", "decode-reference")
DETAILS = {
    "decode": "benchctl architectures.generate, decode path (fast=True)",
    "decode-reference": "benchctl architectures.generate, reference loop (fast=False)",
}


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
    detail: str = ""  # what ran, beyond the impl's name
    threads: int | None = None  # None: torch's intra-op threads

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

    def agreement(self, ref: list[list[int]]) -> float:
        return agreement(self.tokens, ref)


@dataclass
class HFSubject(DecodeSubject):
    """transformers' `generate` on the `hf` export of the same weights (`model` is the LlamaForCausalLM)."""

    def generate(self, seed: int) -> tuple[list[list[int]], DecodeReport]:
        return X.hf_generate(self.model, self.prompts, self.new_tokens)


@dataclass
class RunCSubject(DecodeSubject):
    """run.c on the `llama2c` export; `prompts` is benchctl's encoding of `text`, `expected` the reference path's
    greedy continuation of it (stopping at BOS, as run.c does)."""

    run_c: X.RunC | None = None
    files: tuple[Path, Path] | None = None  # model.bin, tokenizer.bin
    text: str = ""
    expected: list[int] = field(default_factory=list)
    printed: bytes = b""

    def generate(self, seed: int) -> tuple[list[list[int]], DecodeReport]:
        assert self.run_c is not None and self.files is not None
        steps = X.run_c_steps(len(self.prompts[0]), self.new_tokens, self.cfg.model.max_seq_len)
        self.printed, tps = self.run_c.generate(*self.files, self.text, steps)
        rep = DecodeReport(path="run.c", dtype="float32", timing=True)
        if tps is not None:  # run.c's rate over its positions after the first, prompt included
            rep.decode_tokens, rep.decode_seconds = steps - 1, (steps - 1) / tps
        return [], rep

    def agreement(self, ref: list[list[int]]) -> float:
        pieces = X.read_tokenizer_bin(self.files[1]) if self.files else []
        return X.text_agreement(pieces, self.prompts[0], self.expected, self.printed)


WIDEN = 8.0


@torch.no_grad()
def widen(model: torch.nn.Module) -> torch.nn.Module:
    """Scale the model's matrices by WIDEN, in place. At its initialisation (std 0.02) a model's greedy continuation
    is mostly one token repeated, so the agreement between implementations would compare almost nothing; wider
    weights give continuations that vary and greedy choices far from ties (speed does not depend on the values)."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.mul_(WIDEN)
    return model


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
    with tempfile.TemporaryDirectory(prefix="benchctl-decode-") as tmp:
        run_c = _build_run_c(opts, device, Path(tmp), log)
        for cfg in cfgs:
            torch.manual_seed(opts.seed)
            # the reference loop runs on the weights as training leaves them; the decode path on a copy prepared
            # for inference (cast, linear weights laid out), as sample and eval prepare theirs
            trained = widen(architectures.build(cfg.arch, cfg.model)).to(device).eval()
            model = cast_for_inference(copy.deepcopy(trained), torch.float32)
            ctx = cfg.model.max_seq_len
            n_prompt = min(opts.decode_prompt_tokens, ctx)
            n_new = opts.decode_new_tokens or ctx + 1 - n_prompt
            hf = _hf_model(cfg, trained, device, Path(tmp) / cfg.arch / "hf", log)
            # the decode path in the other precisions asked for: the weights cast once, as sample and eval cast them
            cast = {
                p: cast_for_inference(copy.deepcopy(trained), INFERENCE_DTYPES[p])
                for p in opts.decode_precisions
                if p != "float32"
            }
            for batch in opts.decode_batches:
                g = torch.Generator().manual_seed(opts.seed)
                prompts = torch.randint(3, cfg.model.vocab_size, (batch, n_prompt), generator=g).tolist()
                compiled = bool(opts.compile)
                subjects = [
                    DecodeSubject(cfg.arch, "decode", cfg, model, batch, prompts, n_new, compiled),
                    DecodeSubject(cfg.arch, "decode-reference", cfg, trained, batch, prompts, n_new, False),
                ]
                subjects += [
                    DecodeSubject(cfg.arch, "decode", cfg, m, batch, prompts, n_new, compiled) for m in cast.values()
                ]
                if hf is not None:
                    subjects.append(
                        HFSubject(cfg.arch, X.HF_IMPL, cfg, hf[0], batch, prompts, n_new, False, detail=hf[1])
                    )
                if run_c is not None and batch == 1:
                    subjects += _run_c_subject(cfg, trained, run_c, opts, Path(tmp) / cfg.arch / "llama2c", log)
                log(f"{cfg.arch}: batch {batch}, {n_prompt} prompt + {n_new} new tokens per row")
                rows += _measure(subjects, bench_id, opts, device)
    return rows


def _measure(subjects: list[DecodeSubject], bench_id: str, opts: BenchOptions, device: torch.device) -> list[dict]:
    """Warm each subject up, then time them taking turns generation by generation; their rows."""
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
    return [_row(s, bench_id, opts, device, s.agreement(ref), loads) for s in subjects]


def _hf_model(
    cfg: RunConfig, model: torch.nn.Module, device: torch.device, folder: Path, log: Callable[[str], None]
) -> tuple[torch.nn.Module, str] | None:
    """transformers' LlamaForCausalLM of `model`'s weights through the `hf` export, and its detail; None (logged)
    when the architecture does not export as one or transformers is missing."""
    from benchctl.export.llama import export_formats, llama_weights

    why = X.transformers_unavailable()
    if why is None and "hf" not in export_formats(model):
        why = "the architecture does not export as a plain Llama"
    if why is not None:
        X.unavailable_log(log, cfg.arch, X.HF_IMPL, why)
        return None
    import transformers

    hf = X.load_hf(llama_weights(model), folder, device)
    return hf, f"transformers {transformers.__version__} LlamaForCausalLM.generate (KV cache) on the hf export"


def _build_run_c(opts: BenchOptions, device: torch.device, tmp: Path, log: Callable[[str], None]) -> X.RunC | None:
    if opts.llama2c is None:
        return None
    directory = X.check_checkout(opts.llama2c)
    if device.type != "cpu":
        log(f"no {X.RUN_C_IMPL} rows: run.c runs on a CPU, this bench on {device.type}")
        return None
    exe, cmd = X.compile_run_c(directory, tmp)
    run_c = X.RunC(exe, cmd, X.checkout_version(directory))
    log(f"compiled {run_c.detail()}")
    return run_c


def _run_c_subject(
    cfg: RunConfig, model: torch.nn.Module, run_c: X.RunC, opts: BenchOptions, folder: Path, log: Callable[[str], None]
) -> list[DecodeSubject]:
    """run.c's subject for `cfg.arch` at batch 1, with the reference path's greedy continuation of its prompt."""
    from benchctl.core import data
    from benchctl.export.llama import export_formats, llama_weights
    from benchctl.export.llama2c import write_model_bin, write_tokenizer_bin

    if "llama2c" not in export_formats(model):
        X.unavailable_log(log, cfg.arch, X.RUN_C_IMPL, "the architecture does not export to llama2.c")
        return []
    weights = llama_weights(model)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_model_bin(weights, folder / "model.bin")
    except ConfigError as e:
        X.unavailable_log(log, cfg.arch, X.RUN_C_IMPL, str(e))
        return []
    tok = data.prepare(cfg.data, cfg.model.vocab_size, progress=False).tokenizer()
    write_tokenizer_bin(tok.path, folder / "tokenizer.bin")
    prompt = tok.encode(X.RUN_C_PROMPT, bos=True)
    ctx = cfg.model.max_seq_len
    n_new = min(opts.decode_new_tokens or ctx + 1 - len(prompt), ctx + 1 - len(prompt))
    torch.manual_seed(opts.seed)
    (ref,) = generate(model, [prompt], max_new_tokens=n_new, temperature=0.0, fast=False, stop_ids=(X.BOS_ID,))
    return [
        RunCSubject(
            cfg.arch,
            X.RUN_C_IMPL,
            cfg,
            model,
            1,
            [prompt],
            n_new,
            False,
            detail=run_c.detail() + f", OMP_NUM_THREADS=1, prompt {X.RUN_C_PROMPT!r}",
            threads=1,
            run_c=run_c,
            files=(folder / "model.bin", folder / "tokenizer.bin"),
            text=X.RUN_C_PROMPT,
            expected=ref.tokens,
        )
    ]


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
    threads = s.threads or torch.get_num_threads()
    if isinstance(s, RunCSubject):
        notes = [
            f"threads={threads}",
            "greedy, stops at BOS as run.c does (new_tokens is the limit); random weights, widened",
            "tok/s: run.c's own figure over every position after the first, prompt included; no separate prefill",
        ]
    else:
        how = (
            f"compiled ({last.compile_mode})"
            if last.compiled
            else f"eager ({last.reason})"
            if s.impl == "decode"
            else "eager"
        )
        notes = [
            f"threads={threads}",
            f"{last.path} path, {how}",
            "greedy, no stop ids: every row runs to its limit; random weights, widened",
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
        "threads": threads,
        "impl_detail": s.detail or DETAILS.get(s.impl, ""),
        "note": "; ".join(notes),
        "config_json": s.cfg.to_json(),
        "torch_version": env["torch_version"],
        "git_commit": env["git_commit"],
        "created_at": dbm.now(),
    }
