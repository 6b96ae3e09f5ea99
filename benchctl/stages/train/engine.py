"""The training engine: one fixed recipe for every architecture, resumable, with telemetry, written to results.db.

Follows karpathy/llama2.c `train.py`: AdamW with weight decay on every >=2-D tensor and none on norms, linear
warm-up then cosine decay to `min_lr` at the last step (llama2.c's `get_lr`, lr_decay_iters = max_steps), gradient
accumulation, clipping, fused AdamW, bf16 autocast wherever the hardware computes bf16 natively (else fp32; see
`runtime.resolve_precision`), optional torch.compile, DDP under torchrun (the global batch is split across ranks so
the recipe is unchanged; rank 0 alone decides skip/resume and writes).

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
import random
import shutil
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import architectures
from architectures.kernels import IGNORE_INDEX
from benchctl.core import accounting, liveness, taskdata, telemetry
from benchctl.core import checkpoint as ckpt
from benchctl.core import db as dbm
from benchctl.core.config import RunConfig, run_id
from benchctl.core.data import WindowSampler, val_windows
from benchctl.core.errors import BenchctlError, ConfigError
from benchctl.core.progress import Progress
from benchctl.core.runtime import (  # noqa: F401  (re-exported: older imports of these names from train keep working)
    Dist,
    autocast,
    autocast_dtype,
    barrier,
    check_compile_available,
    decide_on_main,
    init_distributed,
    matmul_precision,
    precision,
    resolve_compile,
    resolve_device,
)
from benchctl.stages.train import curriculum, tblog
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.optim import make_optimizer  # noqa: F401  (re-exported: bench and older imports find it here)

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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
    amp: torch.dtype | None,
    seed: int,
    dist_info: Dist | None = None,
    n_recur: int | None = None,
    extras: dict[str, float] | None = None,
) -> float:
    """Mean next-token cross-entropy over fixed windows (N, T+1). RNG forked and seeded, so three-part's random
    initial state is the same at every evaluation and training's RNG stream is untouched.

    The returned loss is the plain cross-entropy, whatever the architecture adds to its training loss. Given
    `extras`, the auxiliary terms and metrics an architecture reports (`BaseLM.take_stats`) are filled in as
    `val_aux/<name>` and `val_arch/<name>`: their means over the windows, weighted by tokens."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, token count)
    dist_info = dist_info or Dist()  # a single process unless a process group is given
    mine = windows[dist_info.rank :: dist_info.world_size]
    reports = bool(getattr(model, "reports_stats", False))
    sums: dict[str, float] = {}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for i in range(0, len(mine), batch_size):
            w = mine[i : i + batch_size].to(device, non_blocking=True)
            x, y = split_xy(w)
            with torch.autocast(device.type, dtype=amp) if amp else nullcontext():
                _, loss = model(x, y, n_recur=n_recur, return_logits=False)
            counted = int((y != IGNORE_INDEX).sum())  # the loss is a mean over the targets not ignored
            total[0] += loss.double() * counted
            total[1] += counted
            if reports:
                for k, v in model.take_stats().scalars().items():
                    sums[k] = sums.get(k, 0.0) + v * counted
    if dist_info.enabled:
        dist.all_reduce(total)
    model.train(was_training)
    if extras is not None and sums:
        names = sorted(sums)  # every forward reports the same names (BaseLM.add_metric), so ranks agree on them
        vec = torch.tensor([sums[k] for k in names], dtype=torch.float64, device=device)
        if dist_info.enabled:
            dist.all_reduce(vec)
        extras.update({"val_" + k: float(v) / float(total[1]) for k, v in zip(names, vec.tolist())})
    return float(total[0] / total[1])


