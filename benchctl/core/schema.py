"""The tables of results.db, as data: columns with their types, primary keys, foreign keys, NOT NULL columns.

`benchctl.core.db` creates and migrates the file from this description (missing tables are created, missing columns
added) and is the only module that writes the tables; `benchctl browse` describes the same columns to users. A
stage that stores something new adds its table or columns here.
"""

from __future__ import annotations

from typing import Any

TABLES: dict[str, dict[str, Any]] = {
    "runs": {
        "columns": {
            "id": str,
            "arch": str,
            "variant": str,  # the name a plan gave the run when it was first trained (the arch name without a plan)
            "preset": str,
            "seed": int,
            "status": str,  # pending | running | done | failed
            "config_json": str,
            "data_fingerprint": str,
            "data_source": str,
            "n_params": int,  # unique parameters
            "effective_params": int,  # parameters applied per token (unrolled)
            "flops_per_token": float,  # training FLOPs per token (fwd + bwd), recurrence included
            "step": int,  # last completed optimizer step
            "max_steps": int,
            "tokens_seen": int,
            "initial_val_loss": float,
            "final_val_loss": float,
            "train_seconds": float,  # optimizer steps only: excludes warm-up/compile, evaluation, checkpoints
            "warmup_seconds": float,
            "eval_seconds": float,
            "tokens_per_s": float,
            "step_seconds": float,  # median optimizer-step time
            "peak_gpu_mem_bytes": int,  # torch.cuda.max_memory_allocated
            "peak_gpu_reserved_bytes": int,  # torch.cuda.max_memory_reserved
            "peak_nvml_mem_bytes": int,  # NVML device memory used, sampled in a thread
            "peak_rss_bytes": int,  # process peak resident set size
            "gpu_telemetry_note": str,  # why a GPU reading (NVML memory, utilisation) is absent, when one is
            "device": str,  # cpu | cuda | ...
            "dtype": str,  # the precision train.dtype resolved to on this machine: bfloat16 (autocast) | float32
            "precision_reason": str,  # why: auto or set, and the detected capability (cpu:avx512_bf16, cuda:sm_86)
            "compiled": int,  # 1 when the training step ran under torch.compile (train.compile resolved here)
            "compile_reason": str,  # why: set, or what auto found (cpu bf16 with a C++ compiler, or why eager)
            "device_name": str,
            "device_count": int,
            "world_size": int,
            "driver_version": str,
            "torch_version": str,
            "cuda_version": str,
            "python_version": str,
            "benchctl_version": str,
            "git_commit": str,
            "hostname": str,
            "pid": int,  # the process training it while status is running
            "error": str,
            "created_at": str,
            "started_at": str,
            "finished_at": str,
            "updated_at": str,
            # a retrofitted run (`benchctl retrofit`): the run its weights were converted from, how, and what the
            # parent had already cost (tokens and training FLOPs), so its compute can be compared with training
            # the same architecture from scratch
            "parent_run_id": str,
            "init_method": str,  # stepwise | average | select, "+svd" / "+zero" for the relaxed LoRA init
            "parent_tokens": int,
            "parent_flops": float,
            # what a timing needs to be read (the machine may be shared; jobs may run side by side on purpose)
            "cpu_seconds": float,  # process CPU time of the same timed steps as train_seconds (every thread)
            "cuda_seconds": float,  # CUDA-event time of those steps (CUDA runs only)
            "timed_steps": int,  # how many optimizer steps train_seconds and cpu_seconds cover
            "threads": int,  # threads the run computed with (BENCHCTL_THREADS from an executor, else torch's)
            "concurrent_jobs": int,  # benchctl jobs sharing the machine on purpose (BENCHCTL_CONCURRENT_JOBS, else 1)
            "load_avg": float,  # mean of the machine's 1-minute load average, sampled during training
            "gpu_util": float,  # mean NVML GPU utilisation during training, percent (CUDA runs only)
            "baseline_rss_bytes": int,  # process RSS before the model was built (interpreter, libraries, data)
        },
        "pk": "id",
        "not_null": {"arch", "preset", "seed", "status", "config_json"},
        "defaults": {"status": "pending"},
    },
    "metrics": {
        "columns": {"run_id": str, "step": int, "name": str, "value": float, "tokens": int, "wall_seconds": float},
        "pk": ("run_id", "step", "name"),
        "foreign_keys": [("run_id", "runs", "id")],
        "not_null": {"value"},
    },
    "checkpoints": {
        "columns": {"run_id": str, "step": int, "path": str, "bytes": int, "created_at": str},
        "pk": ("run_id", "step"),
        "foreign_keys": [("run_id", "runs", "id")],
    },
    "prompts": {
        "columns": {
            "id": str,  # f"{prompt_set}:{idx}"
            "prompt_set": str,  # version id: hash of (source fingerprint, selection rule, n)
            "idx": int,
            "text": str,
            "source_story": int,  # index of the validation story it was taken from
            "rule": str,  # the selection rule and its version, e.g. "opening-sentences-v1"
            "data_fingerprint": str,  # the prepared data the validation stories came from
            "created_at": str,
        },
        "pk": "id",
        "not_null": {"prompt_set", "idx", "text"},
    },
    "samples": {
        "columns": {
            "id": str,  # hash of (run, prompt, settings)
            "run_id": str,
            "prompt_id": str,
            "prompt_set": str,
            "completion": str,
            "settings_json": str,
            "settings_hash": str,
            "temperature": float,
            "top_k": int,
            "top_p": float,
            "max_new_tokens": int,
            "seed": int,
            "n_recur": int,  # the recurrence that ran (the run's trained one unless overridden)
            "batch_size": int,  # fixes the batch composition, hence three-part's random initial states
            "device": str,  # cpu | cuda: samples are reproducible on the same device type
            "dtype": str,  # the precision the forward ran in (the run's rule on that device): bfloat16 | float32
            "n_tokens": int,  # new tokens, the end-of-story token excluded
            "finish_reason": str,  # eos | length
            "created_at": str,
            "extrapolate": str,  # rule for passes past the trained depth (NULL: none applied or the arch has none)
            "exit_rule": str,  # kl | latent with an adaptive exit, else NULL
            "exit_threshold": float,
            "mean_depth": float,  # with an adaptive exit: mean exit iteration over the positions processed
        },
        "pk": "id",
        "foreign_keys": [("run_id", "runs", "id"), ("prompt_id", "prompts", "id")],
        "not_null": {"run_id", "prompt_id", "completion"},
    },
    "judge_requests": {
        "columns": {
            "key": str,  # f"{judge_model}|{prompt_hash}|{sample_id}|{repeat}"
            "judge_model": str,
            "prompt_hash": str,
            "sample_id": str,
            "repeat": int,
            "request_json": str,
            "response_json": str,
            "http_status": int,
            "attempts": int,
            "prompt_tokens": int,
            "output_tokens": int,
            "thinking_tokens": int,
            "total_tokens": int,
            "latency_s": float,
            # tokens and attempts above add up over every call made for the key, across runs
            "status": str,  # ok | failed (of the latest answer)
            "finish_reason": str,
            "error": str,
            "temperature": float,
            "thinking_budget": int,  # NULL = the model's default (none sent)
            "max_output_tokens": int,
            "protocol": str,  # json | assess (NULL: made before protocols existed, i.e. json)
            "created_at": str,
            "updated_at": str,
        },
        "pk": "key",
        "foreign_keys": [("sample_id", "samples", "id")],
    },
    "judge_grades": {
        "columns": {
            "sample_id": str,
            "judge_model": str,
            "prompt_hash": str,
            "repeat": int,
            "status": str,  # ok | failed
            "grammar": int,
            "creativity": int,
            "consistency": int,
            "plot": int,
            "average": float,
            "finish_reason": str,
            "raw_text": str,
            "error": str,
            "protocol": str,  # json | assess (NULL: made before protocols existed, i.e. json)
            "assessment": str,  # the judge's general assessment, written before the grades (protocol assess)
            "prompt_tokens": int,
            "output_tokens": int,
            "thinking_tokens": int,
            "total_tokens": int,
            "created_at": str,
        },
        "pk": ("sample_id", "judge_model", "prompt_hash", "repeat"),
        "foreign_keys": [("sample_id", "samples", "id")],
        "not_null": {"status"},
    },
    "eval_results": {
        "columns": {
            "run_id": str,
            "task": str,
            "metric": str,
            "n_recur": int,  # the recurrence used at evaluation (the trained one unless overridden)
            "limit_n": int,  # lm-eval --limit (0 = all documents)
            "value": float,
            "stderr": float,  # NULL when lm-eval gives "N/A"
            "n_samples": int,
            "task_version": str,
            "batch_size": int,
            "lm_eval_version": str,
            "created_at": str,
            "dtype": str,  # the precision the forward ran in (the run's rule on that device): bfloat16 | float32
        },
        "pk": ("run_id", "task", "metric", "n_recur", "limit_n"),
        "foreign_keys": [("run_id", "runs", "id")],
    },
    "bench": {
        "columns": {
            "id": int,
            "bench_id": str,  # one `benchctl bench` invocation
            "arch": str,
            "preset": str,
            "impl": str,  # benchctl | reference (benchctl's precision) | reference-fp32 (as llama2.c runs on a CPU)
            "compiled": int,
            "dtype": str,  # the precision the row's step ran in: bfloat16 (autocast) | float32
            "device": str,
            "device_name": str,
            "steps": int,
            "repeats": int,
            "tokens_per_step": int,
            "tokens_per_s": float,  # median over repeats
            "tokens_per_s_min": float,
            "tokens_per_s_max": float,
            "step_seconds": float,
            "step_cpu_seconds": float,  # median process CPU time of a step (all threads)
            "flops_per_token": float,
            "achieved_flops": float,
            "peak_flops": float,
            "peak_flops_source": str,
            "mfu": float,
            "peak_mem_bytes": int,  # parameters + optimizer state + peak growth of torch allocations in a step
            "peak_rss_bytes": int,  # the bench process's peak RSS when the row was written
            "warmup_steps": int,  # untimed steps before the repeats (compilation happens there)
            "warmup_seconds": float,
            "load_avg": float,  # 1-minute load average during the repeats (the machine may be shared)
            "threads": int,  # torch intra-op threads
            "kernel_seconds": float,  # CPU: self time of matmul and attention ops, best of 2 profiled steps
            "profiled_step_seconds": float,  # that profiled step's wall time (profiler overhead included)
            "note": str,  # how memory was measured, thread/OpenMP settings, what the reference is
            "equivalence_json": str,  # control row, with --check-steps: both loss curves from the same weights
            "config_json": str,
            "torch_version": str,
            "git_commit": str,
            "created_at": str,
        },
        "pk": "id",
    },
    "depth_results": {
        "columns": {
            "run_id": str,
            "n_recur": int,  # the depth (the maximum depth with an exit rule)
            "exit_rule": str,  # "" for a fixed depth, else kl | latent (part of the key, so never NULL)
            "threshold": float,  # 0 for a fixed depth
            "extrapolate": str,  # rule for iterations past the trained depth ("" when the arch has none)
            "windows": int,  # validation windows measured (the first N of the run's fixed set)
            "val_loss": float,
            "mean_depth": float,  # mean exit iteration over tokens (= n_recur at a fixed depth)
            "tokens": int,
            "seconds": float,
            "flops_per_token": float,  # forward FLOPs/token at n_recur (at the mean depth for exit rows)
            "depth_hist": str,  # JSON {depth: tokens} of per-token exit depths
            "created_at": str,
        },
        "pk": ("run_id", "n_recur", "exit_rule", "threshold", "extrapolate", "windows"),
        "foreign_keys": [("run_id", "runs", "id")],
        "not_null": {"val_loss"},
    },
    "plan_runs": {
        "columns": {
            "plan": str,  # the plan's name
            "variant": str,  # the variant's name in that plan
            "preset": str,
            "seed": int,
            "run_id": str,  # the run it trained (or found already trained, maybe under another variant name)
            "plan_path": str,  # the plan file
            "plan_sha256": str,  # hash of the plan file's bytes
            "created_at": str,
            "updated_at": str,
        },
        "pk": ("plan", "variant", "preset", "seed"),
        "foreign_keys": [("run_id", "runs", "id")],
    },
    "meta": {"columns": {"key": str, "value": str}, "pk": "key"},
}
