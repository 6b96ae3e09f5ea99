"""Benchmark of the training step: benchctl's step beside a plain eager llama2.c reference, timed in the same run.

What is timed is `benchctl.stages.train.engine.train_step`, the exact optimizer step `train` runs (grad_accum
micro-batches, clipping, AdamW), on a model and optimizer built exactly as `train` builds them (`make_optimizer`,
`autocast_dtype`, `resolve_device`, optional `torch.compile`), fed random token batches of the preset's shape (no data
prep needed). Warm-up steps (allocator, caches, compilation) are excluded; then every subject runs `steps` steps per
repeat, the subjects taking turns step by step, so load on a shared machine falls on all of them alike. Each step's
process CPU time is recorded beside its wall time (a second view of the same ratios that descheduling does not distort).

Beside the control, the same run times `Reference` twice when benchctl trains under autocast: at benchctl's precision
(the same-precision ratio) and in fp32 (as llama2.c's train.py runs on a CPU: the ratio its users would see). It is
a straightforward copy of karpathy/llama2.c `model.py` (separate
wq/wk/wv, RoPE through the cos/sin reshape of `apply_rotary_emb`, `F.scaled_dot_product_attention`, tied head) with
llama2.c's `configure_optimizers` (torch.optim.AdamW with default implementation flags on CPU, fused on CUDA) and its
training loop (accumulation, clipping). It starts from benchctl's control weights, so the speed-up is a ratio of two
implementations of the same function; `check_equivalence` trains both for N seeded steps and compares the losses.

Reported per subject: tokens/s (median, min, max over repeats), step time, peak memory (parameters and optimizer state
plus the peak growth of torch's allocations during a step: CUDA's allocator peak, on the CPU the profiler's memory
events; the process's peak RSS is recorded beside it), FLOPs/token
(`model.flops_per_token()`, recurrence included), achieved FLOP/s, and MFU against a known peak: a table of dense
bf16/fp16 tensor-core peaks from vendor datasheets on CUDA (unknown GPU or no peak at that precision -> empty, with a
note), and on CPU the machine's own matmul peak at benchctl's precision (bf16 under autocast, else fp32) measured in
the same run ("of measured matmul peak", not a datasheet number).
On the CPU the same profiled step also gives the time spent in matmul and attention kernels (`kernel_seconds`): the
part of the step no fp32 implementation can remove. The reference's step time over the control's kernel time is the
largest speed-up any implementation built on these kernels could show on this machine (`speedup_ceiling`).
Rows go to the `bench` table of results.db, one `bench_id` per invocation.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import architectures
from benchctl import stages
from benchctl.core import db as dbm
from benchctl.core import telemetry
from benchctl.core.config import RunConfig, make_config
from benchctl.core.runtime import (
    autocast_dtype,
    check_compile_available,
    matmul_precision,
    precision,
    resolve_compile,
    resolve_device,
)
from benchctl.core.telemetry import PeakMemory, state_bytes
from benchctl.stages.bench import tables as bench_tables
from benchctl.stages.bench.decode import run_decode
from benchctl.stages.bench.options import BenchOptions
from benchctl.stages.bench.reference import (  # noqa: F401  (Reference is part of this module's interface)
    Reference,
    build_reference,
    reference_optimizer,
    reference_step,
)
from benchctl.stages.train import curriculum
from benchctl.stages.train.engine import get_lr, make_optimizer, train_step

# ---- device peaks ---------------------------------------------------------------------------------------------------

# Dense (no structured sparsity) tensor-core peaks from the vendors' datasheets, in FLOP/s, at 16-bit precision (bf16
# autocast, what benchctl trains in on GPUs that have it). GPUs without bf16 tensor cores list their fp16 number and
# say so: it is no peak for bf16 (emulated there) nor for fp32, so those get no MFU. GeForce cards are given at fp32
# accumulation (what autocast uses), half their fp16-accumulate marketing number. Patterns are word-bounded ("A100"
# must not match "RTX A1000"); first match wins (more specific patterns first). Laptop GPUs run far below the desktop
# part of the same name and get no MFU. A GPU not listed gets no MFU, never a guessed peak.
GPU_PEAKS: list[tuple[str, float, str]] = [
    (r"H100.*PCIe", 756e12, "H100 PCIe datasheet, bf16 dense"),
    (r"H100.*(SXM|HBM3)|H200|GH200", 989e12, "H100/H200 SXM datasheet, bf16 dense"),
    (r"\bA100\b", 312e12, "A100 datasheet, bf16 dense"),
    (r"L40S", 362e12, "L40S datasheet, bf16 dense"),
    (r"\bL4\b", 121e12, "L4 datasheet, bf16 dense"),
    (r"RTX A6000\b", 154.8e12, "RTX A6000 datasheet, bf16 dense"),
    (r"\bA10\b", 125e12, "A10 datasheet, bf16 dense"),
    (r"RTX 4090\b", 165.2e12, "RTX 4090 (Ada whitepaper), bf16 dense, fp32 accumulate"),
    (r"RTX 3090\b", 71e12, "RTX 3090 (Ampere whitepaper), bf16 dense, fp32 accumulate"),
    (r"V100.*PCIe", 112e12, "V100 PCIe datasheet, fp16 dense (no bf16 tensor cores)"),
    (r"V100", 125e12, "V100 SXM2 datasheet, fp16 dense (no bf16 tensor cores)"),
    (r"\bT4\b", 65e12, "T4 datasheet, fp16 dense (no bf16 tensor cores)"),
]


def gpu_peak(name: str, dtype: str = "bfloat16") -> tuple[float | None, str]:
    """(peak FLOP/s, which number) for a CUDA device name at `dtype`; (None, note) when the table has no such peak."""
    if re.search(r"\bLaptop\b|\bMobile\b|Max-Q", name, flags=re.IGNORECASE):
        return None, f"'{name}' is a laptop GPU (power-limited below the desktop part's peak): MFU left empty"
    for pattern, peak, source in GPU_PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if dtype != "float16" and "no bf16" in source:
                return None, f"{source}: no peak at {dtype} on '{name}', MFU left empty"
            return peak, source
    return None, f"no datasheet peak for '{name}' in benchctl.stages.bench.engine.GPU_PEAKS: MFU left empty"


def measure_matmul_peak(
    device: torch.device, n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """Best FLOP/s of an n x n matmul in `dtype` over `repeats` timed runs on this device, with the current threads."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)  # (n, n)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    a @ b  # warm-up (threads, MKL buffers)
    telemetry.sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        telemetry.sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


