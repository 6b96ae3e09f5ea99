"""Where and how a computation runs: device, precision (autocast) and the distributed process group.

Shared by every stage that runs a model (train, sample, eval, bench), so they all follow one rule: CUDA when present
(or asked for), bf16 autocast on CUDA, fp32 on CPU unless asked, and torchrun's environment read in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from benchctl.config import RunConfig
from benchctl.errors import ConfigError


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


def check_compile_available(device: torch.device, what: str) -> None:
    """torch.compile's inductor backend generates C++ on the CPU and Triton kernels on CUDA: without them the first
    step would fail deep inside inductor. Fail first, naming the fix."""
    import importlib.util
    import shutil

    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ConfigError(f"{what} on CPU needs a C++ compiler (g++ or clang++) on PATH; install one (e.g. "
                          "apt install g++) or train without compile (it does not change the results)")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError(f"{what} on CUDA needs Triton (pip install triton, normally installed with torch); or "
                          "train without compile (it does not change the results)")


def autocast_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default, never on CPU unless asked."""
    d = cfg.train.dtype
    if d == "bfloat16":
        return torch.bfloat16
    if d == "auto" and device.type == "cuda":
        return torch.bfloat16
    return None


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
    import torch.distributed as dist

    if dist_info.enabled and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)


def barrier(dist_info: Dist) -> None:
    if dist_info.enabled:
        import torch.distributed as dist

        dist.barrier()
