"""The training engine: one fixed recipe for every architecture, resumable, with telemetry, written to results.db.

Follows karpathy/llama2.c `train.py`: AdamW with weight decay on every >=2-D tensor and none on norms, linear
warm-up then cosine decay to `min_lr` at the last step (llama2.c's `get_lr`, lr_decay_iters = max_steps), gradient
accumulation, clipping, bf16 autocast and fused AdamW on CUDA, fp32 on CPU, optional torch.compile, DDP under
torchrun (the global batch is split across ranks so the recipe is unchanged; only rank 0 writes).

Validation loss is measured at step 0 (the study's "initial loss"), every `eval_interval` steps and at the last step,
on a fixed, seeded set of validation windows (the same for every model). Evaluation runs under a forked RNG, so it
never perturbs the training stream: a run's trajectory does not depend on how often it is evaluated.

A checkpoint holds weights, optimizer, step, all RNG states, the sampler state and cumulative telemetry; rerunning
the same command after a crash or `kill -9` resumes from it and ends with the same weights as an uninterrupted run
(bit for bit on CPU). Metric rows are keyed by (run, step, name): a resumed run first deletes rows past its
checkpoint, then rewrites them, so there are no duplicates and no gaps.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import sqlite_utils
import torch
import torch.nn as nn

import architectures
from benchctl import checkpoint as ckpt
from benchctl import db as dbm
from benchctl import telemetry
from benchctl.config import RunConfig, run_id
from benchctl.errors import BenchctlError, CheckpointError, ConfigError
from benchctl.runtime import (  # noqa: F401  (re-exported: older imports of these names from train keep working)
    Dist,
    autocast_dtype,
    barrier,
    check_compile_available,
    init_distributed,
    resolve_device,
)

# Steps excluded from the timed training window (compile, allocator and cache warm-up).
TIMING_WARMUP_STEPS = 2


def get_lr(step: int, cfg: RunConfig) -> float:
    """llama2.c's schedule: linear warm-up from 0, cosine from lr to min_lr over the remaining steps."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if step >= t.max_steps:
        return t.min_lr
    decay_ratio = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return t.min_lr + coeff * (t.lr - t.min_lr)


def make_optimizer(model: nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, two groups: weight decay on every >=2-D tensor (matrices, embeddings, LoRA, depth encodings), none on
    norms and biases (llama2.c `configure_optimizers`). Fused kernel on CUDA and CPU: one kernel per tensor instead
    of a dozen (on CPU the foreach path is a Python-level loop of per-op kernels, slower even than the plain loop;
    measured with `benchctl bench`); elsewhere PyTorch's default."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra: dict[str, Any] = {"fused": True} if device.type in ("cuda", "cpu") else {}
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), **extra)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
    amp: torch.dtype | None,
    seed: int,
    dist_info: Dist = Dist(),
    n_recur: int | None = None,
) -> float:
    """Mean next-token cross-entropy over fixed windows (N, T+1). RNG forked and seeded, so three-part's random
    initial state is the same at every evaluation and training's RNG stream is untouched."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, token count)
    mine = windows[dist_info.rank :: dist_info.world_size]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for i in range(0, len(mine), batch_size):
            w = mine[i : i + batch_size].to(device, non_blocking=True)
            x, y = w[:, :-1], w[:, 1:]
            with torch.autocast(device.type, dtype=amp) if amp else nullcontext():
                _, loss = model(x, y, n_recur=n_recur, return_logits=False)
            total[0] += loss.double() * y.numel()
            total[1] += y.numel()
    if dist_info.enabled:
        import torch.distributed as dist

        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def train_step(
    train_model: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    cfg: RunConfig,
    device: torch.device,
    amp: torch.dtype | None,
    *,
    ddp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step: grad_accum micro-batches, clipping, AdamW. The exact step `train` runs and `bench` times.

    `train_model` is what runs forward (the model, or its compiled/DDP wrapper); `model` owns the parameters.
    Returns (summed micro-batch loss = the step's mean loss, gradient norm before clipping or None).
    """
    t = cfg.train
    loss_sum = torch.zeros((), device=device)
    for micro in range(t.grad_accum):
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP: all-reduce gradients only on the last micro-batch
        sync_ctx = train_model.no_sync() if ddp and micro < t.grad_accum - 1 else nullcontext()
        with sync_ctx, (torch.autocast(device.type, dtype=amp) if amp else nullcontext()):
            # the loss only: the logits (B, T, V) are never materialised (architectures.blocks.linear_cross_entropy)
            loss = train_model(x, y, return_logits=False)[1] / t.grad_accum
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip) if t.grad_clip > 0 else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@dataclass
class RunResult:
    run_id: str
    status: str
    resumed_from: int | None = None
    skipped: bool = False
    row: dict[str, Any] = field(default_factory=dict)


