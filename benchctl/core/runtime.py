"""Where and how a computation runs: device, precision (autocast) and the distributed process group.

Shared by every stage that runs a model (train, sample, eval, depth, bench), so they all follow one rule: CUDA when
present (or asked for); precision from `resolve_precision` (bf16 autocast wherever the hardware has native bf16, fp32
elsewhere); torchrun's environment read in one place.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from benchctl.core.config import RunConfig
from benchctl.core.errors import BenchctlError, ConfigError


def resolve_device(spec: str, local_rank: int | None = None, *, option: str = "train.device") -> torch.device:
    """'auto' -> CUDA (this process's GPU under torchrun) when present, else CPU; an explicit device is checked.

    `option` names the setting in error messages ('train.device' for a run's config, '--device' for a flag)."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank or 0)
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{option}={spec!r} but CUDA is not available here; use cpu (or auto)")
        if spec == "cuda":
            return torch.device("cuda", local_rank or 0)
    if spec == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option}='mps' but MPS is not available here")
    try:
        return torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"{option} must be auto, cpu, cuda, cuda:N or mps; got {spec!r}") from None


def _cpp_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def check_compile_available(device: torch.device, what: str) -> None:
    """torch.compile's inductor backend generates C++ on the CPU and Triton kernels on CUDA: without them the first
    step would fail deep inside inductor. Fail first, naming the fix."""
    if device.type == "cpu" and not _cpp_compiler():
        raise ConfigError(
            f"{what} on CPU needs a C++ compiler (g++ or clang++) on PATH; install one (e.g. "
            "apt install g++) or train without compile (it does not change the results)"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            f"{what} on CUDA needs Triton (pip install triton, normally installed with torch); or "
            "train without compile (it does not change the results)"
        )


@dataclass(frozen=True)
class CompileChoice:
    """Whether the training step runs under torch.compile, and why (stored with every run)."""

    on: bool
    reason: str


def resolve_compile(
    setting: bool | None,
    device: torch.device,
    amp: torch.dtype | None,
    sampled_depth: bool,  # the depth changes from step to step: sampled, or decided by the data (halting, routing)
    curriculum: bool,
    arch: str = "the model",
) -> CompileChoice:
    """`train.compile`: true or false as set (true checks for the compiler first, and refuses a sampled training depth:
    every sampled depth is a new graph, so it would recompile until its cache limit, then silently fall back to eager,
    and the step times would measure compilation); None (auto) compiles where it was measured to pay and nothing
    stands in the way: a bf16-autocast step on a CPU with a C++ compiler, at a fixed depth. There inductor fuses the
    elementwise work between the matmuls (norms, rotary embedding, gates, casts, residual adds) that eager kernels do
    pass by pass, and a study-length run wins back its one-off compilation many times over. Elsewhere auto stays
    eager: in fp32 benchctl has no measurement that compile pays; on CUDA it paid for the two architectures measured
    on one GPU, but whether every architecture compiles there is not yet checked, and a run that fails to compile
    would be worse than a slower one; and a depth that changes during training (sampled, or a curriculum) would
    recompile for every depth. Compilation changes float rounding only,
    never the maths."""
    if setting is not None:
        if setting and sampled_depth:
            raise ConfigError(
                f"train.compile=true with {arch}'s training depth, which changes from step to step (sampled, or "
                "decided by the data), recompiles at every new depth; train without compile (it does not change "
                "the results)"
            )
        if setting:
            check_compile_available(device, "train.compile=true")
        return CompileChoice(bool(setting), f"set: train.compile={str(bool(setting)).lower()}")
    if device.type != "cpu":
        return CompileChoice(False, f"auto: eager on {device.type} (train.compile=true to compile)")
    if amp is not torch.bfloat16:
        return CompileChoice(False, "auto: eager in fp32")
    if sampled_depth or curriculum:
        return CompileChoice(False, f"auto: eager, the training depth {'is sampled' if sampled_depth else 'ramps'}")
    if not _cpp_compiler():
        return CompileChoice(False, "auto: eager, no C++ compiler on PATH for inductor")
    return CompileChoice(True, "auto: compiled (cpu, bf16 autocast)")


# ---- precision --------------------------------------------------------------------------------------------------

# CPU flags (Linux /proc/cpuinfo names) that mean the cores compute bf16 matmuls natively: oneDNN then runs a bf16
# matmul much faster than an fp32 one, which is what makes bf16 the CPU default there.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")

