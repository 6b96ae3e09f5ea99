"""Retrofit: a recurrent model started from a finished run's weights, then trained ("healed") as a run of its own.

The parent is a finished plain transformer (usually a deep control, e.g. 16 layers, so that 4 shared blocks x 4
passes stand for its layers). The target's config is the parent's preset with the target architecture, the parent's
widths and data, and the user's overrides; `train.init_from` records the parent run and the conversion, so the run id
differs from the same architecture trained from scratch and the checkpoint carries it. The conversion itself is
`architectures.retrofit`; training is the ordinary engine (`train_run`), so a retrofitted run resumes, reports and
evaluates like any other. Its row records the parent, the init method and what the parent cost (tokens and training
FLOPs), so the report can compare total compute against training from scratch. The validation loss at step 0, which
every run measures, is here the loss right after conversion, before any healing step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import architectures
from architectures.retrofit import describe, retrofit_state
from benchctl.core import checkpoint as ckpt
from benchctl.core import db as dbm
from benchctl.core.config import RunConfig, make_config, run_id
from benchctl.core.errors import CheckpointError, ConfigError
from benchctl.stages.retrofit.options import RetrofitOptions
from benchctl.stages.train import engine as train_engine
from benchctl.stages.train import tables as train_tables

# The parent's trunk widths and data carry over to the target (the depth, n_layers and n_recur, does not: the target
# takes its preset's, or --set). Everything else comes from the preset and --set as for any run.
_CARRIED_MODEL = (
    "dim",
    "n_heads",
    "n_kv_heads",
    "hidden_dim",
    "multiple_of",
    "vocab_size",
    "max_seq_len",
    "norm_eps",
    "rope_theta",
    "init_std",
)
PARENT_ARCHS = ("control",)


@dataclass(frozen=True)
class Retrofit:
    """What one `benchctl retrofit` trains: the target config and where its weights come from."""

    cfg: RunConfig
    parent: dict[str, Any]  # the parent's runs row
    init: str  # stepwise | average | select
    lora_init: str | None  # svd | zero for a model with per-pass LoRA, else None

    @property
    def method(self) -> str:
        return describe(self.init, self.lora_init)


def plan(db: dbm.Database, opts: RetrofitOptions) -> Retrofit:
    """Resolve the parent (`opts.parent`: run id or name) and build the target's config; nothing is loaded or
    trained."""
    parent = train_tables.retrofit_parent(db, opts.parent, opts.preset)
    if parent["arch"] not in PARENT_ARCHS:
        raise ConfigError(
            f"--from {parent['id']}: a retrofit converts a plain transformer ({', '.join(PARENT_ARCHS)}),"
            f" not a {parent['arch']} run"
        )
    base = {} if opts.steps is None else {"train.max_steps": opts.steps}
    cfg = target_config(RunConfig.from_json(parent["config_json"]), opts.to, {**base, **opts.overrides})
    return attach(cfg, parent, opts.init, opts.lora_init)


def target_config(pcfg: RunConfig, to: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The converted model's config before it knows its parent's run id: the parent's preset, seed, trunk widths and
    data with the target architecture, then `overrides` on top (`train.init_from` is set by `attach`)."""
    base: dict[str, Any] = {f"model.{k}": getattr(pcfg.model, k) for k in _CARRIED_MODEL}
    base.update({f"data.{k}": v for k, v in pcfg.to_dict()["data"].items()})
    base.update(overrides or {})
    return make_config(pcfg.preset, to, pcfg.seed, base)


def has_lora(cfg: RunConfig) -> bool:
    """Whether the architecture has per-pass LoRA, the only thing a LoRA init applies to."""
    return hasattr(cfg.model.arch_args, "lora_rank")


def with_parent(cfg: RunConfig, parent_id: str, init: str, lora_init: str | None) -> RunConfig:
    """`cfg` recording the run it starts from: part of the run's identity, so a converted model is never the same
    run as that architecture trained from scratch, nor as another conversion of the same parent."""
    method = describe(init, lora_init if has_lora(cfg) else None)
    return replace(cfg, train=replace(cfg.train, init_from=f"{parent_id}:{method}"))


def attach(cfg: RunConfig, parent: dict[str, Any], init: str, lora_init: str | None) -> Retrofit:
    """The retrofit of a target config (from `target_config`) from the finished run `parent` (its runs row)."""
    lora = (lora_init or "svd") if has_lora(cfg) else None
    return Retrofit(cfg=with_parent(cfg, parent["id"], init, lora), parent=parent, init=init, lora_init=lora)