# ---- memory ---------------------------------------------------------------------------------------------------------


# The ops whose self time is the step's irreducible arithmetic at its precision: dense matmuls (forward and both
# backward products) and the attention kernels. Everything else in a step (norms, activations, RoPE, softmax of the
# loss, copies, the optimizer) is what an implementation can still shave.
KERNEL_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm")


def is_kernel_op(name: str) -> bool:
    return name in KERNEL_OPS or "scaled_dot_product" in name


PROFILED_STEPS = 2  # CPU: steps profiled after the repeats, for memory and kernel time


@dataclass
class StepProfile:
    """One profiled CPU step: its allocations' peak growth and the self time of its matmul/attention kernels."""

    peak_growth: int | None  # None when this PyTorch's profiler has no memory events
    kernel_seconds: float  # summed self time of KERNEL_OPS and attention ops
    step_seconds: float  # the profiled step's wall time (profiler overhead included)


def profile_cpu_step(step: Callable[[], Any]) -> StepProfile:
    """Run `step` once under torch's profiler. Memory: the peak growth of live torch allocations (the CPU analogue of
    CUDA's max_memory_allocated; a process's RSS cannot tell apart models that share it, and glibc keeps freed pages).
    Kernels: how long the step spends in matmuls and attention, the floor under any fp32 implementation of it."""
    t0 = time.perf_counter()
    with telemetry.memory_profile() as prof:
        step()
    wall = time.perf_counter() - t0
    kernel_us = sum(e.self_cpu_time_total for e in prof.key_averages() if is_kernel_op(e.key))
    return StepProfile(telemetry.allocation_peak(prof), kernel_us / 1e6, wall)