def split_xy(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of validation rows: windows of a corpus (N, T+1) shift by one; a procedural task's
    encoded problems (N, 2, T) carry their (masked) targets beside their inputs."""
    if w.dim() == 3:
        return w[:, 0], w[:, 1]
    return w[:, :-1], w[:, 1:]


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
    n_recur: int | None = None,
    stats: StepStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step: grad_accum micro-batches, clipping, AdamW. The exact step `train` runs and `bench` times.

    `train_model` is what runs forward (the model, or its compiled/DDP wrapper); `model` owns the parameters.
    `n_recur` runs the forward at that recurrence (the depth curriculum), None at the model's own.
    An architecture's auxiliary losses (`BaseLM.add_aux_loss`) are added to the loss it optimises; `stats`, when
    given, receives what its forwards reported (the terms, its metrics, the FLOPs they really spent).
    Returns (summed micro-batch cross-entropy = the step's mean next-token loss, gradient norm before clipping or
    None).
    """
    t = cfg.train
    loss_sum = torch.zeros((), device=device)
    reports = bool(getattr(model, "reports_stats", False))
    for micro in range(t.grad_accum):
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # DDP: all-reduce gradients only on the last micro-batch
        sync_ctx = train_model.no_sync() if ddp and micro < t.grad_accum - 1 else nullcontext()
        with sync_ctx, torch.autocast(device.type, dtype=amp) if amp else nullcontext():
            # the loss only: the logits (B, T, V) are never materialised (architectures.blocks.linear_cross_entropy)
            depth = {} if n_recur is None else {"n_recur": n_recur}
            loss = train_model(x, y, return_logits=False, **depth)[1] / t.grad_accum
            objective = loss
            if reports:
                fwd = model.take_stats()
                aux = fwd.aux_total()
                if aux is not None:
                    objective = loss + aux / t.grad_accum
                if stats is not None:
                    stats.add(fwd, model.spent_flops_per_token(fwd, x.shape[1], n_recur) * x.numel())
        objective.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip) if t.grad_clip > 0 else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@dataclass
class StepStats:
    """What one optimizer step's forwards reported beyond the loss (an architecture with `reports_stats`): the sums
    of their scalars over the micro-batches and the FLOPs they really spent (forward + backward, this process's
    tokens)."""

    sums: dict[str, float] = field(default_factory=dict)
    micro: int = 0
    flops: float = 0.0

    def add(self, fwd: Any, flops: float) -> None:
        for k, v in fwd.scalars().items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.micro += 1
        self.flops += flops

    def means(self) -> dict[str, float]:
        """Each scalar's mean over the step's micro-batches."""
        return {k: v / self.micro for k, v in self.sums.items()}


@dataclass
class RunResult:
    run_id: str
    status: str
    resumed_from: int | None = None
    skipped: bool = False
    row: dict[str, Any] = field(default_factory=dict)


def _is_alive(pid: int | None, started: float | None = None) -> bool:
    """Whether another process of this machine, the one that started at `started` when known, holds a run."""
    return bool(pid) and pid != os.getpid() and liveness.alive(pid, started)


RESTART_HINT = "delete it to restart the run from scratch"


class RunBusy(BenchctlError):
    """Another live process on this machine is training the run."""

    def __init__(self, run_id: str, pid: int):
        super().__init__(f"run {run_id} is being trained by another process (pid {pid}); wait for it or kill it")
        self.run_id, self.pid = run_id, pid


def _still_training(db: dbm.Database, rid: str, pid: int) -> bool:
    row = train_tables.get_run(db, rid)
    return (
        row is not None
        and row["status"] == "running"
        and row.get("pid") == pid
        and _is_alive(pid, row.get("pid_started"))
    )


def train_run_when_free(
    cfg: RunConfig, prepared: Any, db: dbm.Database | None, db_path: Path, *, poll_s: float = 2.0, **kw: Any
) -> RunResult:
    """`train_run`, waiting for a run another process on this machine is training, then taking it up again (skipped
    when it ended done, resumed when it did not): how a sweep shares its runs with another sweep over the same
    database, so that both end with every run done and neither reports the other's runs as failures."""
    log = kw.get("log", print)
    while True:
        try:
            return train_run(cfg, prepared, db, db_path, **kw)
        except RunBusy as e:
            if db is None:
                raise
            log(f"  {e.run_id} is being trained by another process (pid {e.pid}); waiting for it to finish")
            while _still_training(db, e.run_id, e.pid):
                time.sleep(poll_s)


def _verdict(
    db: dbm.Database | None, cfg: RunConfig, rid: str, ckpt_path: Path, dist_info: Dist, weights_needed: bool = True
) -> tuple[str, dict[str, Any] | None]:
    """('skip' | 'resume' | 'train', the run's row): skip a finished run (one whose checkpoint is gone too, when
    nothing needs its weights), resume one with a checkpoint."""
    existing = train_tables.get_run(db, rid) if db is not None else None
    if db is not None and existing is None and ckpt_path.exists():
        # every run's row is written before its first checkpoint: a checkpoint of a run this database never
        # started was written for another database (a copied or shared runs dir), and resuming it would record
        # someone else's run here, or mark it done with none of its rows
        ckpt.check_config(
            ckpt.load(ckpt_path, unreadable_hint=RESTART_HINT), cfg, ckpt_path
        )  # a planted file of another config says so first
        raise ckpt.CheckpointError(
            f"{ckpt_path} is a checkpoint this results database never recorded (it belongs to another database "
            "sharing or copied into this runs dir); give this database its own directory (or --runs-dir), "
            "or delete that run directory to retrain"
        )
    if existing is not None and existing["status"] == "done" and (ckpt_path.exists() or not weights_needed):
        return "skip", existing
    if existing is not None and existing["status"] == "running" and existing.get("hostname") == _hostname():
        pid = existing.get("pid")
        if _is_alive(pid, existing.get("pid_started")) and not dist_info.enabled:
            raise RunBusy(rid, pid)
    return ("resume" if ckpt_path.exists() else "train"), existing