# Without native bf16 (CUDA compute capability below 8.0: T4, V100) `auto` trains in fp32, not fp16: fp16 would need a
# loss scaler whose state is part of the optimisation (and of every checkpoint), and its narrow range changes the
# numbers of some architectures more than others. fp32 keeps every architecture on the same footing.
MIN_BF16_CAPABILITY = (8, 0)

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
INFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """What a computation runs in: `amp` is the autocast dtype (None: plain fp32); `dtype` its name as stored with a
    run; `capability` what was detected ('cpu:avx512_bf16', 'cuda:sm_86', 'cpu:no native bf16'); `reason` why."""

    amp: torch.dtype | None
    dtype: str
    capability: str
    reason: str

    def autocast(self, device: torch.device) -> Any:
        """The autocast context of this precision on `device` (a no-op context for fp32)."""
        return torch.autocast(device.type, dtype=self.amp) if self.amp is not None else nullcontext()


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_bf16_capability() -> str | None:
    """The CPU feature that gives native bf16 matmuls ('amx_bf16' or 'avx512_bf16'), or None. Read from the CPU's
    own flags (Linux) and from PyTorch's runtime check where it has one; never inferred from the vendor or model."""
    flags = _cpuinfo_flags()
    for flag in CPU_BF16_FLAGS:
        if flag in flags:
            return flag
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        if check is not None and check():
            return "avx512_bf16"
    except RuntimeError:
        pass
    return None


def capability(device: torch.device) -> tuple[str, bool]:
    """(what this device is, e.g. 'cuda:sm_86' or 'cpu:avx512_bf16', whether it computes bf16 natively)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:sm_{major}{minor}", (major, minor) >= MIN_BF16_CAPABILITY
    if device.type == "cpu":
        flag = cpu_bf16_capability()
        return (f"cpu:{flag}", True) if flag else ("cpu:no native bf16", False)
    return f"{device.type}:no autocast", False


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """`auto`: bf16 autocast where the device computes bf16 natively (CUDA sm_80+, CPUs with AVX512-BF16 or
    AMX-BF16), fp32 elsewhere (older GPUs included, see MIN_BF16_CAPABILITY). An explicit dtype always wins.
    The loss is computed in fp32 either way (architectures.blocks.linear_cross_entropy)."""
    cap, native = capability(device)
    if setting == "auto":
        if native:
            return Precision(torch.bfloat16, "bfloat16", cap, f"auto: native bf16 ({cap})")
        return Precision(None, "float32", cap, f"auto: no native bf16 ({cap})")
    if setting not in DTYPES:
        raise ConfigError(f"train.dtype must be auto, {' or '.join(DTYPES)}; got {setting!r}")
    return Precision(DTYPES[setting], setting, cap, f"set: train.dtype={setting} ({cap})")


def inference_precision(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the user set for generation (weights cast once, no autocast), and the reason recorded with it.

    `auto` is decided from measurements, which live in the results database: `benchctl.stages.bench.precision`."""
    cap, _native = capability(device)
    if setting not in INFERENCE_DTYPES:
        raise ConfigError(f"--precision must be auto, {', '.join(INFERENCE_DTYPES)}; got {setting!r}")
    return INFERENCE_DTYPES[setting], f"set: --precision {setting} ({cap})"


def precision(cfg: RunConfig, device: torch.device) -> Precision:
    return resolve_precision(cfg.train.dtype, device)


def autocast_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `cfg` on `device` (None: fp32), by `resolve_precision`'s rule."""
    return precision(cfg, device).amp


def autocast(device: torch.device, amp: torch.dtype | None) -> Any:
    """torch.autocast for `amp` on `device`, or a no-op context when `amp` is None (fp32)."""
    return torch.autocast(device.type, dtype=amp) if amp is not None else nullcontext()


@dataclass
class Dist:
    """torchrun's environment: rank, world size, local rank (a single process is rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> Dist:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )


def init_distributed(dist_info: Dist, device: torch.device) -> None:
    """Join torchrun's process group once per process (NCCL on CUDA, gloo on CPU); later calls are no-ops, so the
    runs of one `train-all` or `study` share one group. On CUDA the process's GPU is made current and bound to the
    group first: otherwise NCCL's collectives (and broadcast_object_list) would all start on GPU 0."""
    if not dist_info.enabled or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")
    atexit.register(shutdown_distributed)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(dist_info: Dist) -> None:
    if dist_info.enabled:
        dist.barrier()


T = TypeVar("T")


def main_first(dist_info: Dist, work: Callable[[], T]) -> T:
    """Run `work` on rank 0, then on the other ranks (one process: just run it).

    For work that fills a shared cache (tokenizer, pretokenized data): rank 0 builds it while the others wait, and
    they then read it instead of all writing the same files at once."""
    if not dist_info.enabled:
        return work()
    if not dist_info.is_main:
        barrier(dist_info)
    out = work()
    if dist_info.is_main:
        barrier(dist_info)
    return out


def decide_on_main(dist_info: Dist, decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 only and hand every rank its outcome: the value, or the BenchctlError it raised.

    Skip, resume and abort must be one decision for all ranks: if rank 0 alone skips a finished run (or stops at a
    confirmation) while the others go on to build the model, those block in DDP's constructor until the group breaks
    (gloo) or times out (NCCL). Needs the process group (`init_distributed`) when there is more than one process."""
    if not dist_info.enabled:
        return decide()
    box: list[Any] = [None]
    if dist_info.is_main:
        try:
            box[0] = ("value", decide())
        except BenchctlError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


@contextmanager
def matmul_precision(device: torch.device) -> Iterator[None]:
    """TF32 matmuls on CUDA for the duration of a computation, restored afterwards, so a stage run inside a study
    computes exactly as the same stage run alone (TF32 is process-wide state in PyTorch)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