# ---- batches --------------------------------------------------------------------------------------------------------


class RandomBatches:
    """Seeded random token batches (x, y) of the preset's shape, pre-generated on the device and cycled, so the timed
    step never waits on data."""

    def __init__(self, cfg: RunConfig, device: torch.device, n: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        B, T, V = cfg.train.batch_size, cfg.model.max_seq_len, cfg.model.vocab_size
        self.batches = [
            (torch.randint(0, V, (B, T), generator=g).to(device), torch.randint(0, V, (B, T), generator=g).to(device))
            for _ in range(n)
        ]  # each (B, T)
        self.i = 0

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        return b


# ---- subjects and timing --------------------------------------------------------------------------------------------


@dataclass
class Subject:
    """One thing being timed: an architecture's benchctl step, or the reference step."""

    arch: str
    impl: str  # benchctl | reference (at benchctl's precision) | reference-fp32
    cfg: RunConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], Any]
    flops_per_token: float
    compiled: bool = False
    dtype: str = "float32"  # what the step runs in: bfloat16 (autocast) | float32
    warmup_seconds: float = 0.0
    repeat_seconds: list[float] = field(default_factory=list)  # wall time of `steps` steps, per repeat
    step_seconds: list[float] = field(default_factory=list)  # every timed step
    step_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time (all threads) of every step
    peak_growth: int = 0  # peak growth of torch allocations during a step (activations, gradients, temporaries)
    mem_method: str = ""
    kernel_seconds: float | None = None  # CPU: matmul + attention kernel time (best of the profiled steps)
    profiled_step_seconds: float | None = None
    loads: list[float] = field(default_factory=list)


def build_subject(
    cfg: RunConfig, device: torch.device, impl: str, compile_model: bool, control: nn.Module | None = None
) -> Subject:
    """Model, optimizer and batches built exactly as `train` builds them (reference: as llama2.c does; the
    'reference-fp32' subject without autocast, as llama2.c's train.py runs on a CPU)."""
    amp = None if impl == "reference-fp32" else autocast_dtype(cfg, device)
    dtype = "bfloat16" if amp is torch.bfloat16 else "float32"
    batches = RandomBatches(cfg, device, seed=cfg.seed + 1)
    lr = get_lr(cfg.train.warmup_steps, cfg)  # the peak rate: timing does not depend on it, the update does
    if impl.startswith("reference"):
        model = build_reference(cfg, device, weights_from=control)
        optimizer = reference_optimizer(model, cfg, device)
        for g in optimizer.param_groups:
            g["lr"] = lr
        flops = architectures.build_shapes("control", cfg.model).flops_per_token(cfg.model.max_seq_len)
        return Subject(
            cfg.arch,
            impl,
            cfg,
            model,
            optimizer,
            lambda: reference_step(model, optimizer, batches, cfg, device, amp),
            flops,
            dtype=dtype,
        )
    torch.manual_seed(cfg.seed)
    model = architectures.build(cfg.arch, cfg.model).to(device)
    model.train()
    optimizer = make_optimizer(model, cfg, device)
    for g in optimizer.param_groups:
        g["lr"] = lr
    train_model = torch.compile(model) if compile_model else model
    flops = model.flops_per_token(cfg.model.max_seq_len)
    return Subject(
        cfg.arch,
        impl,
        cfg,
        model,
        optimizer,
        lambda: train_step(train_model, model, optimizer, batches, cfg, device, amp),
        flops,
        compiled=compile_model,
        dtype=dtype,
    )


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def warm_up(s: Subject, device: torch.device, n: int) -> None:
    telemetry.sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        s.step()
    telemetry.sync(device)
    s.warmup_seconds = time.perf_counter() - t0