def train_run(
    cfg: RunConfig,
    prepared: Any,
    db: dbm.Database | None,
    db_path: Path,
    *,
    progress: Progress | bool = True,
    log: Callable[[str], None] = print,
    stop_after: int | None = None,
    init_state: dict[str, torch.Tensor] | None = None,
    run_values: dict[str, Any] | None = None,
    variant: str | None = None,
    runs_dir: Path | None = None,
    weights_needed: bool = True,
) -> RunResult:
    """Train one run to completion (or resume it), writing rows to `db` (rank 0 only; `db` is None elsewhere).

    `variant` names the run in tables (a plan's variant name; the architecture's name when None). A run keeps the
    first name it was trained under.

    `progress` reports the steps (a `Progress`; a bool builds a default one, drawing only on rank 0).
    `stop_after` ends the process's work after that optimizer step (a checkpoint is written), as if killed: used by
    tests of resumption and by `--max-wall` style limits.
    `init_state` is the model's starting state dict instead of its own initialisation (a retrofitted run, whose
    `train.init_from` names where it came from; ignored once the run has a checkpoint), and `run_values` are extra
    columns of the run row written with it at the start (e.g. the retrofit's parent).
    `runs_dir` holds the run's directory (checkpoint, tokenizer) instead of `<db dir>/runs`.
    `weights_needed` False counts a run results.db has as done as finished even without its checkpoint (nothing
    after this will load it); True trains such a run again, so the stages that load weights find them.
    """
    dist_info = Dist.from_env()
    init_distributed(dist_info, resolve_device(cfg.train.device, dist_info.local_rank if dist_info.enabled else None))
    rid = run_id(cfg, prepared.fingerprint)
    ckpt_path = ckpt.run_dir(db_path, rid, runs_dir) / ckpt.CKPT_NAME
    # rank 0 alone reads the state (it alone has the database); every rank acts on its verdict
    verdict, existing = decide_on_main(dist_info, lambda: _verdict(db, cfg, rid, ckpt_path, dist_info, weights_needed))
    if verdict == "skip":
        return RunResult(rid, "done", skipped=True, row=existing if dist_info.is_main else {})
    if not isinstance(progress, Progress):
        progress = Progress(enabled=bool(progress) and dist_info.is_main)
    elif not dist_info.is_main:
        progress = Progress(enabled=False, console=progress.console)

    trainer = _Trainer(cfg, prepared, db, ckpt_path, rid, dist_info)
    trainer.resume(verdict == "resume", existing, log, init_state)
    trainer.record_start(existing, run_values, variant)
    trainer.mirror = tblog.open_mirror(
        db_path, rid, start_step=trainer.start_step, on=trainer.writes and tblog.enabled(cfg.log.tensorboard)
    )
    if trainer.resumed_from is not None:
        log(f"resuming {rid} from step {trainer.resumed_from}/{cfg.train.max_steps} ({ckpt_path})")
    with matmul_precision(trainer.device):
        return trainer.run(progress, stop_after)