def check_conversion(pcfg: RunConfig, cfg: RunConfig, init: str, lora_init: str | None) -> None:
    """Refuse a conversion that cannot be made (an init the target architecture does not take, too few parent layers,
    different widths) before anything is trained: the weight surgery is run on models built on the meta device, which
    have shapes but no data, so it costs no memory and the error is the one the real conversion would raise."""
    if pcfg.arch not in PARENT_ARCHS:
        raise ConfigError(f"a retrofit converts a plain transformer ({', '.join(PARENT_ARCHS)}), not {pcfg.arch}")
    key = (_model_key(pcfg), _model_key(cfg), init, lora_init)
    if key in _CONVERTIBLE:  # a plan is resolved more than once per command (checked first, then run)
        return
    with torch.device("meta"):
        try:
            retrofit_state(_meta_model(pcfg).state_dict(), _meta_model(cfg), init, lora_init or "zero")
        except ValueError as e:
            raise ConfigError(
                f"cannot convert {pcfg.arch} (n_layers={pcfg.model.n_layers}) into {cfg.arch}: {e}"
            ) from None
    _CONVERTIBLE.add(key)


_CONVERTIBLE: set[tuple[str, str, str, str | None]] = set()
_META_MODELS: dict[str, Any] = {}


def _model_key(cfg: RunConfig) -> str:
    return json.dumps([cfg.arch, cfg.to_dict()["model"]], sort_keys=True)


def _meta_model(cfg: RunConfig) -> Any:
    """A shape-only model of `cfg`'s architecture, kept per model config: building one still runs every weight
    init (slowly, through PyTorch's reference kernels), and a plan's conversions share a few parents and targets."""
    key = _model_key(cfg)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 16:
            _META_MODELS.clear()
        with torch.device("meta"):
            _META_MODELS[key] = architectures.build(cfg.arch, cfg.model)
    return _META_MODELS[key]


def parent_flops(db: dbm.Database, parent: dict[str, Any]) -> float | None:
    """Training FLOPs spent to produce the parent: those counted step by step when it ran a depth curriculum, else
    its FLOPs per token times its tokens, plus its own parent's when it was itself retrofitted."""
    spent = train_tables.last_metric(db, parent["id"], "train_flops")
    if spent is None:
        if parent.get("flops_per_token") is None or parent.get("tokens_seen") is None:
            return None
        spent = float(parent["flops_per_token"]) * float(parent["tokens_seen"])
    return spent + float(parent.get("parent_flops") or 0.0)


def convert(job: Retrofit, db_path: Path) -> dict[str, Any]:
    """The target's initial state dict, converted from the parent's checkpoint."""
    path = ckpt.run_dir(db_path, job.parent["id"]) / ckpt.CKPT_NAME
    if not path.exists():
        raise CheckpointError(f"--from {job.parent['id']}: its checkpoint {path} is missing")
    parent_model, _, _ = ckpt.load_model(path)
    # built under the run's seed, as training builds it: what the parent cannot provide keeps the target's own init
    with torch.random.fork_rng():
        torch.manual_seed(job.cfg.seed)
        target = architectures.build(job.cfg.arch, job.cfg.model)
    try:
        return retrofit_state(parent_model.state_dict(), target, job.init, job.lora_init or "zero")
    except ValueError as e:
        raise ConfigError(f"cannot convert {job.parent['id']} into {job.cfg.arch}: {e}") from None


def run(
    job: Retrofit,
    prepared: Any,
    db: dbm.Database,
    db_path: Path,
    *,
    progress: Any = True,
    log: Callable[[str], None] = print,
    variant: str | None = None,
) -> Any:
    """Convert and train the retrofitted run (resume it when it has a checkpoint; skip it when done)."""
    if job.parent.get("data_fingerprint") and job.parent["data_fingerprint"] != prepared.fingerprint:
        raise ConfigError(
            f"--from {job.parent['id']}: the parent was trained on other data "
            f"({job.parent['data_fingerprint']}, here {prepared.fingerprint}); its tokenizer would not fit"
        )
    rid = run_id(job.cfg, prepared.fingerprint)
    started = (ckpt.run_dir(db_path, rid) / ckpt.CKPT_NAME).exists()
    state = None if started else convert(job, db_path)
    values = {
        "parent_run_id": job.parent["id"],
        "init_method": job.method,
        "parent_tokens": job.parent.get("tokens_seen"),
        "parent_flops": parent_flops(db, job.parent),
    }
    return train_engine.train_run(
        job.cfg, prepared, db, db_path, progress=progress, log=log, init_state=state, run_values=values, variant=variant
    )
