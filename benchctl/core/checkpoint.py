"""Checkpoints: atomic save/load of a run's full training state, and loading a finished model for inference.

A checkpoint holds everything needed to continue the same stream of batches bit for bit on CPU: model weights,
optimizer state, step, every RNG state (python, numpy, torch CPU and the training GPU's), the data sampler's state,
cumulative telemetry, the hardware and precision its steps ran on, and the resolved config. Files live in
`<runs dir>/<run id>/` (the runs dir is `<db dir>/runs` unless a study names another, e.g. one every machine of a
cluster shares), next to a copy of the tokenizer, so a run directory is self-contained. Writes are atomic
(`benchctl.core.files.atomic_write`): a process killed mid-write never leaves a truncated checkpoint under the real
name.
"""

from __future__ import annotations

import errno
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

import architectures
from benchctl.core.config import RunConfig, identity_diff
from benchctl.core.errors import CheckpointError
from benchctl.core.files import atomic_write
from benchctl.core.telemetry import hardware_name

CKPT_NAME = "ckpt.pt"
TOKENIZER_NAME = "tokenizer.model"
TASK_TOKENIZER_NAME = "tokenizer.json"  # a procedural task's run (benchctl.core.taskdata writes it)
FORMAT_VERSION = 1


def default_runs_dir(db_path: Path) -> Path:
    """`<db dir>/runs`: where run directories live unless a study names another runs dir."""
    return Path(db_path).resolve().parent / "runs"


def run_dir(db_path: Path, run_id: str, runs_dir: Path | None = None) -> Path:
    """A run's directory: under `runs_dir` when given, else under the default beside results.db (where the later
    stages look; a run trained elsewhere is linked there, see benchctl.stages.train.executors.link_run_dir)."""
    return (Path(runs_dir).resolve() if runs_dir is not None else default_runs_dir(db_path)) / run_id


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG a run draws from: python, numpy, torch's CPU generator and, on CUDA, the training device's own
    generator only. (All visible GPUs' states would tie the checkpoint to the GPU count: a run saved with four GPUs
    visible could not be resumed with one.)"""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device is None and torch.cuda.is_available():  # callers that name no device: the current GPU's
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore `rng_state`'s generators. A CUDA state restores the training device's generator; an older checkpoint's
    list of per-GPU states gives the one of the device it was trained on when it is in the list (else the first)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):
        if not cuda:
            return
        index = device.index or 0
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda, device)


def hardware(device: torch.device, dtype: str, compiled: bool = False) -> dict[str, str]:
    """What a checkpoint's steps were timed on: device type and name, the precision it trained in, and whether the
    step was compiled (a compiled step is another speed, as another device is)."""
    return {
        "device": device.type,
        "device_name": hardware_name(device),
        "dtype": dtype,
        "compiled": "yes" if compiled else "no",
    }


def saved_hardware(state: dict[str, Any]) -> dict[str, str] | None:
    """A checkpoint's hardware record. Checkpoints written before it recorded compilation compiled exactly when their
    config said train.compile=true (there was no auto then), so that is filled in from the config."""
    saved = state.get("hardware")
    if not saved or "compiled" in saved:
        return saved
    return {**saved, "compiled": "yes" if RunConfig.from_json(state["config"]).train.compile else "no"}


def hardware_change(saved: dict[str, str] | None, now: dict[str, str]) -> str | None:
    """A description of how `now` differs from the checkpoint's `saved` hardware, or None when it does not (or the
    checkpoint predates the record)."""
    if not saved:
        return None
    diffs = [
        f"{k} {saved[k]} -> {now[k]}"
        for k in ("device", "device_name", "dtype", "compiled")
        if k in saved and saved[k] != now[k]
    ]
    return "; ".join(diffs) or None


def save(path: Path, state: dict[str, Any]) -> int:
    """Atomically write a checkpoint dict; returns its size in bytes. A write that fails for want of space (torch's
    zip writer says only "unexpected pos") is a CheckpointError that says so: the write is atomic, so the previous
    checkpoint is intact and the run resumes from it."""
    state = {"format_version": FORMAT_VERSION, **state}
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:
        free = _free_bytes(path.parent)
        if getattr(e, "errno", None) != errno.ENOSPC and (free is None or free > _FULL):
            raise
        raise CheckpointError(
            f"the disk is full: writing checkpoint {path} failed ({free or 0:,} bytes free). Nothing was lost: the "
            "previous checkpoint is intact; free some space and rerun the same command to resume"
        ) from None
    return path.stat().st_size


_FULL = 64 * 2**20  # less than this free beside a failed write: the write failed for want of space


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def load(
    path: Path, map_location: str | torch.device = "cpu", *, unreadable_hint: str = "is it a benchctl checkpoint?"
) -> dict[str, Any]:
    """A checkpoint's state. `unreadable_hint` ends the error for a file that cannot be read: what the caller's
    user can do about it (training can delete its own run's checkpoint; a file named on a command line may be
    anything)."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        # Our own files: they carry RNG states (numpy arrays, tuples), so full unpickling is needed.
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # torch raises many types for a truncated/corrupt zip; all mean "unreadable"
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); {unreadable_hint}") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION or "config" not in state:
        raise CheckpointError(f"{path} is not a benchctl checkpoint of format {FORMAT_VERSION}")
    return state


