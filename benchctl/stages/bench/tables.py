"""The table `benchctl bench` writes (bench) and the functions that write and query it."""

from __future__ import annotations

from typing import Any

import sqlite_utils

from benchctl.core.tables import Column, Table

BENCH = Table(
    "bench",
    "Speed benchmarks",
    "One row per architecture and implementation (and batch size, for generation) per `benchctl bench` invocation.",
    (
        Column("id", int, "row id"),
        Column("bench_id", str, "one `benchctl bench` invocation"),
        Column("arch", str, "architecture"),
        Column("preset", str, "named recipe"),
        Column(
            "impl",
            str,
            "train: benchctl, reference (an eager llama2.c copy at benchctl's precision) or reference-fp32 "
            "(that copy in fp32, as llama2.c runs on a CPU); decode: decode (the decode path), decode-reference "
            "(the plain eager generation loop), transformers (LlamaForCausalLM.generate on the hf export) or "
            "llama2c-runfast (llama2.c's run.c built with its Makefile's runfast flags, on the llama2c export)",
        ),
        Column("compiled", int, "1 when torch.compile was on"),
        Column("dtype", str, "the precision the row's step ran in (bfloat16 autocast or float32)"),
        Column("device", str, "device type"),
        Column(
            "device_name",
            str,
            "CPU or GPU model, then cores and threads; a CPU name without a model number gains its family and model",
        ),
        Column("steps", int, "timed steps per repeat", "steps"),
        Column("repeats", int, "repeats (tokens/s is their median)"),
        Column("tokens_per_step", int, "tokens per optimizer step", "tokens"),
        Column("tokens_per_s", float, "throughput, median over repeats (decode: of the decode phase)", "tokens/s"),
        Column("tokens_per_s_min", float, "slowest repeat", "tokens/s"),
        Column("tokens_per_s_max", float, "fastest repeat", "tokens/s"),
        Column("step_seconds", float, "optimizer-step time", "s"),
        Column("step_cpu_seconds", float, "median process CPU time of a step, all threads", "s"),
        Column("flops_per_token", float, "training FLOPs per token", "FLOPs/token"),
        Column("achieved_flops", float, "FLOPs per second achieved", "FLOP/s"),
        Column("peak_flops", float, "the device's peak FLOPs per second", "FLOP/s"),
        Column("peak_flops_source", str, "where the peak comes from (datasheet or measured matmul)"),
        Column("mfu", float, "model FLOPs utilisation: achieved / peak"),
        Column(
            "peak_mem_bytes", int, "parameters + optimizer state + peak growth of torch allocations in a step", "bytes"
        ),
        Column("peak_rss_bytes", int, "the bench process's peak resident set size when the row was written", "bytes"),
        Column("warmup_steps", int, "untimed steps before the repeats", "steps"),
        Column("warmup_seconds", float, "their time (compilation happens there)", "s"),
        Column("load_avg", float, "1-minute load average during the repeats (the machine may be shared)"),
        Column("threads", int, "torch intra-op threads"),
        Column("kernel_seconds", float, "CPU: self time of matmul and attention ops, best of the profiled steps", "s"),
        Column("profiled_step_seconds", float, "that profiled step's wall time, profiler overhead included", "s"),
        Column("note", str, "how memory was measured, thread settings, what the reference is"),
        Column("equivalence_json", str, "control with --check-steps: both loss curves from the same weights"),
        Column("config_json", str, "the resolved configuration"),
        Column("torch_version", str, "PyTorch version"),
        Column("git_commit", str, "benchctl commit"),
        Column("created_at", str, "when it was measured (UTC)"),
        # added with bench --decode (columns are appended: an existing file gains them at the end)
        Column("mode", str, "what was timed: train (the optimizer step) or decode (generation, bench --decode)"),
        Column("batch", int, "decode: rows generated together"),
        Column("prompt_tokens", int, "decode: prompt length of every row", "tokens"),
        Column("new_tokens", int, "decode: new tokens per row (greedy, no stop ids)", "tokens"),
        Column("prefill_tokens_per_s", float, "decode: prompt tokens per second of prefill, median", "tokens/s"),
        Column(
            "agreement",
            float,
            "decode: share of generated tokens equal to the reference path's in float32 (llama2c-runfast: of "
            "the new tokens before the text run.c prints first differs from theirs)",
        ),
        # added with the transformers and run.c rows of bench --decode
        Column(
            "impl_detail",
            str,
            "decode: what ran under the impl's name (library version, run.c's commit and build command, its prompt)",
        ),
    ),
    pk="id",
    backfill={
        "mode": "update bench set mode = 'train' where mode is null",
        # decode rows from before impl_detail: only benchctl's two paths existed
        "impl_detail": "update bench set impl_detail = case impl "
        "when 'decode' then 'benchctl architectures.generate, decode path (fast=True)' "
        "when 'decode-reference' then 'benchctl architectures.generate, reference loop (fast=False)' end "
        "where mode = 'decode'",
    },
    facets=("arch", "impl", "mode"),
    report_where="coalesce(mode, 'train') = 'train'",  # the report's cost and timing read training steps
)

TABLES = (BENCH,)


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`benchctl browse`'s query over the benchmarks, for a file that has them."""
    if "bench" not in columns:
        return {}
    return {
        "bench_history": {
            "title": "Speed benchmark history",
            "description": "Every `benchctl bench` measurement, newest first: throughput (tokens/s), step time "
            "(s), MFU and peak memory (bytes), with the commit and device they were measured on.",
            "sql": """select b.created_at, b.bench_id, b.arch, b.preset, b.impl, b.compiled, b.device_name,
  round(b.tokens_per_s, 1) as tokens_per_s, round(b.step_seconds, 4) as step_seconds, round(b.mfu, 4) as mfu,
  b.peak_mem_bytes, b.threads, round(b.load_avg, 2) as load_avg, b.git_commit, b.torch_version
from bench b order by b.created_at desc, b.bench_id, b.arch, b.impl""",
        }
    }


def record_bench_rows(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """One `benchctl bench` invocation's rows, all or none."""
    with db.atomic():
        db["bench"].insert_all(rows, alter=False)


def bench_configs(db: sqlite_utils.Database, preset: str, device: str) -> list[dict[str, Any]]:
    """(arch, impl, device_name, config_json) of every bench row of a preset on a device type, newest first: what
    `study --bench` checks before benchmarking again."""
    return list(
        db.query(
            "select arch, impl, device_name, config_json from bench where preset = ? and device = ? "
            "and coalesce(mode, 'train') = 'train' "
            "order by created_at desc, id desc",
            [preset, device],
        )
    )
