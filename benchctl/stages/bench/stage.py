"""Stage `bench`: time every architecture's training step with `benchctl bench`, so the report has a clean cost ratio.

Per-run training times are only a cost measure on a quiet machine; bench times every model's step in one process,
taking turns step by step, so other load falls on all of them alike. The stage runs when `study --bench` asks for it,
and by default on a CPU at the small preset, where it takes about a minute. At tiny, a smoke run, it is off unless
asked for: a cost ratio of models that train for seconds says nothing, and timing them would take longer than
training them. It measures the sweep's
architectures (and the control, which every ratio is relative to) once: a preset, device and config already
benchmarked is not measured again. The eager llama2.c reference is left out; `benchctl bench` times it.
Its rows appear in the report's training cost section (the headline ratio) and its Benchmark section.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchctl.core import telemetry
from benchctl.core.config import make_config, overrides_for
from benchctl.core.progress import format_duration
from benchctl.core.runtime import resolve_device
from benchctl.report.context import model_keys
from benchctl.stages import Stage, StudyRun, story_only
from benchctl.stages.bench import engine as B
from benchctl.stages.bench import tables as bench_tables
from benchctl.stages.bench.options import BenchOptions
from benchctl.stages.bench.tables import TABLES, browse_queries

AUTO_PRESETS = ("small",)  # where `study` benches by default on a CPU


def enabled(study: StudyRun, device_type: str) -> tuple[bool, str]:
    """(whether to bench, why not when not)."""
    choice = study.opts.bench
    if choice is not None:
        return choice, "--no-bench"
    if device_type == "cpu" and study.opts.preset in AUTO_PRESETS:
        return True, ""
    return False, f"on by default only on a CPU at {' or '.join(AUTO_PRESETS)}; --bench runs it"


def common_overrides(study: StudyRun, archs: list[str]) -> dict[str, Any]:
    """The study's overrides that apply to every benchmarked architecture (bench takes one set for all of them;
    a model with keys of its own gets no bench ratio in the report, since its config differs)."""
    per_arch = [overrides_for(a, study.opts.overrides, archs) for a in archs]
    return {k: v for k, v in per_arch[0].items() if all(p.get(k) == v for p in per_arch[1:])}


def _key(config_json: Any) -> str:
    return json.dumps(model_keys(config_json), sort_keys=True, default=str)


def run(study: StudyRun) -> None:
    opts = study.opts
    if story_only(study):
        return
    device = resolve_device(study.cfgs[0].train.device)
    on, why = enabled(study, device.type)
    if not on:
        study.say(f"skipped ({why})")
        return
    archs = list(dict.fromkeys(["control", *study.archs]))  # every ratio is relative to the control
    overrides = common_overrides(study, archs)
    wanted = {(a, _key(make_config(opts.preset, a, 0, overrides).to_json())) for a in archs}
    hardware = telemetry.hardware_name(device)
    have = {
        (r["arch"], _key(r["config_json"]))
        for r in bench_tables.bench_configs(study.db, opts.preset, device.type)
        if r["impl"] == "benchctl" and str(r["device_name"] or "").split(" (", 1)[0] == hardware
    }
    if wanted <= have:
        study.say(
            f"{', '.join(archs)} at preset {opts.preset} already benchmarked on this {device.type}; not measured again"
        )
        return
    study.say(f"timing the training step of {', '.join(archs)} (preset {opts.preset}, steps interleaved)")
    t0 = time.perf_counter()
    objs = B.run(BenchOptions(preset=opts.preset, archs=archs, overrides=overrides, reference=False), opts.db_path)
    ratios = ", ".join(f"{o['arch']} {o['cost_ratio']:.2f}" for o in objs if o.get("cost_ratio") is not None)
    study.log(f"   benchmarked in {format_duration(time.perf_counter() - t0)}; cost ratios {ratios}")


STAGE = Stage(name="bench", order=22, run=run, tables=TABLES, queries=browse_queries)