class _Progress:
    """A rich progress bar (step, loss, tokens/s, ETA) on a terminal; periodic plain lines elsewhere."""

    def __init__(self, enabled: bool, label: str, total: int, start: int):
        self.enabled = enabled
        self._bar = None
        self._last_print = 0.0
        self.label, self.total = label, total
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from benchctl.cli import console

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = self._bar.add_task(label, total=total, completed=start, loss="-", tps="-")
        self._bar.start()
        self._console = console

    def update(self, step: int, loss: float | None, tps: float | None) -> None:
        if self._bar is None:
            return
        fields = {}
        if loss is not None:
            fields["loss"] = f"{loss:.3f}"
        if tps is not None:
            fields["tps"] = f"{tps:,.0f}"
        self._bar.update(self._task, completed=step, **fields)

    def log(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.console.print(msg, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _is_alive(pid: int | None) -> bool:
    if not pid or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def train_run(
    cfg: RunConfig,
    prepared: Any,
    db: sqlite_utils.Database | None,
    db_path: Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    stop_after: int | None = None,
) -> RunResult:
    """Train one run to completion (or resume it), writing rows to `db` (rank 0 only; `db` is None elsewhere).

    `stop_after` ends the process's work after that optimizer step (a checkpoint is written), as if killed: used by
    tests of resumption and by `--max-wall` style limits.
    """
    dist_info = Dist.from_env()
    rid = run_id(cfg, prepared.fingerprint)
    rdir = ckpt.run_dir(db_path, rid)
    ckpt_path = rdir / ckpt.CKPT_NAME

    # ---- the run row: skip finished work, refuse a run another live process is training -------------------------
    existing = dbm.get_run(db, rid) if db is not None else None
    if existing is not None and existing["status"] == "done" and ckpt_path.exists():
        return RunResult(rid, "done", skipped=True, row=existing)
    if existing is not None and existing["status"] == "running" and existing.get("hostname") == _hostname():
        pid = existing.get("pid")
        if _is_alive(pid) and not dist_info.enabled:
            raise BenchctlError(f"run {rid} is being trained by another process (pid {pid}); wait for it or kill it")

    device = resolve_device(cfg.train.device, dist_info.local_rank if dist_info.enabled else None)
    if cfg.train.compile:
        check_compile_available(device, "train.compile=true")
    if device.type == "cpu":
        telemetry.tune_cpu_allocator()
    init_distributed(dist_info, device)
    if cfg.train.batch_size % dist_info.world_size:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be divisible by the number of processes "
            f"({dist_info.world_size}) so the global batch is unchanged"
        )
    amp = autocast_dtype(cfg, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # ---- model, optimizer, data --------------------------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    import random

    random.seed(cfg.seed)
    model = architectures.build(cfg.arch, cfg.model).to(device)
    report = model.param_report()
    flops = model.flops_per_token(cfg.model.max_seq_len)
    optimizer = make_optimizer(model, cfg, device)

    from benchctl.data import WindowSampler, val_windows

    sampler = WindowSampler(
        prepared.train_tokens(),
        cfg.model.max_seq_len,
        cfg.train.batch_size,
        seed=cfg.seed,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
    )
    windows = val_windows(prepared.valid_tokens(), cfg.model.max_seq_len, cfg.eval.val_windows, cfg.eval.val_seed)

    # ---- resume --------------------------------------------------------------------------------------------------
    start_step = 0
    carried: dict[str, Any] = {"train_seconds": 0.0, "warmup_seconds": 0.0, "eval_seconds": 0.0, "step_times": [],
                               "peak_rss": 0, "peak_alloc": None, "peak_reserved": None, "peak_nvml": None,
                               "initial_val_loss": None}
    resumed_from = None
    if ckpt_path.exists():
        state = ckpt.load(ckpt_path, map_location="cpu")
        ckpt.check_config(state, cfg, ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        start_step = int(state["step"])
        carried.update(state["telemetry"])
        resumed_from = start_step
        del state
    elif existing is not None and existing["status"] == "done":
        log(f"run {rid} is marked done but its checkpoint is missing; training it again")

    nvml = telemetry.NvmlSampler(device.index or 0)
    env = telemetry.environment(device, nvml.driver_version)  # recorded from the start, so failed runs have it too
    if dist_info.is_main and db is not None:
        now = dbm.now()
        row = {**env,
            "id": rid, "arch": cfg.arch, "preset": cfg.preset, "seed": cfg.seed, "status": "running",
            "config_json": cfg.to_json(), "data_fingerprint": prepared.fingerprint, "data_source": prepared.source,
            "n_params": report["total"], "effective_params": report["effective"], "flops_per_token": flops,
            "max_steps": cfg.train.max_steps, "world_size": dist_info.world_size, "error": None,
            "started_at": now, "updated_at": now, "pid": os.getpid(), "hostname": _hostname(),
        }
        with db.conn:
            if existing is None:
                db["runs"].insert({**row, "created_at": now, "step": 0, "tokens_seen": 0}, alter=True)
            else:
                db["runs"].update(rid, row, alter=True)
            # rows past the checkpoint belong to a future this run will recompute
            db.execute("delete from metrics where run_id = ? and step > ?", [rid, start_step])
            if start_step == 0:
                db.execute("delete from metrics where run_id = ?", [rid])
                db.execute("delete from checkpoints where run_id = ?", [rid])
        rdir.mkdir(parents=True, exist_ok=True)
        tok_dst = rdir / ckpt.TOKENIZER_NAME
        if not tok_dst.exists():
            shutil.copyfile(prepared.tokenizer_path, tok_dst)

    if resumed_from is not None:
        log(f"resuming {rid} from step {resumed_from}/{cfg.train.max_steps} ({ckpt_path})")

    train_model: nn.Module = model
    warmup_compile = 0.0
    if cfg.train.compile:
        train_model = torch.compile(model)
    if dist_info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" else None)

    if device.type == "cuda":
        nvml.start()
    telemetry.reset_peak_memory(device)

    bar = _Progress(progress and dist_info.is_main, f"{cfg.arch} s{cfg.seed}", cfg.train.max_steps, start_step)
    metrics_buf: list[dict[str, Any]] = []
    tokens_per_step = cfg.tokens_per_step
    t = cfg.train
    step = start_step
    sw = telemetry.Stopwatch(device)
    eval_sw = telemetry.Stopwatch(device)
    step_times: list[float] = list(carried["step_times"])

    def flush_metrics() -> None:
        if dist_info.is_main and db is not None and metrics_buf:
            with db.conn:
                db["metrics"].upsert_all(metrics_buf, pk=("run_id", "step", "name"))
            metrics_buf.clear()

    def add_metric(name: str, value: float, at_step: int) -> None:
        metrics_buf.append({"run_id": rid, "step": at_step, "name": name, "value": float(value),
                            "tokens": at_step * tokens_per_step, "wall_seconds": carried["train_seconds"] + sw.total})

    def run_eval(at_step: int) -> float:
        with eval_sw:
            v = evaluate(model, windows, cfg.eval.val_batch_size, device, amp, cfg.eval.val_seed, dist_info)
        add_metric("val_loss", v, at_step)
        return v

    def save_checkpoint(at_step: int, final_loss: float | None = None) -> None:
        peaks = telemetry.torch_peaks(device)
        tel = {
            "train_seconds": carried["train_seconds"] + sw.total,
            "warmup_seconds": carried["warmup_seconds"] + warmup_compile,
            "eval_seconds": carried["eval_seconds"] + eval_sw.total,
            "step_times": step_times[-2000:],
            "peak_rss": max(carried["peak_rss"], telemetry.peak_rss_bytes()),
            "peak_alloc": _max(carried["peak_alloc"], peaks[0]),
            "peak_reserved": _max(carried["peak_reserved"], peaks[1]),
            "peak_nvml": _max(carried["peak_nvml"], nvml.peak_used),
            "initial_val_loss": carried["initial_val_loss"],
        }
        if dist_info.is_main:
            size = ckpt.save(ckpt_path, {
                "config": cfg.to_json(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": at_step, "rng": ckpt.rng_state(), "sampler": sampler.state_dict(), "telemetry": tel,
                "data_fingerprint": prepared.fingerprint, "run_id": rid,
            })
            flush_metrics()
            if db is not None:
                with db.conn:
                    db["checkpoints"].delete_where("run_id = ? and path = ?", [rid, str(ckpt_path)])
                    db["checkpoints"].insert({"run_id": rid, "step": at_step, "path": str(ckpt_path), "bytes": size,
                                              "created_at": dbm.now()}, replace=True)
                    db["runs"].update(rid, {"step": at_step, "tokens_seen": at_step * tokens_per_step,
                                            "updated_at": dbm.now(), **_telemetry_columns(tel, tokens_per_step)})
        barrier(dist_info)

    try:
        if start_step == 0:
            v0 = run_eval(0)
            carried["initial_val_loss"] = v0
            if dist_info.is_main and db is not None:
                flush_metrics()
                dbm.update_run(db, rid, initial_val_loss=v0)
            bar.update(0, v0, None)
        last_val = None
        while step < t.max_steps:
            lr = get_lr(step, cfg)
            for g in optimizer.param_groups:
                g["lr"] = lr
            timed = step - start_step >= TIMING_WARMUP_STEPS
            t0 = time.perf_counter()
            with sw if timed else nullcontext():
                loss_sum, grad_norm = train_step(train_model, model, optimizer, sampler.next_batch, cfg, device, amp,
                                                 ddp=dist_info.enabled)
            if not timed:
                telemetry.sync(device)
                warmup_compile += time.perf_counter() - t0
            else:
                step_times.append(sw.last)
            step += 1
            if not math.isfinite(float(loss_sum)):
                raise BenchctlError(
                    f"{cfg.arch} seed {cfg.seed}: training loss became {float(loss_sum)} at step {step}; "
                    "lower train.lr or check the data"
                )
            if step % t.log_interval == 0 or step == t.max_steps:
                train_loss = float(loss_sum)
                if dist_info.enabled:
                    import torch.distributed as dist

                    ls = loss_sum.clone()
                    dist.all_reduce(ls)
                    train_loss = float(ls) / dist_info.world_size
                add_metric("train_loss", train_loss, step)
                add_metric("lr", lr, step)
                if grad_norm is not None:
                    add_metric("grad_norm", float(grad_norm), step)
                tps = tokens_per_step / statistics.median(step_times[-20:]) if step_times else None
                bar.update(step, train_loss, tps)
                flush_metrics()
            if step % t.eval_interval == 0 or step == t.max_steps:
                last_val = run_eval(step)
                bar.log(f"  {cfg.arch} s{cfg.seed} step {step}: val loss {last_val:.4f}")
                flush_metrics()
            if step % t.ckpt_interval == 0 or step == t.max_steps:
                save_checkpoint(step)
            if stop_after is not None and step >= stop_after and step < t.max_steps:
                if step % t.ckpt_interval:
                    save_checkpoint(step)
                bar.close()
                nvml.stop()
                return RunResult(rid, "running", resumed_from=resumed_from)
        bar.close()
        nvml.stop()
        final = last_val
        if final is None:  # resumed exactly at the end: the final eval is in the metrics table
            final = evaluate(model, windows, cfg.eval.val_batch_size, device, amp, cfg.eval.val_seed, dist_info)
        row: dict[str, Any] = {}
        if dist_info.is_main and db is not None:
            with db.conn:
                db["runs"].update(rid, {
                    "status": "done", "final_val_loss": final, "finished_at": dbm.now(), "updated_at": dbm.now(),
                    "initial_val_loss": carried["initial_val_loss"], "pid": None,
                }, alter=True)
            row = dbm.get_run(db, rid) or {}
        return RunResult(rid, "done", resumed_from=resumed_from, row=row)
    except BaseException as e:
        bar.close()
        nvml.stop()
        if dist_info.is_main and db is not None:
            msg = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            dbm.update_run(db, rid, status="failed", error=msg[:2000], pid=None)
        raise
    finally:
        if dist_info.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _max(a: int | None, b: int | None) -> int | None:
    vals = [v for v in (a, b) if v is not None]
    return max(vals) if vals else None


def _telemetry_columns(tel: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    times = tel["step_times"]
    step_s = statistics.median(times) if times else None
    train_s = tel["train_seconds"]
    return {
        "train_seconds": train_s,
        "warmup_seconds": tel["warmup_seconds"],
        "eval_seconds": tel["eval_seconds"],
        "step_seconds": step_s,
        # tokens/s over the timed steps (warm-up steps excluded from both numerator and denominator)
        "tokens_per_s": (len(times) * tokens_per_step / sum(times)) if times else None,
        "peak_rss_bytes": tel["peak_rss"],
        "peak_gpu_mem_bytes": tel["peak_alloc"],
        "peak_gpu_reserved_bytes": tel["peak_reserved"],
        "peak_nvml_mem_bytes": tel["peak_nvml"],
    }


def estimate_seconds(cfgs: list[RunConfig], prepared: Any) -> float:
    """Rough wall time for training `cfgs` on this device: time one micro-batch of the first config's control
    equivalent, scale by steps, accumulation and each architecture's FLOPs/token. RNG state is preserved."""
    if not cfgs:
        return 0.0
    base = cfgs[0]
    device = resolve_device(base.train.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = architectures.build("control", base.model).to(device)
        amp = autocast_dtype(base, device)
        x = torch.randint(0, base.model.vocab_size, (base.train.batch_size, base.model.max_seq_len), device=device)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=amp) if amp else nullcontext():
                _, loss = model(x, x, return_logits=False)
            loss.backward()
            telemetry.sync(device)
            times.append(time.perf_counter() - t0)
        per_flop = min(times) / (model.flops_per_token() * x.numel())
    total = 0.0
    for c in cfgs:
        with torch.device("meta"):
            m = architectures.build(c.arch, c.model)
        total += per_flop * m.flops_per_token() * c.tokens_per_step * c.train.max_steps
    return total