class _Trainer:
    """One run's training state: built (device, seeds, model, optimizer, data), then resumed from its checkpoint,
    then stepped to the end. Telemetry carried over from earlier processes of the same run is in `carried`; this
    process's own timings are in its stopwatches, and checkpoints store the sum."""

    def __init__(
        self, cfg: RunConfig, prepared: Any, db: dbm.Database | None, ckpt_path: Path, rid: str, dist_info: Dist
    ):
        self.cfg, self.prepared, self.db, self.ckpt_path, self.rid = cfg, prepared, db, ckpt_path, rid
        self.dist = dist_info
        self.writes = dist_info.is_main and db is not None
        self.device = self._setup_device()
        self.precision = precision(cfg, self.device)
        self.amp = self.precision.amp

        # the idle baseline: what the process holds before this run builds anything (interpreter, libraries, data),
        # so the report can tell the model's own memory from the peak; the peak is measured from here on
        telemetry.reset_peak_rss()
        self.baseline_rss = telemetry.current_rss_bytes()
        self.step_mem: int | None = None  # this process's measurement of one step's own memory (see _one_step)
        # every random stream starts from the run's seed, in this order, before the model is built
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = architectures.build(cfg.arch, cfg.model).to(self.device)
        # a depth sampled per step, or decided by the data (halting, routing), would recompile at every step
        sampled_depth = (
            getattr(self.model.arch_args, "recur_sampling", "fixed") != "fixed" or type(self.model).reports_stats
        )
        self.compile = resolve_compile(
            cfg.train.compile, self.device, self.amp, sampled_depth, curriculum.enabled(cfg), cfg.arch
        )
        self.optimizer = make_optimizer(self.model, cfg, self.device)

        self.sampler: WindowSampler | taskdata.TaskSampler
        if cfg.task.is_stories:
            self.sampler = WindowSampler(
                prepared.train_tokens(),
                cfg.model.max_seq_len,
                cfg.train.batch_size,
                seed=cfg.seed,
                rank=dist_info.rank,
                world_size=dist_info.world_size,
            )
            self.windows = val_windows(
                prepared.valid_tokens(), cfg.model.max_seq_len, cfg.eval.val_windows, cfg.eval.val_seed
            )
        else:  # a procedural task: fresh problems, never an epoch; validation on its held-out valid split
            task = taskdata.build_task(cfg.task)
            self.sampler = taskdata.TaskSampler(
                task,
                cfg.train_seq_len,
                cfg.train.batch_size,
                seed=cfg.seed,
                loss=cfg.task.loss,
                rank=dist_info.rank,
                world_size=dist_info.world_size,
            )
            self.windows = taskdata.val_problems(task, cfg.train_seq_len, cfg.eval.val_windows, cfg.eval.val_seed)
        self.train_model: nn.Module = self.model
        self.start_step = self.step = 0
        self.resumed_from: int | None = None
        self.carried: dict[str, Any] = {**telemetry.FRESH_RUN_TELEMETRY, "step_times": []}
        self.step_times: list[float] = []
        self.warmup_compile = 0.0
        self.sw = telemetry.Stopwatch(self.device, cuda_events=True)  # the timed steps: wall, CPU and CUDA time
        self.eval_sw = telemetry.Stopwatch(self.device)
        self.nvml = telemetry.NvmlSampler(self.device)
        self.load = telemetry.LoadSampler()
        self.metrics: list[dict[str, Any]] = []
        # Training FLOPs spent so far. An architecture that reports its compute (`reports_stats`) adds up what its
        # forwards ran: `spent` (every process, up to the last sync) plus `pending` (this process, since then),
        # carried by the checkpoint. Any other is counted from its schedule (`flops`), the analytic count per step.
        self.reports = bool(type(self.model).reports_stats)
        self.flops: curriculum.FlopCounter | None = None
        self.spent: float | None = 0.0
        self.pending = 0.0
        self.step_stats = StepStats()  # what the last step's forwards reported
        self.resumed_telemetry: dict[str, Any] | None = None  # the checkpoint's own, when resumed from one
        self.mirror: Any = tblog.NoMirror()  # TensorBoard copy of the metric rows, set once the start step is known

    def _setup_device(self) -> torch.device:
        """Resolve the device and check everything that can fail before a row is written."""
        cfg, dist_info = self.cfg, self.dist
        device = resolve_device(cfg.train.device, dist_info.local_rank if dist_info.enabled else None)
        if cfg.train.compile:  # before anything is built (auto never fails: it only compiles where it can)
            check_compile_available(device, "train.compile=true")
        if device.type == "cpu":
            telemetry.tune_cpu_allocator()
        init_distributed(dist_info, device)
        if cfg.train.batch_size % dist_info.world_size:
            raise ConfigError(
                f"train.batch_size={cfg.train.batch_size} must be divisible by the number of processes "
                f"({dist_info.world_size}) so the global batch is unchanged"
            )
        return device

    # ---- start ------------------------------------------------------------------------------------------------------

    def resume(
        self,
        from_checkpoint: bool,
        existing: dict[str, Any] | None,
        log: Callable[[str], None],
        init_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Continue from the run's checkpoint when rank 0 found one: weights, optimizer, sampler, RNG, telemetry.
        Without one, a run with `train.init_from` starts from `init_state` (the weights it was converted from)."""
        if from_checkpoint:
            if not self.ckpt_path.exists():
                raise ckpt.CheckpointError(
                    f"rank {self.dist.rank} cannot see the checkpoint {self.ckpt_path} that "
                    "rank 0 resumes from; every process needs the same run directory"
                )
            state = ckpt.load(self.ckpt_path, map_location="cpu", unreadable_hint=RESTART_HINT)
            ckpt.check_config(state, self.cfg, self.ckpt_path)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            ckpt.set_rng_state(state["rng"], self.device)
            self.start_step = self.step = self.resumed_from = int(state["step"])
            spent = state.get("spent_flops")
            self.spent = None if spent is None else float(spent)  # a checkpoint from before it was kept: unknown
            self.carried = telemetry.carried_from(state["telemetry"])
            self.resumed_telemetry = state["telemetry"]
            change = ckpt.hardware_change(ckpt.saved_hardware(state), self._hardware())
            if change:
                # step times from two kinds of hardware (or precisions, or an eager and a compiled step) would
                # average into a number true of neither
                log(
                    f"warning: {self.rid} resumes on different hardware ({change}); its speed is measured from "
                    "here on only, and its training time adds up both"
                )
                self.carried["step_times"] = []
            del state
        elif existing is not None and existing["status"] == "done":
            log(f"run {self.rid} is marked done but its checkpoint is missing; training it again")
        if self.resumed_from is None and self.cfg.train.init_from:
            if init_state is None:
                raise ConfigError(
                    f"train.init_from={self.cfg.train.init_from!r}: this run starts from converted "
                    "weights; start it with 'benchctl retrofit'"
                )
            self.model.load_state_dict(init_state)
        self.flops = None if self.reports else curriculum.FlopCounter(self.model, self.cfg, self.start_step)
        self.step_times = list(self.carried["step_times"])

    def record_start(
        self, existing: dict[str, Any] | None, run_values: dict[str, Any] | None = None, variant: str | None = None
    ) -> None:
        """The run row (environment recorded from the start, so failed runs have it too) and the run directory."""
        if not self.writes:
            return
        cfg, prepared = self.cfg, self.prepared
        report = self.model.param_report()
        env = telemetry.environment(self.device, self.nvml.driver_version)
        row = {
            **env,
            "dtype": self.precision.dtype,
            "precision_reason": self.precision.reason,
            "compiled": int(self.compile.on),
            "compile_reason": self.compile.reason,
            "id": self.rid,
            "arch": cfg.arch,
            "preset": cfg.preset,
            "seed": cfg.seed,
            "status": "running",
            "variant": variant or cfg.arch,
            "config_json": cfg.to_json(),
            "data_fingerprint": prepared.fingerprint,
            "data_source": prepared.source,
            "data_train_tokens": prepared.n_train_tokens,
            "n_params": report["total"],
            "effective_params": report["effective"],
            "flops_per_token": self.model.flops_per_token(cfg.train_seq_len),
            "max_steps": cfg.train.max_steps,
            "world_size": self.dist.world_size,
            "error": None,
            "pid": os.getpid(),
            "pid_started": liveness.process_start_time(os.getpid()),
            "heartbeat_at": dbm.now(),
            "hostname": _hostname(),
            "threads": telemetry.threads_used(),
            "concurrent_jobs": telemetry.concurrent_jobs(),
            **(run_values or {}),
        }
        train_tables.start_run(self.db, row, new=existing is None, resume_step=self.start_step)
        if self.resumed_from is not None and self.resumed_telemetry is not None:
            # killed between writing a checkpoint and recording it: the database catches up with the file now, so
            # the run's rows always describe the checkpoint it continues from
            path = str(self.ckpt_path)
            if train_tables.checkpoint_step(self.db, self.rid, path) != self.resumed_from:
                tps = cfg.tokens_per_step
                train_tables.record_checkpoint(
                    self.db,
                    self.rid,
                    step=self.resumed_from,
                    path=path,
                    size=self.ckpt_path.stat().st_size,
                    metrics=[],
                    run_values={
                        "tokens_seen": self.resumed_from * tps,
                        **telemetry.run_columns(self.resumed_telemetry, tps),
                    },
                )
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        tok_dst = self.ckpt_path.parent / (ckpt.TOKENIZER_NAME if cfg.task.is_stories else taskdata.TOKENIZER_FILE)
        if not tok_dst.exists():
            shutil.copyfile(prepared.tokenizer_path, tok_dst)

    def _wrap_model(self) -> None:
        """DDP around the model, then torch.compile around that (compiling inside DDP would hide the gradient
        buckets from DDP's communication hooks, which compile then splits the graph around)."""
        if self.dist.enabled:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = DDP(self.model, device_ids=device_ids)
        if self.compile.on:
            self.train_model = torch.compile(self.train_model)

    def _hardware(self) -> dict[str, str]:
        return ckpt.hardware(self.device, self.precision.dtype, self.compile.on)

    # ---- the loop ---------------------------------------------------------------------------------------------------

    def run(self, progress: Progress, stop_after: int | None) -> RunResult:
        cfg, t = self.cfg, self.cfg.train
        self._wrap_model()
        telemetry.reset_peak_memory(self.device)
        task = progress.task(
            f"{cfg.arch} s{cfg.seed}", total=t.max_steps, completed=self.start_step, loss="-", **{"tok/s": "-"}
        )
        heartbeat = self._heartbeat()
        try:
            self.nvml.start()
            self.load.start()
            heartbeat.start()
            if self.start_step == 0:
                self._initial_eval(task)
            last_val = None
            while self.step < t.max_steps:
                val = self._one_step(task, progress)
                last_val = val if val is not None else last_val
                if stop_after is not None and stop_after <= self.step < t.max_steps:
                    if self.step % t.ckpt_interval:
                        self._save_checkpoint()
                    return RunResult(self.rid, "running", resumed_from=self.resumed_from)
            return self._finish(last_val)
        except BaseException as e:
            if self.writes:
                msg = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
                train_tables.fail_run(self.db, self.rid, msg)
            raise
        finally:
            heartbeat.stop()
            task.close()
            self.mirror.close()
            self.nvml.stop()
            self.load.stop()

    def _heartbeat(self) -> liveness.Heartbeat:
        """The thread that stamps the run's row while this process trains it (rank 0, which alone writes): what tells
        another machine reading the database that the run is alive (`liveness.run_state`)."""
        path = self.db.conn.execute("PRAGMA database_list").fetchone()[2] if self.writes else ""
        rid, pid = self.rid, os.getpid()

        def beat() -> None:
            if path:  # an in-memory database has no file another process could read
                train_tables.heartbeat(path, rid, pid)

        return liveness.Heartbeat(beat)

    def _initial_eval(self, task: Any) -> None:
        v0 = self._eval_at(0)
        self.carried["initial_val_loss"] = v0
        if self.writes:
            train_tables.record_initial_loss(self.db, self.rid, v0, self._take_metrics())
        task.move_to(0, loss=f"{v0:.3f}")

    def _one_step(self, task: Any, progress: Progress) -> float | None:
        """One optimizer step and whatever falls due after it (logging, evaluation, checkpoint); returns the
        validation loss when one was measured."""
        cfg, t = self.cfg, self.cfg.train
        lr = get_lr(self.step, cfg)
        self.step_stats = StepStats()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        timed = self.step - self.start_step >= TIMING_WARMUP_STEPS
        # The step's own memory, measured as `benchctl bench` measures it, on the last untimed warm-up step of this
        # process (the profiler's cost stays out of the training time) once the optimizer's state exists (AdamW
        # creates it in the first step: measured then, it would count twice)
        measure = self.step - self.start_step == TIMING_WARMUP_STEPS - 1 and bool(self.optimizer.state)
        t0 = time.perf_counter()
        with self.sw if timed else nullcontext(), curriculum.at_step(self.model, self.step, cfg) as depth:

            def step() -> tuple[torch.Tensor, torch.Tensor | None]:
                return train_step(
                    self.train_model,
                    self.model,
                    self.optimizer,
                    self.sampler.next_batch,
                    cfg,
                    self.device,
                    self.amp,
                    ddp=self.dist.enabled,
                    n_recur=depth,
                    stats=self.step_stats,
                )

            if measure:
                out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
                self.step_mem = telemetry.step_memory(
                    lambda: out.append(step()), self.device, self.model, self.optimizer
                )
                loss_sum, grad_norm = out[0]
            else:
                loss_sum, grad_norm = step()
        self.pending += self.step_stats.flops
        if not timed:
            telemetry.sync(self.device)
            self.warmup_compile += time.perf_counter() - t0
        else:
            self.step_times.append(self.sw.last)
        self.step += 1
        step = self.step
        if not math.isfinite(float(loss_sum)):
            raise BenchctlError(
                f"{cfg.arch} seed {cfg.seed}: training loss became {float(loss_sum)} at step {step}; "
                "lower train.lr or check the data"
            )
        if step % t.log_interval == 0 or step == t.max_steps:
            self._log_step(task, loss_sum, grad_norm, lr)
        val = None
        if step % t.eval_interval == 0 or step == t.max_steps:
            val = self._eval_at(step)
            if progress.enabled:
                progress.log(f"  {cfg.arch} s{cfg.seed} step {step}: val loss {val:.4f}")
            self._flush_metrics()
        if step % t.ckpt_interval == 0 or step == t.max_steps:
            self._save_checkpoint()
        return val

    def _log_step(self, task: Any, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None, lr: float) -> None:
        train_loss = float(loss_sum)
        if self.dist.enabled:
            ls = loss_sum.clone()
            dist.all_reduce(ls)
            train_loss = float(ls) / self.dist.world_size
        self._add_metric("train_loss", train_loss, self.step)
        self._add_metric("lr", lr, self.step)
        if grad_norm is not None:
            self._add_metric("grad_norm", float(grad_norm), self.step)
        spent = self._spent_flops()
        if spent is not None:  # the training compute spent so far (forward + backward, every process)
            self._add_metric("train_flops", spent, self.step)
        if curriculum.enabled(self.cfg):
            self._add_metric("recur_depth", curriculum.depth_at(self.step - 1, self.cfg), self.step)
        for name, value in self._reduced(self.step_stats.means()).items():  # auxiliary losses, architecture metrics
            self._add_metric(name, value, self.step)
        rss = telemetry.run_peak_rss_bytes()
        if rss is not None:
            self._add_metric("peak_rss_bytes", rss, self.step)
        fields = {"loss": f"{train_loss:.3f}"}
        if self.step_times:
            tps = self.cfg.tokens_per_step / statistics.median(self.step_times[-20:])
            self._add_metric("tokens_per_s", tps, self.step)
            fields["tok/s"] = f"{tps:,.0f}"
        task.move_to(self.step, **fields)
        self._flush_metrics()

    def _spent_flops(self) -> float | None:
        """Training FLOPs spent up to this step, summed over the processes (every process calls it at the same
        steps: logging and checkpoints). None when unknown (a run resumed from a checkpoint that did not keep it)."""
        if self.flops is not None:
            return self.flops.advance_to(self.step)
        pending = torch.tensor(self.pending, dtype=torch.float64, device=self.device)
        if self.dist.enabled:
            dist.all_reduce(pending)
        self.pending = 0.0
        if self.spent is not None:
            self.spent += float(pending)
        return self.spent

    def _reduced(self, values: dict[str, float]) -> dict[str, float]:
        """Per-process scalars averaged over the processes (every forward reports the same names)."""
        if not self.dist.enabled or not values:
            return values
        names = sorted(values)
        vec = torch.tensor([values[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        return {k: float(v) / self.dist.world_size for k, v in zip(names, vec.tolist())}

    def _finish(self, last_val: float | None) -> RunResult:
        final = last_val
        if final is None:  # resumed exactly at the end: the final eval is in the metrics table
            final = self._evaluate()
        row: dict[str, Any] = {}
        if self.writes:
            train_tables.finish_run(
                self.db, self.rid, final_val_loss=final, initial_val_loss=self.carried["initial_val_loss"]
            )
            train_tables.record_gpu_telemetry_note(self.db, self.rid, self.nvml.note)
            row = train_tables.get_run(self.db, self.rid) or {}
        return RunResult(self.rid, "done", resumed_from=self.resumed_from, row=row)

    # ---- evaluation, metrics, checkpoints ---------------------------------------------------------------------------

    def _evaluate(self, extras: dict[str, float] | None = None) -> float:
        e = self.cfg.eval
        return evaluate(
            self.model, self.windows, e.val_batch_size, self.device, self.amp, e.val_seed, self.dist, extras=extras
        )

    def _eval_at(self, at_step: int) -> float:
        extras: dict[str, float] = {}
        with self.eval_sw:
            v = self._evaluate(extras)
        self._add_metric("val_loss", v, at_step)
        for name, value in extras.items():  # the auxiliary terms and metrics on validation data, beside the loss
            self._add_metric(name, value, at_step)
        return v

    def _add_metric(self, name: str, value: float, at_step: int) -> None:
        self.metrics.append(
            {
                "run_id": self.rid,
                "step": at_step,
                "name": name,
                "value": float(value),
                "tokens": at_step * self.cfg.tokens_per_step,
                "wall_seconds": self.carried["train_seconds"] + self.sw.total,
            }
        )

    def _take_metrics(self) -> list[dict[str, Any]]:
        """The metric rows gathered since the last write, on their way to results.db (and to TensorBoard)."""
        rows, self.metrics = self.metrics, []
        if self.writes:
            self.mirror.add_rows(rows)
        return rows

    def _flush_metrics(self) -> None:
        rows = self._take_metrics()  # other ranks measure the same values but never write them
        if self.writes:
            train_tables.record_metrics(self.db, rows)

    def _telemetry(self) -> dict[str, Any]:
        """Cumulative telemetry over every process of this run so far (what a checkpoint carries forward)."""
        c, device, sw, add, peak = self.carried, self.device, self.sw, telemetry.add, telemetry.max_of
        peaks = telemetry.torch_peaks(device)
        rss = telemetry.run_peak_rss_bytes()
        if rss is not None and self.baseline_rss is not None:
            # the kernel's high-water mark is kept in per-thread counters folded in lazily, so it can read a few
            # pages below the RSS taken just after it was reset; a peak is never below that baseline
            rss = max(rss, self.baseline_rss)
        return {
            "train_seconds": c["train_seconds"] + sw.total,
            "warmup_seconds": c["warmup_seconds"] + self.warmup_compile,
            "eval_seconds": c["eval_seconds"] + self.eval_sw.total,
            "step_times": self.step_times[-2000:],
            # the same timed steps in process CPU time and (CUDA) GPU event time, and how many there were
            "cpu_seconds": add(c["cpu_seconds"], sw.cpu_total),
            "cuda_seconds": add(c["cuda_seconds"], sw.cuda_total) if device.type == "cuda" else None,
            "timed_steps": add(c["timed_steps"], sw.count),
            "load_total": c["load_total"] + self.load.total,
            "load_n": c["load_n"] + self.load.n,
            "util_total": c["util_total"] + self.nvml.util_total,
            "util_n": c["util_n"] + self.nvml.util_n,
            "peak_rss": peak(c["peak_rss"], rss),
            # the baseline of the process whose peak is the run's peak: their difference is the model's share
            "baseline_rss": self.baseline_rss if (rss or 0) >= (c["peak_rss"] or 0) else c["baseline_rss"],
            "peak_alloc": peak(c["peak_alloc"], peaks[0]),
            "step_mem": peak(c.get("step_mem"), self.step_mem),
            "peak_reserved": peak(c["peak_reserved"], peaks[1]),
            "peak_nvml": peak(c["peak_nvml"], self.nvml.peak_used),
            "initial_val_loss": c["initial_val_loss"],
        }

    def _save_checkpoint(self) -> None:
        tel, step = self._telemetry(), self.step
        spent = self._spent_flops() if self.flops is None else None  # reported compute: synced on every process
        if self.dist.is_main:
            size = ckpt.save(
                self.ckpt_path,
                {
                    "config": self.cfg.to_json(),
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "step": step,
                    "rng": ckpt.rng_state(self.device),
                    "hardware": self._hardware(),
                    "sampler": self.sampler.state_dict(),
                    "telemetry": tel,
                    "data_fingerprint": self.prepared.fingerprint,
                    "run_id": self.rid,
                    "spent_flops": spent,
                },
            )
            if self.db is not None:
                tps = self.cfg.tokens_per_step
                train_tables.record_checkpoint(
                    self.db,
                    self.rid,
                    step=step,
                    path=str(self.ckpt_path),
                    size=size,
                    metrics=self._take_metrics(),
                    run_values={"tokens_seen": step * tps, **telemetry.run_columns(tel, tps)},
                )
        barrier(self.dist)


def _hostname() -> str:
    return socket.gethostname()


def _micro_batch_seconds(cfg: RunConfig, arch: str, repeats: int) -> tuple[float, float]:
    """Wall seconds of one micro-batch (forward and backward, eager, under the run's autocast) of `arch` built with
    `cfg`'s model settings on its device: the median of `repeats` after one untimed warm-up; and that model's
    FLOPs per token. RNG state is preserved."""
    device = resolve_device(cfg.train.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = architectures.build(arch, cfg.model).to(device)
        amp = autocast_dtype(cfg, device)
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train_seq_len), device=device)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=amp) if amp else nullcontext():
                _, loss = model(x, x, return_logits=False)
            loss.backward()
            telemetry.sync(device)
            times.append(time.perf_counter() - t0)
        flops = float(model.flops_per_token(cfg.train_seq_len))
    return statistics.median(times[1:]), flops


def estimate_seconds(cfgs: list[RunConfig], prepared: Any) -> float:
    """Rough wall time for training `cfgs` on this device: time one micro-batch of the first config's control
    equivalent, scale by steps, accumulation and each architecture's FLOPs/token. RNG state is preserved."""
    if not cfgs:
        return 0.0
    base = cfgs[0]
    seconds, flops = _micro_batch_seconds(base, "control", 1)
    per_flop = seconds / (flops * base.train.batch_size * base.train_seq_len)
    return sum(per_flop * accounting.training_flops(c) for c in cfgs)


def step_seconds(cfg: RunConfig) -> float:
    """Wall seconds of one optimizer step of `cfg`'s own architecture on this device (its micro-batches, eager, the
    optimizer update left out). Narrow models are bound by the framework's per-op cost, not by FLOPs, so a step of
    a recurrent design at width 8 can take as long as one at width 32: timing each shape, not scaling one by FLOPs,
    is what makes an estimate over many widths hold. Under a sampled training depth the median of three steps."""
    return _micro_batch_seconds(cfg, cfg.arch, 3)[0] * cfg.train.grad_accum
