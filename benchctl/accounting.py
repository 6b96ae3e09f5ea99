"""Parameter and compute accounting per architecture, as plain rows (for `benchctl params` and the report)."""

from __future__ import annotations

from typing import Any

import torch

import architectures
from benchctl import paper
from benchctl.config import RunConfig, make_config

COMPONENTS = ("embedding", "blocks", "depth_encoding", "adapter", "recurrent_norm", "lora", "final_norm")


def describe(cfg: RunConfig) -> dict[str, Any]:
    """One architecture at one config: unique parameters by component, effective, FLOPs/token, study total."""
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = architectures.build(cfg.arch, cfg.model)
    rep = model.param_report()
    row: dict[str, Any] = {"arch": cfg.arch, "preset": cfg.preset}
    for c in COMPONENTS:
        row[c] = rep["components"].get(c, 0)
    extra = {k: v for k, v in rep["components"].items() if k not in COMPONENTS}
    row.update(extra)
    row["total_params"] = rep["total"]
    row["effective_params"] = rep["effective"]
    row["n_recur"] = rep["n_recur"]
    row["effective_depth"] = _effective_depth(cfg)
    row["flops_per_token"] = model.flops_per_token(cfg.model.max_seq_len)
    row["seq_len"] = cfg.model.max_seq_len
    study = paper.TOTAL_PARAMS.get(cfg.arch) if cfg.preset == "paper" else None
    row["paper_total_params"] = study
    row["matches_paper"] = None if study is None else (study == rep["total"])
    return row


def _effective_depth(cfg: RunConfig) -> int:
    """Block applications per token in the schedule (4 for the control, 16 for the paper's recurrent models)."""
    m = cfg.model
    if cfg.arch == "three-part":
        return m.n_prelude + m.n_coda + m.n_recur * (m.n_layers - m.n_prelude - m.n_coda)
    return m.n_layers * m.n_recur


def table(preset: str, archs: list[str] | None = None, overrides: dict[str, Any] | None = None) -> list[dict]:
    names = archs or architectures.names()
    return [describe(make_config(preset, a, overrides=overrides)) for a in names]
