"""Which runs the report is about and how they group into models.

A report covers one preset. Within it, runs whose configs differ in anything that changes what they compute are
different models, never pooled as seeds. A model is named by its runs' variant name: the name the reported plan gave
them (`plan_runs`), else the name stored with the run (a plan's variant name, or the architecture's name for runs
trained without one). Runs without a usable name (none stored, or one another model already has) get a generated
label: the architecture, plus the keys that differ from its base config (`control [n_layers=8]`). Models are
ordered by the architecture registry, then variants, and every model keeps one colour across all tables and figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

import architectures
from benchctl.core.config import STORIES, make_config, preset_names
from benchctl.core.errors import ConfigError, did_you_mean

# The study's four architectures keep these colours everywhere (colour-blind safe, control in neutral grey);
# other architectures and config variants take EXTRA_COLOURS in a fixed order.
ARCH_COLOURS = {"control": "#4D4D4D", "frailt": "#0173B2", "three-part": "#DE8F05", "relaxed": "#029E73"}
EXTRA_COLOURS = (
    "#CC78BC",
    "#D55E00",
    "#56B4E9",
    "#CA9161",
    "#FBAFE4",
    "#949494",
    "#ECE133",
    "#8C564B",
    "#17BECF",
    "#BCBD22",
)
CONTROL = "control"

# Config keys that do not change what a run computes (how it is logged, where the data was read from) or that are
# the axis being averaged over (seed): runs differing only in these are seeds of one model.
_NOT_MODEL_KEYS = frozenset(
    {"arch", "preset", "seed", "train.log_interval", "train.ckpt_interval", "train.eval_interval", "data.source"}
)


@dataclass
class Context:
    """One preset's runs, split into models (architecture + config variant), in the fixed order with colours."""

    preset: str | None
    runs: pd.DataFrame  # every run of the preset, with `model` and `overrides` columns
    done: pd.DataFrame  # status == done
    models: list[str]  # in display order (architecture order, then variants)
    colours: dict[str, str]
    arch_of: dict[str, str]
    overrides: dict[str, str]  # model -> keys that differ from the preset's defaults ("" when none)
    other_presets: list[tuple[str, int, int]] = field(default_factory=list)  # (preset, done, total)
    plan: str | None = None  # the plan whose variant names the report uses first (None: the names stored with runs)

    _done_by_model: dict[str, pd.DataFrame] | None = field(default=None, init=False, repr=False, compare=False)
    _records_by_model: dict[str, list[dict[str, Any]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def done_models(self) -> list[str]:
        have = set(self.done["model"])
        return [m for m in self.models if m in have]

    def done_of(self, model: str) -> pd.DataFrame:
        """The done runs of one model (empty when it has none). Split once per report: a grid report asks for each
        of its hundred models many times, and a boolean mask over every run per question made that quadratic."""
        if self._done_by_model is None:
            self._done_by_model = {str(m): g for m, g in self.done.groupby("model", sort=False)}
        found = self._done_by_model.get(model)
        return found if found is not None else self.done.iloc[0:0]

    def records_of(self, model: str) -> list[dict[str, Any]]:
        """`done_of(model)` as row dicts, made once per model (a wide frame's rows are slow to convert)."""
        if model not in self._records_by_model:
            self._records_by_model[model] = self.done_of(model).to_dict("records")
        return self._records_by_model[model]

    @property
    def is_paper(self) -> bool:
        return self.preset == "paper"


def choose_preset(runs: pd.DataFrame, preset: str | None) -> tuple[str | None, list[tuple[str, int, int]]]:
    """The requested preset, or the one with most done runs (ties: most runs, then name); plus the others' counts."""
    counts: list[tuple[str, int, int]] = []
    for p, g in runs.groupby("preset", sort=True):
        counts.append((str(p), int((g["status"] == "done").sum()), len(g)))
    if preset is None:
        if not counts:
            return None, []
        chosen = sorted(counts, key=lambda c: (-c[1], -c[2], c[0]))[0][0]
    else:
        known = sorted(set(preset_names()) | {c[0] for c in counts})
        if preset not in known:
            raise ConfigError(f"unknown preset '{preset}'{did_you_mean(preset, known)} known: {', '.join(known)}")
        chosen = preset
    return chosen, [c for c in counts if c[0] != chosen]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def model_keys(config_json: Any) -> dict[str, Any]:
    try:
        raw = json.loads(config_json) if isinstance(config_json, str) else {}
    except json.JSONDecodeError:
        return {"config_json": str(config_json)}
    raw = raw if isinstance(raw, dict) else {}
    if "task" not in raw:  # stored before tasks existed: a stories run, as RunConfig.from_json reads it
        raw = {**raw, "task": {"name": STORIES, "loss": "all"}}
    return {k: v for k, v in _flatten(raw).items() if k not in _NOT_MODEL_KEYS}


def _preset_defaults(preset: str | None, arch: str) -> dict[str, Any] | None:
    try:
        flat = _flatten(make_config(preset or "", arch).to_dict())
        return {k: v for k, v in flat.items() if k not in _NOT_MODEL_KEYS}
    except ConfigError:  # an architecture or preset this benchctl does not know: no defaults to compare with
        return None


def _diff(keys: dict[str, Any], base: dict[str, Any]) -> list[str]:
    def show(v: Any) -> str:
        return "none" if v is None else (json.dumps(v) if isinstance(v, (list, dict)) else str(v))

    return [f"{k}={show(keys.get(k))}" for k in sorted(set(keys) | set(base)) if keys.get(k) != base.get(k)]


def arch_rank(arch: str) -> tuple[int, str]:
    names = architectures.names()
    return (names.index(arch), "") if arch in names else (len(names), arch)


def variant_names(runs: pd.DataFrame, plan_runs: pd.DataFrame | None, plan: str | None) -> dict[str, str]:
    """run id -> the name to show: the plan's variant name for the runs `plan` reached, else the run's stored one."""
    out = {str(i): str(v) for i, v in zip(runs["id"], runs["variant"] if "variant" in runs else []) if _named(v)}
    if plan and plan_runs is not None and not plan_runs.empty:
        mine = plan_runs[plan_runs["plan"] == plan]
        in_plan: dict[str, set[str]] = {}
        for i, v in zip(mine["run_id"], mine["variant"]):
            if _named(v):
                in_plan.setdefault(str(i), set()).add(str(v))
        for i, names in in_plan.items():  # two variants of one plan can be one run: keep its own name if it is one
            out[i] = out[i] if out.get(i) in names else min(names)
    return out


def _named(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def _natural(name: str) -> list[Any]:
    """'frailt-r14' after 'frailt-r8': numbers in a name compare as numbers."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def build_context(
    runs: pd.DataFrame, preset: str | None, plan_runs: pd.DataFrame | None = None, plan: str | None = None
) -> Context:
    """Select a preset's runs and split them into models, named by variant (see the module docstring). Pure: runs
    (and plan_runs) frames in, Context out."""
    chosen, others = choose_preset(runs, preset)
    sel = runs[runs["preset"] == chosen].copy() if chosen is not None else runs.iloc[0:0].copy()
    if plan_runs is not None and not plan_runs.empty:
        plan_runs = plan_runs[plan_runs["preset"] == chosen]
    names = variant_names(sel, plan_runs, plan)
    sel["model"] = sel["arch"].astype(object)
    sel["overrides"] = ""
    groups: list[tuple[str, list[int], str, str]] = []  # (arch, member rows, generated label, overrides)
    for arch in sorted(set(sel["arch"]), key=arch_rank):
        idx = sel.index[sel["arch"] == arch]
        sig = {i: (model_keys(sel.at[i, "config_json"]), str(sel.at[i, "data_fingerprint"] or "")) for i in idx}
        variants: dict[str, tuple[dict[str, Any], str]] = {}
        members: dict[str, list[int]] = {}
        for i, (keys, fp) in sig.items():
            s = json.dumps([keys, fp], sort_keys=True, default=str)
            variants[s] = (keys, fp)
            members.setdefault(s, []).append(i)
        defaults = _preset_defaults(chosen, arch)
        vs_default = {s: ("" if defaults is None else ", ".join(_diff(k, defaults))) for s, (k, _) in variants.items()}
        # The base variant: the preset's defaults if some runs have them, else the one with most runs.
        base = sorted(variants, key=lambda s: (vs_default[s] != "", -len(members[s]), s))[0]
        for s in sorted(variants, key=lambda s: (s != base, s)):
            keys, fp = variants[s]
            if s == base:
                label = arch
            else:
                parts = _diff(keys, variants[base][0])
                if fp != variants[base][1]:
                    parts.append(f"data={fp[:8]}")
                label = f"{arch} [{', '.join(parts)}]"
            groups.append((arch, members[s], label, vs_default[s]))
    ordered: list[tuple[tuple, str]] = []
    arch_of: dict[str, str] = {}
    overrides: dict[str, str] = {}
    for rank, (arch, rows, name) in enumerate(_name_groups(sel, groups, names)):
        sel.loc[rows, "model"] = name
        sel.loc[rows, "overrides"] = groups[rank][3]
        has_variant = name != groups[rank][2]
        # within an architecture: the arch-named model first, then variant names (numbers in order), then labels
        ordered.append(
            ((arch_rank(arch), name != arch, not has_variant, _natural(name) if has_variant else [], rank), name)
        )
        arch_of[name] = arch
        overrides[name] = groups[rank][3]
    models = [name for _, name in sorted(ordered)]
    return Context(
        preset=chosen,
        runs=sel.reset_index(drop=True),
        done=sel[sel["status"] == "done"].reset_index(drop=True),
        models=models,
        colours=colours_for(models, arch_of),
        arch_of=arch_of,
        overrides=overrides,
        other_presets=others,
        plan=plan,
    )


def _name_groups(
    sel: pd.DataFrame, groups: list[tuple[str, list[int], str, str]], names: dict[str, str]
) -> list[tuple[str, list[int], str]]:
    """(arch, rows, name) per group: the variant name all its runs share, when no earlier group claimed it; else the
    generated label (made unique with a suffix should a variant name have taken it)."""
    claimed: set[str] = set()
    chosen: list[str | None] = []
    for _, rows, _, _ in groups:
        found = {names.get(str(sel.at[i, "id"])) for i in rows} - {None}
        name = found.pop() if len(found) == 1 else None
        if name is not None and name in claimed:
            name = None
        chosen.append(name)
        claimed |= {name} if name else set()
    out = []
    for (arch, rows, label, _), name in zip(groups, chosen):
        if name is None:
            name, k = label, 2
            while name in claimed:
                name, k = f"{label} ({k})", k + 1
            claimed.add(name)
        out.append((arch, rows, name))
    return out


def colours_for(models: list[str], arch_of: dict[str, str]) -> dict[str, str]:
    """Fixed colours: the study's four keep theirs; other registered architectures take EXTRA_COLOURS by registry
    position; unregistered architectures and config variants take the colours after those, in display order."""
    extra_registered = [n for n in architectures.names() if n not in ARCH_COLOURS]
    out: dict[str, str] = {}
    k = len(extra_registered)
    for m in models:
        arch = arch_of.get(m, m)
        if m == arch and arch in ARCH_COLOURS:
            out[m] = ARCH_COLOURS[arch]
        elif m == arch and arch in extra_registered:
            out[m] = EXTRA_COLOURS[extra_registered.index(arch) % len(EXTRA_COLOURS)]
        else:
            out[m] = EXTRA_COLOURS[k % len(EXTRA_COLOURS)]
            k += 1
    return out


def study_order(d: dict[str, Any]) -> list[str]:
    """The study's architectures (keys of one of its published tables) in the report's fixed order."""
    return sorted(d, key=arch_rank)
