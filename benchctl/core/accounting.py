"""Parameter and compute accounting per architecture, as plain rows (for `benchctl params` and the report).

Everything comes from the model itself: the components it reports (embedding first, its own in its order, the
final norm last), the block applications per token and the FLOPs per token. Nothing here names an architecture,
so a new one is accounted for as soon as it is registered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import architectures
from benchctl.core import paper
from benchctl.core.config import RunConfig, make_config, overrides_for

# The components of the study's four models, in table order. Rows carry every component their model reports
# (see `describe` and `component_names`); this tuple is only the order the study's own ones are shown in.
COMPONENTS = ("embedding", "blocks", "depth_encoding", "adapter", "recurrent_norm", "lora", "final_norm")


def describe(cfg: RunConfig) -> dict[str, Any]:
    """One architecture at one config: unique parameters by component, effective, FLOPs/token, study total.

    Each component the model reports is a key of the row (its unique parameter count); `components` lists those
    keys in the model's order, so the component columns of a row add up to `total_params`.
    """
    model = architectures.build_shapes(cfg.arch, cfg.model)
    rep = model.param_report()
    row: dict[str, Any] = {"arch": cfg.arch, "preset": cfg.preset, "components": list(rep["components"])}
    for name, n in rep["components"].items():
        if name in _ROW_FIELDS:  # a component named like a column would overwrite it silently
            raise ValueError(f"{cfg.arch}: component name '{name}' is reserved for the accounting row")
        row[name] = n
    row["total_params"] = rep["total"]
    row["effective_params"] = rep["effective"]
    row["n_recur"] = rep["n_recur"]
    row["effective_depth"] = model.effective_depth()
    row["flops_per_token"] = model.flops_per_token(cfg.train_seq_len)
    row["seq_len"] = cfg.train_seq_len
    study = paper.TOTAL_PARAMS.get(cfg.arch) if cfg.preset == "paper" else None
    row["paper_total_params"] = study
    row["matches_paper"] = None if study is None else (study == rep["total"])
    return row


_ROW_FIELDS = frozenset(
    {
        "arch",
        "preset",
        "components",
        "total_params",
        "effective_params",
        "n_recur",
        "effective_depth",
        "flops_per_token",
        "seq_len",
        "paper_total_params",
        "matches_paper",
    }
)


def training_flops(cfg: RunConfig) -> float:
    """The FLOPs a run's training spends at its trained depth (forward and backward, every step): how much work it
    is, for estimating its time and handing the longest runs out first. The model is built for its shapes only
    (`architectures.build_shapes`), once per architecture and model config."""
    key = json.dumps([cfg.arch, asdict(cfg.model), cfg.train_seq_len], sort_keys=True, default=str)
    if key not in _FLOPS_PER_TOKEN:
        model = architectures.build_shapes(cfg.arch, cfg.model)
        _FLOPS_PER_TOKEN[key] = float(model.flops_per_token(cfg.train_seq_len))
    return _FLOPS_PER_TOKEN[key] * cfg.tokens_per_step * cfg.train.max_steps


_FLOPS_PER_TOKEN: dict[str, float] = {}  # training_flops' cache: (arch, model config) -> FLOPs per token


def component_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every component of the rows, once, in table order: embedding first, final_norm last, the others as met."""
    seen: list[str] = []
    for r in rows:
        listed = r.get("components")
        if isinstance(listed, (list, tuple)):  # a row rebuilt from elsewhere may have no component list
            seen += [c for c in listed if c not in seen]
    head = ["embedding"] if "embedding" in seen else []
    tail = ["final_norm"] if "final_norm" in seen else []
    return head + [c for c in seen if c not in ("embedding", "final_norm")] + tail


def table(preset: str, archs: list[str] | None = None, overrides: dict[str, Any] | None = None) -> list[dict]:
    """One row per architecture (all registered ones by default); an architecture's own key in `overrides`
    applies to the architectures that have it (see `config.overrides_for`)."""
    names = archs or architectures.names()
    return [describe(make_config(preset, a, overrides=overrides_for(a, overrides, names))) for a in names]