def timed_step(s: Subject, device: torch.device) -> tuple[float, float]:
    """One synchronised step (as `train` times it): (wall seconds, process CPU seconds). On CUDA also its memory peak;
    on the CPU that is measured once, after the repeats (`profile_cpu_step`), since profiling costs time."""
    with PeakMemory(device) as mem:
        c0 = time.process_time()
        t0 = time.perf_counter()
        s.step()
        telemetry.sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s.peak_growth = max(s.peak_growth, mem.growth)
    s.step_seconds.append(wall)
    s.step_cpu_seconds.append(cpu)
    return wall, cpu


def time_repeat(subjects: list[Subject], device: torch.device, steps: int) -> None:
    """One repeat: `steps` steps of every subject, taking turns step by step, so that whatever else the machine is
    doing falls on every subject alike (each subject's repeat time is the sum of its own steps)."""
    walls = [0.0] * len(subjects)
    load = _load()
    for _ in range(steps):
        for i, s in enumerate(subjects):
            walls[i] += timed_step(s, device)[0]
    for s, w in zip(subjects, walls):
        s.repeat_seconds.append(w)
        if load is not None:
            s.loads.append(load)


def run(
    opts: BenchOptions, db_path: Path | None = None, log: Callable[[str], None] = lambda _m: None
) -> list[dict[str, Any]]:
    """Benchmark every architecture of `opts`; write the rows to results.db (when `db_path`) and return them.

    The returned list has one object per architecture (benchctl's step), with the reference's numbers and the
    speed-up folded into the control's object, and each architecture's cost ratio to the control. With
    `opts.decode`, generation is timed instead (`benchctl.stages.bench.decode`) and the rows are returned as written.
    """
    if opts.decode:
        rows = run_decode(opts, log)
        if db_path is not None:
            bench_tables.record_bench_rows(stages.connect(db_path), rows)
        return rows
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    names = opts.archs or architectures.names()
    cfgs = [make_config(opts.preset, a, opts.seed, opts.overrides) for a in names]
    device = resolve_device(cfgs[0].train.device if opts.device == "auto" else opts.device)
    if opts.compile:
        check_compile_available(device, "--compile")
    compile_model = [_compile_choice(cfg, device, opts.compile) for cfg in cfgs]
    if device.type == "cpu":  # what train sets on the CPU
        telemetry.tune_cpu_allocator()
    with matmul_precision(device):  # TF32 on CUDA, as train has it, for this run only
        rows, check = _measure(opts, cfgs, device, compile_model, log)
    if db_path is not None:
        bench_tables.record_bench_rows(stages.connect(db_path), rows)
    return summarize(rows, check)


def _compile_choice(cfg: RunConfig, device: torch.device, flag: bool | None) -> bool:
    """Whether benchctl's step for `cfg` is compiled: --compile/--no-compile when given, else as `train` decides
    (train.compile, auto by default: runtime.resolve_compile)."""
    if flag is not None:
        return flag
    args = architectures.build_shapes(cfg.arch, cfg.model).arch_args
    sampled = getattr(args, "recur_sampling", "fixed") != "fixed"
    return resolve_compile(
        cfg.train.compile, device, autocast_dtype(cfg, device), sampled, curriculum.enabled(cfg), cfg.arch
    ).on


def _subjects(cfgs: list[RunConfig], device: torch.device, compile_model: list[bool], reference: bool) -> list[Subject]:
    """benchctl's step per architecture (compiled where `compile_model` says so); beside the control, the eager
    reference at the same precision and, when that is not fp32, the reference in fp32 too (how llama2.c's users run
    it on a CPU)."""
    subjects: list[Subject] = []
    for cfg, compiled in zip(cfgs, compile_model):
        s = build_subject(cfg, device, "benchctl", compiled)
        subjects.append(s)
        if cfg.arch == "control" and reference:
            subjects.append(build_subject(cfg, device, "reference", False, control=s.model))
            if s.dtype != "float32":
                subjects.append(build_subject(cfg, device, "reference-fp32", False, control=s.model))
    return subjects