def check_config(state: dict[str, Any], cfg: RunConfig, path: Path) -> None:
    """A checkpoint written under a different configuration must never be resumed silently."""
    diffs = identity_diff(RunConfig.from_json(state["config"]), cfg)
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was written with a different config ({'; '.join(diffs[:4])}); "
            "delete its run directory to retrain, or use the original settings"
        )


def check_run(state: dict[str, Any], cfg: RunConfig, model: torch.nn.Module, row: dict[str, Any], path: Path) -> None:
    """A checkpoint read for a stored run must be that run's own: the same architecture, the same configuration
    (every setting that makes a run what it is), the same data and the same parameter count as its row. A checkpoint
    copied over from another run would otherwise be measured and stored under this run's name."""
    rid = row.get("id", "?")
    fix = "restore the run's own checkpoint, or delete its run directory and train it again"
    if row.get("arch") and cfg.arch != row["arch"]:
        raise CheckpointError(f"checkpoint {path} holds a {cfg.arch} model, but run {rid} is {row['arch']}; {fix}")
    if row.get("config_json"):
        diffs = identity_diff(cfg, RunConfig.from_json(row["config_json"]))
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was written under another configuration than run {rid} "
                f"({'; '.join(diffs[:3])}); {fix}"
            )
    fp, want_fp = state.get("data_fingerprint"), row.get("data_fingerprint")
    if fp and want_fp and fp != want_fp:
        raise CheckpointError(f"checkpoint {path} was trained on data {fp[:12]}, run {rid} on {want_fp[:12]}; {fix}")
    n = getattr(model, "param_report", None)
    if row.get("n_params") is not None and n is not None and int(n()["total"]) != int(row["n_params"]):
        raise CheckpointError(
            f"checkpoint {path} has {int(n()['total']):,} parameters, run {rid} has {int(row['n_params']):,}; {fix}"
        )


def load_model(
    ckpt_path: Path, device: str | torch.device = "cpu", row: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, RunConfig, Path]:
    """(model in eval mode, its config, tokenizer path) from a run's checkpoint, for sampling and evaluation.

    `row`, the run's row of results.db, binds the checkpoint to its run (`check_run`): every stage that measures a
    stored run passes it."""
    state = load(Path(ckpt_path), map_location="cpu")
    cfg = RunConfig.from_json(state["config"])
    # building initialises weights the checkpoint then replaces: from a forked RNG, so loading a model never moves
    # the caller's random stream
    with torch.random.fork_rng(devices=[]):
        model = architectures.build(cfg.arch, cfg.model)  # (not on meta: to_empty would untie the embedding)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {ckpt_path} does not fit its own config: {e}") from None
    if row is not None:
        check_run(state, cfg, model, row, Path(ckpt_path))
    model.to(device).eval()
    # a TinyStories run keeps its SentencePiece model; a procedural task's run its character vocabulary
    name = TOKENIZER_NAME if cfg.task.is_stories else TASK_TOKENIZER_NAME
    tok = Path(ckpt_path).parent / name
    if not tok.exists():
        raise CheckpointError(f"run directory {tok.parent} has no {name}; the run is incomplete")
    return model, cfg, tok
