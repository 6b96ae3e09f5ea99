"""A realistic fixture results.db for tests of the report (and of anything else that reads results.db).

`build_fixture_db(path, ...)` writes, through the stages' tables (the real schema), what a finished study leaves behind:
runs of several architectures x seeds with real configs (`make_config`), run ids (`config.run_id`), parameter
accounting (`accounting.describe`), CPU telemetry; val_loss curves in `metrics` from step 0 to the last step;
prompts, samples and judge grades (with failures and a repeat); lm-eval rows; optionally bench rows. Plus runs that
must stay out of the statistics: one failed and one still running (with metrics of their own), held by the process
that builds the fixture, which is alive as long as the tests that read it.

The numbers are drawn from a seeded generator with per-architecture effects, so tests can recompute every statistic
independently from the rows (never from this module's parameters).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from benchctl import plans, stages
from benchctl.core import accounting, liveness
from benchctl.core import db as dbm
from benchctl.core.config import make_config, run_id
from benchctl.stages.train import tables as train_tables

BUILTIN_PLANS = Path(plans.__file__).parent

STUDY_ARCHS = ("control", "frailt", "three-part", "relaxed")
# Per-architecture effects: final-loss offset, training-time multiple of the control, memory multiple, judge effect.
_EFFECTS = {
    "control": (0.00, 1.00, 1.00, 0.0),
    "frailt": (-0.06, 3.90, 1.30, 0.3),
    "three-part": (-0.09, 4.10, 1.33, 0.5),
    "relaxed": (-0.05, 4.60, 1.55, 0.2),
}
FINGERPRINT = "fp0123456789abcdef"
DATA_SOURCE = "/data/tinystories"
JUDGE_MODEL = "gemini-2.5-flash"
PROMPT_HASH = "ph" + "a" * 62
PROMPT_SET = "pset01"
DEVICE_NAME = "Intel(R) Xeon(R) CPU @ 2.20GHz"


def _rng(*key: object) -> np.random.Generator:
    digest = hashlib.sha256("|".join(map(str, key)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _ts(day: int, second: int) -> str:
    return f"2025-06-{day:02d}T{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}+00:00"


def build_fixture_db(
    path: str | Path,
    *,
    preset: str = "tiny",
    archs: Iterable[str] = STUDY_ARCHS,
    seeds: Iterable[int] = (0, 1, 2),
    curves: bool = True,
    judge: bool = True,
    n_prompts: int = 12,
    judge_repeats: int = 1,
    n_judge_failures: int = 3,
    evals: bool = True,
    ladder: bool = False,
    failed_run: bool = True,
    running_run: bool = True,
    bench: bool = False,
    overrides: dict | None = None,
    device: str = "cpu",
    depth: bool = False,
    infer: bool = False,
    variant: str | None = None,
    run_extra: Callable[[str, int], dict] | None = None,
    infer_extra: Callable[[str, int, str], dict] | None = None,
) -> Path:
    """Write a fixture results.db at `path` (created or added to) and return the path.

    `ladder` adds the accuracies of the two other multiple-choice tasks (with `evals`): tinystories_order well
    above its chance level of 1/2 for every model, tinystories_names at its chance level of 1/4 for every model —
    whole numbers of correct answers out of 200 documents per run, as lm-eval writes them.

    Done runs carry a quiet machine's timing telemetry (CPU time a little under two threads' worth of the wall time,
    one job, load average 1.9); `run_extra(arch, seed)` returns columns that replace a done run's values (a shared
    machine's load, seeds with other times). Inference rows are timed on the same quiet machine, without repeats
    or paired timings; `infer_extra(arch, seed, setting)` returns columns that replace a row's values."""
    path = Path(path)
    db = stages.connect(path)
    archs, seeds = list(archs), list(seeds)
    runs, metrics, samples, grades, evals_rows, depth_rows = [], [], [], [], [], []
    infer_rows: list[dict] = []
    latent_rows: list[dict] = []
    prompts = [
        {
            "id": f"{PROMPT_SET}:{i}",
            "prompt_set": PROMPT_SET,
            "idx": i,
            "text": f"Once upon a time, story {i}",
            "source_story": 10 * i,
            "created_at": _ts(1, 0),
        }
        for i in range(n_prompts)
    ]
    extra = []
    if failed_run and archs:
        extra.append((archs[-1], max(seeds, default=0) + 1, "failed"))
    if running_run and len(archs) > 1:
        extra.append((archs[1], max(seeds, default=0) + 1, "running"))
    order = [(a, s, "done") for a in archs for s in seeds] + extra
    t = 0
    for arch, seed, status in order:
        cfg = make_config(preset, arch, seed, overrides=overrides)
        acc = accounting.describe(cfg)
        rid = run_id(cfg, FINGERPRINT)
        loss_off, time_mul, mem_mul, judge_eff = _EFFECTS.get(arch, (0.0, 2.0, 1.2, 0.0))
        r = _rng("run", arch, seed, preset, tuple(sorted((overrides or {}).items())))
        ln_v = math.log(cfg.model.vocab_size)
        initial = ln_v + 0.02 + 0.01 * r.standard_normal()
        final = 3.20 + loss_off + 0.015 * r.standard_normal()
        max_steps = cfg.train.max_steps
        tps = cfg.tokens_per_step
        train_s = 12.0 * time_mul * (1 + 0.03 * r.standard_normal())
        row = {
            "id": rid,
            "arch": arch,
            "variant": variant or arch,
            "preset": preset,
            "seed": seed,
            "status": status,
            "config_json": cfg.to_json(),
            "data_fingerprint": FINGERPRINT,
            "data_source": DATA_SOURCE,
            "n_params": acc["total_params"],
            "effective_params": acc["effective_params"],
            "flops_per_token": acc["flops_per_token"],
            "max_steps": max_steps,
            "initial_val_loss": initial,
            "device": device,
            "device_name": DEVICE_NAME if device == "cpu" else "NVIDIA GeForce RTX 3070 Laptop GPU",
            "device_count": 1,
            "world_size": 1,
            "torch_version": "2.13.0+cpu",
            "python_version": "3.11.7",
            "benchctl_version": "0.1.0",
            "git_commit": "abc1234",
            "hostname": "host",
            "created_at": _ts(2, t),
            "started_at": _ts(2, t + 1),
        }
        last = max_steps if status == "done" else (max_steps // 3 if status == "running" else max_steps // 2)
        if status == "done":
            row.update(
                {
                    "step": max_steps,
                    "tokens_seen": max_steps * tps,
                    "final_val_loss": final,
                    "train_seconds": train_s,
                    "warmup_seconds": 0.5,
                    "eval_seconds": 1.5,
                    "tokens_per_s": max_steps * tps / train_s,
                    "step_seconds": train_s / max_steps,
                    "peak_rss_bytes": int(450e6 * mem_mul * (1 + 0.01 * r.standard_normal())),
                    "finished_at": _ts(2, t + int(train_s) + 5),
                    "cpu_seconds": 1.9 * train_s,
                    "timed_steps": max_steps,
                    "threads": 2,
                    "concurrent_jobs": 1,
                    "load_avg": 1.9,
                    "baseline_rss_bytes": 300_000_000,
                    "step_mem_bytes": int(40e6 * mem_mul) + seed * 4096,
                }
            )
            if run_extra is not None:
                row.update(run_extra(arch, seed))
            if device == "cuda":
                row.update(
                    {
                        "peak_gpu_mem_bytes": int(1.5e9 * mem_mul),
                        "peak_gpu_reserved_bytes": int(1.7e9 * mem_mul),
                        "peak_nvml_mem_bytes": int(2.0e9 * mem_mul),
                        "driver_version": "550.54",
                        "cuda_version": "12.4",
                    }
                )
        elif status == "failed":
            row.update(
                {
                    "step": last,
                    "error": "RuntimeError: loss is NaN at step 15 | check train.lr",
                    "finished_at": _ts(2, t + 9),
                }
            )
        else:  # still running: held by this very process, so that it reads as alive wherever the fixture is read
            row.update(
                {
                    "step": last,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "pid_started": liveness.process_start_time(os.getpid()),
                    "heartbeat_at": dbm.now(),
                }
            )
        runs.append(row)
        t += 100
        if curves:
            steps = sorted(set(range(0, last + 1, cfg.train.eval_interval)) | {last})
            for st in steps:
                if st == 0:
                    v = initial
                elif status == "done" and st == max_steps:
                    v = final
                else:
                    frac = st / max_steps
                    v = final + (initial - final) * math.exp(-4.0 * frac) + 0.01 * r.standard_normal()
                metrics.append(
                    {
                        "run_id": rid,
                        "step": st,
                        "name": "val_loss",
                        "value": v,
                        "tokens": st * tps,
                        "wall_seconds": st * train_s / max_steps,
                    }
                )
                if st > 0:
                    metrics.append(
                        {
                            "run_id": rid,
                            "step": st,
                            "name": "train_loss",
                            "value": v + 0.05,
                            "tokens": st * tps,
                            "wall_seconds": st * train_s / max_steps,
                        }
                    )
        if status != "done":
            continue
        if judge:
            for p in prompts:
                sid = hashlib.sha256(f"{rid}|{p['id']}".encode()).hexdigest()[:16]
                samples.append(
                    {
                        "id": sid,
                        "run_id": rid,
                        "prompt_id": p["id"],
                        "prompt_set": PROMPT_SET,
                        "completion": f"... and they lived happily ever after ({arch} {seed} {p['idx']}).",
                        "settings_json": '{"temperature": 1.0, "top_k": 50}',
                        "settings_hash": "set01",
                        "temperature": 1.0,
                        "top_k": 50,
                        "top_p": 1.0,
                        "max_new_tokens": 64,
                        "seed": 0,
                        "n_recur": cfg.model.n_recur,
                        "n_tokens": 40,
                        "finish_reason": "eos",
                        "created_at": _ts(3, t),
                    }
                )
                prompt_eff = 0.8 * math.sin(p["idx"])  # some prompts are easier for every model
                for rep in range(judge_repeats):
                    g = _rng("grade", rid, p["id"], rep)
                    crit = {
                        c: int(np.clip(round(3.0 + judge_eff + prompt_eff + g.normal(0, 0.8) + k), 1, 10))
                        for k, c in zip((0.2, 0.3, -0.4, -0.7), ("grammar", "creativity", "consistency", "plot"))
                    }
                    grades.append(
                        {
                            "sample_id": sid,
                            "judge_model": JUDGE_MODEL,
                            "prompt_hash": PROMPT_HASH,
                            "repeat": rep,
                            "status": "ok",
                            **crit,
                            "average": sum(crit.values()) / 4,
                            "finish_reason": "STOP",
                            "raw_text": "{...}",
                            "prompt_tokens": 300,
                            "output_tokens": 30,
                            "thinking_tokens": 0,
                            "created_at": _ts(4, t),
                        }
                    )
        if depth:
            depth_rows += _depth_rows(rid, arch, cfg.model.n_recur, final, seed)
        if infer:
            for ir in _infer_rows(rid, arch, cfg.model.n_recur, seed):
                infer_rows.append({**ir, **(infer_extra(arch, seed, ir["setting"]) if infer_extra else {})})
            latent_rows += _latent_rows(rid, arch, cfg.model.n_recur)
        if evals:
            e = _rng("eval", rid)
            for task, metric, value, stderr in (
                ("tinystories_ending", "acc", 0.40 - loss_off + 0.02 * e.standard_normal(), 0.02),
                ("tinystories_ending", "acc_norm", 0.42 - loss_off + 0.02 * e.standard_normal(), 0.021),
                ("tinystories_ppl", "bits_per_byte", 1.30 + loss_off + 0.01 * e.standard_normal(), None),
            ):
                evals_rows.append(
                    {
                        "run_id": rid,
                        "task": task,
                        "metric": metric,
                        "n_recur": cfg.model.n_recur,
                        "limit_n": 0,
                        "value": value,
                        "stderr": stderr,
                        "n_samples": 200,
                        "task_version": "1.0",
                        "batch_size": 16,
                        "lm_eval_version": "0.4.13",
                        "created_at": _ts(5, t),
                    }
                )
            if ladder:
                evals_rows += _ladder_rows(rid, cfg.model.n_recur, e, _ts(5, t))
    # Failures: the judge's answer could not be parsed; stored, never scored.
    if judge and grades:
        ok = [g for g in grades if g["repeat"] == 0]
        for g in ok[1 : 1 + 7 * n_judge_failures : 7]:
            g.update(
                {
                    "status": "failed",
                    "grammar": None,
                    "creativity": None,
                    "consistency": None,
                    "plot": None,
                    "average": None,
                    "finish_reason": "MAX_TOKENS",
                    "error": "unparseable answer",
                }
            )
    with db.conn:
        db["runs"].insert_all(runs, pk="id", replace=True)
        if metrics:
            db["metrics"].insert_all(metrics, pk=("run_id", "step", "name"), replace=True)
        if judge and samples:
            db["prompts"].insert_all(prompts, pk="id", replace=True)
            db["samples"].insert_all(samples, pk="id", replace=True)
            db["judge_grades"].insert_all(
                grades, pk=("sample_id", "judge_model", "prompt_hash", "repeat"), replace=True
            )
        if evals_rows:
            db["eval_results"].insert_all(
                evals_rows, pk=("run_id", "task", "metric", "n_recur", "limit_n"), replace=True
            )
        if bench:
            db["bench"].insert_all(_bench_rows(preset, archs), pk="id")
        if depth_rows:
            db["depth_results"].insert_all(
                depth_rows, pk=("run_id", "n_recur", "exit_rule", "threshold", "extrapolate", "windows"), replace=True
            )
        if infer_rows:
            db["inference_results"].insert_all(
                infer_rows,
                pk=("run_id", "setting", "prompts", "single", "prompt_tokens", "new_tokens", "windows"),
                replace=True,
            )
        if latent_rows:
            db["inference_latents"].insert_all(latent_rows, pk=("run_id", "sequence", "n_recur"), replace=True)
    db.conn.close()
    return path


def _ladder_rows(rid: str, n_recur: int, e: np.random.Generator, created: str) -> list[dict]:
    n = 200
    rows = []
    for task, metric, correct in (
        ("tinystories_order", "acc", int(e.integers(130, 151))),  # 0.65-0.75: far above 1/2
        ("tinystories_names", "acc", int(e.integers(45, 56))),  # 0.225-0.275: around 1/4
        ("tinystories_names", "acc_norm", int(e.integers(45, 56))),
    ):
        acc = correct / n
        rows.append(
            {
                "run_id": rid,
                "task": task,
                "metric": metric,
                "n_recur": n_recur,
                "limit_n": 0,
                "value": acc,
                "stderr": math.sqrt(acc * (1 - acc) / (n - 1)),
                "n_samples": n,
                "task_version": "1+0123456789ab",
                "batch_size": 16,
                "lm_eval_version": "0.4.13",
                "created_at": created,
            }
        )
    return rows


# Loss change per doubling of depth past the trained one: FraiLT keeps improving, relaxed degrades, three-part
# saturates (the seeds' noise decides), so the report's three verdicts all appear.
_PAST_TRAINED = {"frailt": -0.05, "relaxed": 0.08, "three-part": 0.0}


def _depth_rows(rid: str, arch: str, trained: int, final: float, seed: int) -> list[dict]:
    """depth_results rows: the control at its one depth; recurrent runs at 1..32 and a kl exit at 3 thresholds."""
    import json

    r = _rng("depth", rid)
    final = 3.2  # the same base for every seed: the verdicts then rest on the small per-depth noise only
    base = {
        "run_id": rid,
        "exit_rule": "",
        "threshold": 0.0,
        "windows": 32,
        "tokens": 1024,
        "seconds": 0.5,
        "created_at": _ts(6, seed),
    }
    if arch not in _PAST_TRAINED:
        return [
            {
                **base,
                "n_recur": trained,
                "extrapolate": "",
                "val_loss": final,
                "mean_depth": float(trained),
                "flops_per_token": 1e6,
                "depth_hist": json.dumps({str(trained): 1024}),
            }
        ]
    ext = {"frailt": "last", "relaxed": "cycle"}.get(arch, "")
    rows = []
    for d in sorted({1, 2, 4, 8, 16, 32, trained, 2 * trained}):
        steps = math.log2(d / trained)
        loss = final + (0.3 * -steps if steps < 0 else _PAST_TRAINED[arch] * steps) + 0.001 * r.standard_normal()
        rows.append(
            {
                **base,
                "n_recur": d,
                "extrapolate": ext,
                "val_loss": loss,
                "mean_depth": float(d),
                "flops_per_token": 1e6 * d,
                "depth_hist": json.dumps({str(d): 1024}),
            }
        )
    for thr, mean in ((1e-2, 0.4), (1e-3, 0.7), (1e-4, 0.95)):
        m = mean * trained
        hist = {str(k): int(1024 / trained) for k in range(1, trained + 1)}
        rows.append(
            {
                **base,
                "n_recur": trained,
                "exit_rule": "kl",
                "threshold": thr,
                "extrapolate": ext,
                "val_loss": final + 0.2 * (1 - mean),
                "mean_depth": max(1.0, m),
                "flops_per_token": 1e6 * m,
                "depth_hist": json.dumps(hist),
            }
        )
    return rows


# Inference settings per recurrent architecture: (setting, kind, threshold, kv, draft, FLOPs and KV as a share of
# full depth, loss change, agreement). FraiLT's `last` exit is cheaper and within the margin; relaxed's cheaper
# settings all cost loss; three-part has no cheaper setting at all.
_INFER = {
    "frailt": (
        ("n=trained exit=0.001 rule=kl kv=last", "plain", 1e-3, "last", 0, 0.6, 1.0, 0.001, 0.97),
        ("n=trained exit=0.01 rule=kl kv=first", "plain", 1e-2, "first", 0, 0.4, 0.25, 0.06, 0.8),
        ("speculative draft n=1 k=4", "speculative", 0.0, "full", 1, 1.2, 1.0, 0.0, 1.0),
    ),
    "relaxed": (("n=trained exit=0.01 rule=kl kv=last", "plain", 1e-2, "last", 0, 0.5, 1.0, 0.08, 0.7),),
    "three-part": (("speculative draft n=1 k=4", "speculative", 0.0, "full", 1, 1.3, 1.0, 0.0, 1.0),),
}


def _infer_rows(rid: str, arch: str, trained: int, seed: int) -> list[dict]:
    """inference_results rows: full depth for every run (the control's only row), and the settings above."""
    r = _rng("infer", rid)
    base = {
        "run_id": rid,
        "prompts": 16,
        "single": 4,
        "prompt_tokens": 16,
        "new_tokens": 16,
        "windows": 16,
        "device": "cpu",
        "threads": 2,
        "peak_mem_source": "process-rss",
        "load_avg": 1.9,
        "cores": 2,
        "cpu_share": 0.96,
        "seconds": 3.0,
        "created_at": _ts(7, seed),
    }
    depth = trained if arch in _INFER else 1
    full_flops, full_kv, full_loss = 1e6 * depth, 4096.0 * depth, 3.3 + 0.002 * r.standard_normal()

    def row(setting, kind, thr, kv, draft, flops, kvs, dloss, agree):
        return {
            **base,
            "setting": setting,
            "kind": kind,
            "n_recur": trained,
            "exit_rule": "kl" if thr > 0 else "",
            "exit_threshold": thr,
            "kv": kv,
            "warm_start": 0,
            "draft_n_recur": draft,
            "spec_k": 4 if draft else 0,
            "tokens_per_s_1": 900.0 / (flops * depth) + 10 * r.random(),
            "prefill_tokens_per_s_1": 5000.0,
            "tokens_per_s_batch": 6000.0 / (flops * depth),
            "prefill_tokens_per_s_batch": 20000.0,
            "peak_mem_bytes": 300_000_000,
            "kv_bytes": int(full_kv * kvs * 512 / 1000),
            "kv_bytes_per_1k": full_kv * kvs * 1e3,
            "flops_per_token": full_flops * flops,
            "mean_depth": depth * min(flops, 1.0),
            "val_loss": full_loss + dloss + (0.0005 * r.standard_normal() if dloss else 0.0),
            "val_flops_per_token": full_flops * flops,
            "val_mean_depth": depth * min(flops, 1.0),
            "agreement": agree,
            "proposed": 64 if draft else None,
            "accepted": 40 if draft else None,
            "acceptance_rate": 40 / 64 if draft else None,
            "tokens_json": "[]",
        }

    return [row("full depth", "plain", 0.0, "full", 0, 1.0, 1.0, 0.0, 1.0)] + [row(*s) for s in _INFER.get(arch, ())]


def _latent_rows(rid: str, arch: str, trained: int) -> list[dict]:
    """inference_latents rows for recurrent runs: two windows whose states settle geometrically."""
    import json

    if arch not in _INFER:
        return []
    r = _rng("latent", rid)
    rows = []
    for seq in (0, 1):
        conv = [[float(0.5**i * (1 + 0.1 * r.random())) for _ in range(8)] for i in range(1, trained + 1)]
        traj = [[[float(p + 0.5**i), float(p * 0.1 - 0.5**i)] for i in range(trained + 1)] for p in range(3)]
        rows.append(
            {
                "run_id": rid,
                "sequence": seq,
                "n_recur": trained,
                "tokens": 8,
                "token_ids_json": json.dumps(list(range(8))),
                "convergence_json": json.dumps(conv),
                "positions_json": json.dumps([0, 3, 7]),
                "pca_json": json.dumps(traj),
                "explained": json.dumps([0.7, 0.2]),
                "created_at": _ts(7, seq),
            }
        )
    return rows


def _bench_rows(preset: str, archs: list[str]) -> list[dict]:
    rows = []
    for i, arch in enumerate(archs):
        for impl in ("benchctl", "reference") if arch == "control" else ("benchctl",):
            tps = (9000.0 if impl == "benchctl" else 6000.0) / _EFFECTS.get(arch, (0, 2.0, 0, 0))[1]
            rows.append(
                {
                    "bench_id": "b1",
                    "arch": arch,
                    "preset": preset,
                    "impl": impl,
                    "compiled": 0,
                    "device": "cpu",
                    "device_name": DEVICE_NAME,
                    "steps": 20,
                    "repeats": 3,
                    "tokens_per_step": 512,
                    "tokens_per_s": tps,
                    "tokens_per_s_min": tps * 0.97,
                    "tokens_per_s_max": tps * 1.02,
                    "step_seconds": 512 / tps,
                    "flops_per_token": 1e6 * (i + 1),
                    "achieved_flops": tps * 1e6 * (i + 1),
                    "peak_flops": 1e11,
                    "peak_flops_source": "measured fp32 matmul",
                    "mfu": tps * 1e6 * (i + 1) / 1e11,
                    "peak_mem_bytes": 300_000_000,
                    "torch_version": "2.13.0+cpu",
                    "git_commit": "abc1234",
                    "kernel_seconds": 0.8 * 512 / tps if impl == "benchctl" else 0.5 * 512 / tps,
                    "step_cpu_seconds": 1.9 * 512 / tps,
                    "config_json": make_config(preset, arch, 0).to_json(),
                    "created_at": _ts(6, 0),
                }
            )
    return rows


# The `controls` plan's variants as (name, arch, overrides): the study's four plus three controls.
CONTROLS_VARIANTS = (
    ("control", "control", {}),
    ("frailt", "frailt", {}),
    ("three-part", "three-part", {}),
    ("relaxed", "relaxed", {}),
    ("control-2x", "control", {"model.n_layers": 8}),
    ("control-16", "control", {"model.n_layers": 16}),
    ("control-iso-flops", "control", {"train.max_steps": 101}),
)
# The `depth` plan's frailt and three-part variants.
DEPTH_VARIANTS = tuple(
    [(f"frailt-r{r}", "frailt", {"model.n_recur": r}) for r in (1, 2, 4, 8)]
    + [(f"three-part-r{r}", "three-part", {"model.n_recur": r}) for r in (1, 3, 7, 14)]
)


def build_plan_fixture_db(
    path: str | Path,
    plan: str,
    variants: Iterable[tuple[str, str, dict]],
    *,
    preset: str = "tiny",
    seeds: Iterable[int] = (0, 1, 2),
    record_plan: bool = True,
    **kwargs,
) -> Path:
    """A fixture results.db of a plan's variants (name, arch, overrides) x seeds: each variant's runs named by it
    (the first name wins for a run reached twice, as in training), and plan_runs rows when `record_plan`. Extra
    keyword arguments go to build_fixture_db (judge, evals and the failed and running runs are off by default)."""
    path, seeds = Path(path), list(seeds)
    opts = {"judge": False, "evals": False, "failed_run": False, "running_run": False, **kwargs}
    db = stages.connect(path)
    seen = {r["id"] for r in db.query("select id from runs")}  # a run already stored keeps its first name
    db.conn.close()
    rows = []
    for name, arch, overrides in variants:
        ids = [run_id(make_config(preset, arch, s, overrides=overrides or None), FINGERPRINT) for s in seeds]
        if not set(ids) <= seen:
            build_fixture_db(
                path, preset=preset, archs=[arch], seeds=seeds, overrides=overrides or None, variant=name, **opts
            )
        seen |= set(ids)
        rows += [
            {
                "plan": plan,
                "variant": name,
                "preset": preset,
                "seed": s,
                "run_id": rid,
                "plan_path": str(BUILTIN_PLANS / f"{plan}.toml"),  # as a built-in plan records its file
                "plan_sha256": "ab" * 32,
            }
            for s, rid in zip(seeds, ids)
        ]
    if record_plan:
        db = stages.connect(path)
        train_tables.record_plan_runs(db, rows)
        db.conn.close()
    return path


def train_tiny_runs(root: Path, data_dir: Path, archs: str = "control,frailt") -> Path:
    """Really train `archs` at the tiny preset for 2 steps into `root/results/results.db` (data cached under
    `root/cache`): the finished runs that the stages after training (depth, infer) are tested on. Returns `root`."""
    import pytest

    from benchctl.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
        mp.delenv("BENCHCTL_DB", raising=False)
        with pytest.raises(SystemExit) as exc:
            main(
                ["train-all", "--preset", "tiny", "--archs", archs, "--data", str(data_dir)]
                + ["--db", str(root / "results" / "results.db"), "--set", "train.max_steps=2"]
                + ["--set", "train.warmup_steps=1", "--no-progress", "--yes"]
            )
        assert exc.value.code in (0, None)
    return root