def _measure(
    opts: BenchOptions,
    cfgs: list[RunConfig],
    device: torch.device,
    compile_model: list[bool],
    log: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    bench_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    peak, peak_source = _device_peak(device, cfgs[0])
    log(
        f"bench {bench_id}: {telemetry.device_name(device)}, {torch.get_num_threads()} threads; peak "
        f"{_fmt_flops(peak)} ({peak_source}); load average {_load_str()}"
    )

    subjects = _subjects(cfgs, device, compile_model, opts.reference)
    for s in subjects:
        log(f"  warm-up {s.arch} ({s.impl}{', compiling' if s.compiled else ''})")
        warm_up(s, device, max(opts.warmup, 1) if s.compiled else opts.warmup)
    for r in range(opts.repeats):
        time_repeat(subjects, device, opts.steps)
        for s in subjects:
            tps = opts.steps * s.cfg.tokens_per_step / s.repeat_seconds[-1]
            log(f"  repeat {r + 1}/{opts.repeats} {s.arch:<10} {s.impl:<14} {tps:10,.0f} tok/s")
        if device.type == "cpu":  # the machine's own peak, read again between repeats: the best reading counts
            peak = max(peak or 0.0, measure_matmul_peak(device, dtype=_matmul_dtype(cfgs[0], device)))
        log(f"  load average {_load_str()}")

    for s in subjects:
        if device.type == "cuda":
            s.mem_method = "torch.cuda.max_memory_allocated"
        else:
            # two more, untimed and profiled, steps: the larger memory peak, the smaller kernel time (the ceiling is
            # a bound, so it takes the kernels at their best; a shared machine slows single steps at random)
            profs = [profile_cpu_step(s.step) for _ in range(PROFILED_STEPS)]
            growths = [p.peak_growth for p in profs if p.peak_growth is not None]
            s.peak_growth = max(growths, default=0)
            s.mem_method = (
                "torch CPU allocations (profiler memory events)"
                if growths
                else "unavailable (this PyTorch's profiler has no memory events)"
            )
            best = min(profs, key=lambda p: p.kernel_seconds)
            s.kernel_seconds, s.profiled_step_seconds = best.kernel_seconds, best.step_seconds
    rows = [_row(s, bench_id, opts, device, peak, peak_source) for s in subjects]
    check = None
    if opts.check_steps > 0:
        check = check_equivalence(
            make_config(opts.preset, "control", opts.seed, opts.overrides), device, opts.check_steps
        )
        log(f"  equivalence over {opts.check_steps} steps: max |loss difference| {check['max_abs_diff']:.2e}")
        for row in rows:
            if row["arch"] == "control" and row["impl"] == "benchctl":
                row["equivalence_json"] = json.dumps(check)
    return rows, check


def _matmul_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """The dtype benchctl's matmuls run in: the peak that MFU is measured against must be at that precision."""
    return autocast_dtype(cfg, device) or torch.float32


def _device_peak(device: torch.device, cfg: RunConfig) -> tuple[float | None, str]:
    prec = precision(cfg, device)
    if device.type == "cuda":
        if prec.amp is None:
            return None, "fp32 on CUDA: the peak table lists bf16/fp16 tensor-core peaks only, MFU left empty"
        return gpu_peak(torch.cuda.get_device_name(device), prec.dtype)
    if device.type == "cpu":
        short = {"bfloat16": "bf16", "float32": "fp32"}[prec.dtype]
        return (
            measure_matmul_peak(device, dtype=_matmul_dtype(cfg, device)),
            f"of measured matmul peak ({short} 2048x2048 matmul, best reading before and between the repeats of "
            "this run)",
        )
    return None, f"no peak known for device type '{device.type}': MFU left empty"


def _row(
    s: Subject, bench_id: str, opts: BenchOptions, device: torch.device, peak: float | None, peak_source: str
) -> dict[str, Any]:
    tps = [opts.steps * s.cfg.tokens_per_step / t for t in s.repeat_seconds]
    med = statistics.median(tps)
    achieved = med * s.flops_per_token
    env = telemetry.environment(device)
    notes = [
        f"threads={torch.get_num_threads()}",
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        telemetry.tune_cpu_allocator() or "malloc: defaults",
        f"memory: parameters + optimizer state + peak growth during a step ({s.mem_method})",
    ]
    if s.impl.startswith("reference"):
        notes.append(
            "llama2.c model.py/train.py step (eager), from the control's weights"
            + (", in fp32" if s.impl == "reference-fp32" else ", at benchctl's precision")
        )
    return {
        "bench_id": bench_id,
        "arch": s.arch,
        "preset": opts.preset,
        "mode": "train",
        "impl": s.impl,
        "compiled": int(s.compiled),
        "dtype": s.dtype,
        "device": device.type,
        "device_name": env["device_name"],
        "steps": opts.steps,
        "repeats": opts.repeats,
        "warmup_steps": opts.warmup,
        "warmup_seconds": s.warmup_seconds,
        "tokens_per_step": s.cfg.tokens_per_step,
        "tokens_per_s": med,
        "tokens_per_s_min": min(tps),
        "tokens_per_s_max": max(tps),
        "step_seconds": statistics.median(s.step_seconds),
        "step_cpu_seconds": statistics.median(s.step_cpu_seconds),
        "flops_per_token": s.flops_per_token,
        "achieved_flops": achieved,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "mfu": achieved / peak if peak else None,
        "peak_mem_bytes": s.peak_growth + state_bytes(s.model, s.optimizer),
        "peak_rss_bytes": telemetry.peak_rss_bytes(),  # the whole process so far (every subject shares it)
        "load_avg": statistics.mean(s.loads) if s.loads else None,
        "kernel_seconds": s.kernel_seconds,
        "profiled_step_seconds": s.profiled_step_seconds,
        "threads": torch.get_num_threads(),
        "note": "; ".join(notes),
        "config_json": s.cfg.to_json(),
        "torch_version": env["torch_version"],
        "git_commit": env["git_commit"],
        "created_at": dbm.now(),
    }


def summarize(rows: list[dict[str, Any]], check: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One object per architecture: benchctl's numbers, the reference's beside the control's, and cost ratios.

    cost_ratio = (time per token / control's) / (FLOPs per token / control's): 1.0 means the architecture costs
    exactly its arithmetic relative to the control; the study's target is <= 1.15.
    """
    ours = [r for r in rows if r["impl"] == "benchctl"]
    ref = next((r for r in rows if r["impl"] == "reference"), None)
    # the reference as llama2.c runs it on a CPU (fp32): the same row as `ref` when benchctl itself runs in fp32
    ref32 = next((r for r in rows if r["impl"] == "reference-fp32"), ref)
    ctrl = next((r for r in ours if r["arch"] == "control"), None)
    out = []
    for r in ours:
        o = {
            k: r[k]
            for k in (
                "bench_id",
                "arch",
                "preset",
                "compiled",
                "dtype",
                "device",
                "device_name",
                "tokens_per_s",
                "tokens_per_s_min",
                "tokens_per_s_max",
                "step_seconds",
                "flops_per_token",
                "achieved_flops",
                "peak_flops",
                "peak_flops_source",
                "mfu",
                "peak_mem_bytes",
                "load_avg",
                "threads",
                "warmup_seconds",
                "step_cpu_seconds",
            )
        }
        if ctrl is not None:
            flops_ratio = r["flops_per_token"] / ctrl["flops_per_token"]
            o["cost_ratio"] = (ctrl["tokens_per_s"] / r["tokens_per_s"]) / flops_ratio
            # tokens per step are the preset's for every architecture, so CPU seconds per step compare directly
            o["cost_ratio_cpu"] = (r["step_cpu_seconds"] / ctrl["step_cpu_seconds"]) / flops_ratio
        if r["arch"] == "control" and ref is not None:
            o["reference_tokens_per_s"] = ref["tokens_per_s"]
            o["reference_tokens_per_s_min"] = ref["tokens_per_s_min"]
            o["reference_tokens_per_s_max"] = ref["tokens_per_s_max"]
            o["reference_step_seconds"] = ref["step_seconds"]
            o["reference_peak_mem_bytes"] = ref["peak_mem_bytes"]
            o["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
            # the same ratio in CPU time: what each step costs the machine, insensitive to descheduling
            o["reference_step_cpu_seconds"] = ref["step_cpu_seconds"]
            o["speedup_cpu"] = ref["step_cpu_seconds"] / r["step_cpu_seconds"]
            o["reference_dtype"] = ref["dtype"]
            # against the reference in fp32: the speed a user of llama2.c's train.py on this CPU would compare with
            o["reference_fp32_tokens_per_s"] = ref32["tokens_per_s"]
            o["reference_fp32_tokens_per_s_min"] = ref32["tokens_per_s_min"]
            o["reference_fp32_tokens_per_s_max"] = ref32["tokens_per_s_max"]
            o["reference_fp32_step_seconds"] = ref32["step_seconds"]
            o["reference_fp32_peak_mem_bytes"] = ref32["peak_mem_bytes"]
            o["speedup_fp32"] = r["tokens_per_s"] / ref32["tokens_per_s"]
            if r.get("kernel_seconds"):
                # the reference's step over the time the control's step spends in matmul/attention kernels alone:
                # what this implementation would reach if everything else in its step took no time at all
                o["kernel_seconds"] = r["kernel_seconds"]
                o["speedup_ceiling"] = ref["step_seconds"] / r["kernel_seconds"]
                o["speedup_ceiling_fp32"] = ref32["step_seconds"] / r["kernel_seconds"]
            if check is not None:
                o["equivalence"] = check
        out.append(o)
    return out


# ---- equivalence ----------------------------------------------------------------------------------------------------


def check_equivalence(cfg: RunConfig, device: torch.device, steps: int) -> dict[str, Any]:
    """Train benchctl's control (train_step) and the reference from the same weights on the same seeded batches
    for `steps` optimizer steps with `train`'s lr schedule; return both loss curves and their largest difference."""
    amp = autocast_dtype(cfg, device)
    torch.manual_seed(cfg.seed)
    model = architectures.build("control", cfg.model).to(device).train()
    ref = build_reference(cfg, device, weights_from=model).train()
    opt = make_optimizer(model, cfg, device)
    ref_opt = reference_optimizer(ref, cfg, device)
    ours_b = RandomBatches(cfg, device, n=16, seed=cfg.seed + 7)
    ref_b = RandomBatches(cfg, device, n=16, seed=cfg.seed + 7)  # the same batches, in the same order
    losses, ref_losses = [], []
    for step in range(steps):
        lr = get_lr(step, cfg)
        for g in opt.param_groups + ref_opt.param_groups:
            g["lr"] = lr
        loss, _ = train_step(model, model, opt, ours_b, cfg, device, amp)
        losses.append(float(loss))
        ref_losses.append(float(reference_step(ref, ref_opt, ref_b, cfg, device, amp)))
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    return {
        "steps": steps,
        "loss": losses[-1],
        "reference_loss": ref_losses[-1],
        "max_abs_diff": max(diffs),
        "losses": losses,
        "reference_losses": ref_losses,
    }


# ---- formatting -----------------------------------------------------------------------------------------------------


def _load_str() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _fmt_flops(x: float | None) -> str:
    if x is None:
        return "unknown"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x / 1e6:.1f} MFLOP/s"


def to_json(objs: list[dict[str, Any]]) -> str:
    return json.dumps(objs, indent=2)
