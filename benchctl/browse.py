"""`benchctl browse`: results.db in Datasette, with a title, a description and units for every table and column, and
the queries a user would otherwise write by hand.

The schema itself belongs to `benchctl.core.db` (`db._SCHEMA`); this module only describes it. `COLUMNS` holds one
(description, unit) pair per column and a test checks that it covers exactly the columns of `db._SCHEMA`, so a new
column cannot appear without a description, nor a description outlive its column.

The database is served read-only but live: Datasette opens it with `mode=ro`, which, unlike `immutable=1`, reads the
WAL, so a run still training shows its latest rows; and the write connection Datasette would hand to plugins is
refused (`_ReadOnlyDatabase`), so nothing reachable from a web page can change results.db. Canned queries are built
from the columns the served file actually has (a `variant` column, a `depth_results` table), so one benchctl can
browse databases written by older and newer versions.
"""

from __future__ import annotations

import socket
import threading
import webbrowser
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import uvicorn
from datasette.app import Datasette
from datasette.database import Database

from benchctl.core import db as dbm
from benchctl.core.errors import BenchctlError, DatabaseError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001  # Datasette's own default, so its documentation's URLs keep working
TITLE = "benchctl results"

# Datasette renders these columns' numbers with units through its vendored pint; "token" and "FLOP" are units pint
# does not know. Losses keep their unit in the description only: pint would turn 0.5 nats into "500 mnat".
CUSTOM_UNITS = ["token = [token]", "FLOP = [flop]"]
_PINT = {"s": "s", "bytes": "byte", "FLOPs/token": "FLOP/token", "tokens/s": "token/s", "FLOP/s": "FLOP/s"}

LOSS = "nats/token"

TABLES: dict[str, tuple[str, str]] = {
    "runs": ("Runs", "One row per training run (architecture, preset, seed, data): status, resolved config, losses, "
                     "parameter counts and telemetry. A run's id is a hash of its config and its data."),
    "metrics": ("Training curves", "Long format: one value per (run, step, metric name): val_loss, train_loss, lr, "
                                   "grad_norm, with the tokens seen and the training time at that step."),
    "checkpoints": ("Checkpoints", "Checkpoint files written per run and step (the latest one per path is kept)."),
    "prompts": ("Story beginnings", "The versioned validation-story beginnings every model completes for the judge."),
    "samples": ("Completions", "Generated completions of the story beginnings, with every sampling setting."),
    "judge_requests": ("Judge requests", "Cache of every request to the judge model and its answer, with tokens, "
                                         "attempts and latency, keyed by (judge model, prompt hash, sample, repeat)."),
    "judge_grades": ("Judge grades", "Parsed grades (1-10 per criterion) or failures, per (sample, judge model, "
                                     "prompt hash, repeat). Failed rows are never scores."),
    "eval_results": ("lm-eval results", "One row per (run, task, metric, test-time recurrence, document limit)."),
    "bench": ("Speed benchmarks", "One row per architecture and implementation per `benchctl bench` invocation."),
    "depth_results": ("Test-time depth", "Validation loss per (run, inference depth or adaptive-exit setting, "
                                         "extrapolation rule, windows), from `benchctl depth`."),
    "plan_runs": ("Plan runs", "Which run each study plan's (variant, preset, seed) trained or found already trained, "
                  "with the plan file's path and hash."),
    "meta": ("Schema", "Key-value facts about this database (its schema version)."),
}

_ENV = "as recorded from the training process"
COLUMNS: dict[str, dict[str, tuple[str, str | None]]] = {
    "runs": {
        "id": ("run id: hash of the resolved config and the data fingerprint", None),
        "arch": ("architecture: control, frailt, three-part, relaxed, ...", None),
        "variant": ("the name a study plan gave the run when it was first trained (its architecture without a plan)",
                    None),
        "preset": ("named recipe: paper, small or tiny", None),
        "seed": ("training seed (weights, batches, dropout of recurrence)", None),
        "status": ("pending, running, done or failed", None),
        "config_json": ("the resolved configuration, as JSON", None),
        "data_fingerprint": ("hash of the prepared data's content", None),
        "data_source": ("where the data came from: 'hub' or a path", None),
        "n_params": ("unique (trainable) parameters", "parameters"),
        "effective_params": ("parameters applied per token, recurrence unrolled", "parameters"),
        "flops_per_token": ("training FLOPs per token, forward and backward, recurrence included", "FLOPs/token"),
        "step": ("last completed optimizer step", "steps"),
        "max_steps": ("optimizer steps of the recipe", "steps"),
        "tokens_seen": ("training tokens consumed so far", "tokens"),
        "initial_val_loss": ("validation loss before training (step 0)", LOSS),
        "final_val_loss": ("validation loss at the last step", LOSS),
        "train_seconds": ("time in optimizer steps only (no warm-up/compile, evaluation or checkpoints)", "s"),
        "warmup_seconds": ("untimed first steps (compilation happens there)", "s"),
        "eval_seconds": ("time spent on validation loss evaluations", "s"),
        "tokens_per_s": ("training throughput over the timed steps", "tokens/s"),
        "step_seconds": ("median optimizer-step time", "s"),
        "peak_gpu_mem_bytes": ("peak memory allocated by torch on the GPU", "bytes"),
        "peak_gpu_reserved_bytes": ("peak memory reserved by torch's caching allocator", "bytes"),
        "peak_nvml_mem_bytes": ("peak device memory used, sampled from NVML in a thread", "bytes"),
        "peak_rss_bytes": ("peak resident set size of the training process", "bytes"),
        "gpu_telemetry_note": ("why a GPU reading (NVML memory or utilisation) is absent, when one is", None),
        "dtype": ("the precision train.dtype resolved to on this machine (bfloat16 autocast or float32)", None),
        "precision_reason": ("why that precision: auto or set, and the detected capability (e.g. cpu:avx512_bf16)",
                             None),
        "compiled": ("1 when the training step ran under torch.compile (train.compile as resolved on this machine)",
                     None),
        "compile_reason": ("why compiled or eager: set, or what train.compile=auto found", None),
        "device": ("device type: cpu, cuda, mps", None),
        "device_name": ("CPU or GPU model", None),
        "device_count": ("devices visible to the process", None),
        "world_size": ("processes in the distributed job (1 without torchrun)", None),
        "driver_version": (f"NVIDIA driver version, {_ENV}", None),
        "torch_version": (f"PyTorch version, {_ENV}", None),
        "cuda_version": (f"CUDA version torch was built with, {_ENV}", None),
        "python_version": (f"Python version, {_ENV}", None),
        "benchctl_version": (f"benchctl version, {_ENV}", None),
        "git_commit": ("commit of the benchctl checkout that trained the run", None),
        "hostname": ("machine that trained the run", None),
        "pid": ("process id of the trainer while the run is running", None),
        "error": ("why the run failed (empty otherwise)", None),
        "created_at": ("when the run was first registered (UTC)", None),
        "started_at": ("when training last started or resumed (UTC)", None),
        "finished_at": ("when the run finished or failed (UTC)", None),
        "updated_at": ("last update of this row (UTC)", None),
        "parent_run_id": ("a retrofitted run: the finished run its weights were converted from", None),
        "init_method": ("how the weights were converted: stepwise, average or select (+svd / +zero LoRA init)", None),
        "parent_tokens": ("training tokens the parent run had seen", None),
        "cpu_seconds": ("process CPU time of the timed optimizer steps, all threads (robust to other load)", "s"),
        "cuda_seconds": ("GPU time of the timed optimizer steps between CUDA events (CUDA runs only)", "s"),
        "timed_steps": ("optimizer steps that train_seconds and cpu_seconds cover", "steps"),
        "threads": ("threads the run computed with", None),
        "concurrent_jobs": ("benchctl jobs sharing the machine on purpose while it trained (1: alone)", None),
        "load_avg": ("mean 1-minute load average of the machine during training", None),
        "gpu_util": ("mean NVML GPU utilisation during training (CUDA runs only)", "%"),
        "baseline_rss_bytes": ("process RSS before the model was built; peak minus it is the model's share",
                               "bytes"),
        "parent_flops": ("training FLOPs already spent on the parent run", None),
    },
    "metrics": {
        "run_id": ("the run (runs.id)", None),
        "step": ("optimizer step the value was measured at", "steps"),
        "name": ("val_loss and train_loss (nats/token), lr, grad_norm", None),
        "value": ("the metric's value (losses in nats/token)", None),
        "tokens": ("training tokens seen at that step", "tokens"),
        "wall_seconds": ("training time at that step (optimizer steps only)", "s"),
    },
    "checkpoints": {
        "run_id": ("the run (runs.id)", None),
        "step": ("optimizer step saved", "steps"),
        "path": ("checkpoint file", None),
        "bytes": ("file size", "bytes"),
        "created_at": ("when it was written (UTC)", None),
    },
    "prompts": {
        "id": ("'<prompt_set>:<idx>'", None),
        "prompt_set": ("version of the set: hash of source fingerprint, selection rule and count", None),
        "idx": ("position in the set", None),
        "text": ("the story beginning", None),
        "source_story": ("index of the validation story it was taken from", None),
        "rule": ("selection rule and its version", None),
        "data_fingerprint": ("the prepared data the validation stories came from", None),
        "created_at": ("when it was created (UTC)", None),
    },
    "samples": {
        "id": ("hash of (run, prompt, settings)", None),
        "run_id": ("the model that wrote it (runs.id)", None),
        "prompt_id": ("the story beginning (prompts.id)", None),
        "prompt_set": ("version of the prompt set", None),
        "completion": ("the generated continuation", None),
        "settings_json": ("every sampling setting, as JSON", None),
        "settings_hash": ("hash of the settings", None),
        "temperature": ("sampling temperature", None),
        "top_k": ("top-k cut-off (0 = none)", None),
        "top_p": ("nucleus cut-off (1 = none)", None),
        "max_new_tokens": ("generation limit", "tokens"),
        "seed": ("sampling seed", None),
        "n_recur": ("test-time recurrence that ran", None),
        "batch_size": ("generation batch size (fixes three-part's random initial states)", None),
        "device": ("device type it ran on (samples reproduce on the same type)", None),
        "dtype": ("precision the forward ran in: the run's rule on that device (bfloat16 autocast or float32)", None),
        "n_tokens": ("new tokens, end-of-story token excluded", "tokens"),
        "finish_reason": ("eos or length", None),
        "created_at": ("when it was generated (UTC)", None),
        "extrapolate": ("rule for passes past the trained depth (empty: none applied)", None),
        "exit_rule": ("adaptive exit rule, kl or latent (empty: fixed depth)", None),
        "exit_threshold": ("adaptive exit threshold", None),
        "mean_depth": ("mean exit iteration over the positions processed (adaptive exit)", None),
    },
    "judge_requests": {
        "key": ("'<judge_model>|<prompt_hash>|<sample_id>|<repeat>'", None),
        "judge_model": ("the grading model, e.g. gemini-2.5-flash", None),
        "prompt_hash": ("hash of the judge prompt template (and protocol, for assess)", None),
        "sample_id": ("the graded completion (samples.id)", None),
        "repeat": ("repeat index of the same request", None),
        "request_json": ("the request sent", None),
        "response_json": ("the latest answer received", None),
        "http_status": ("HTTP status of the latest answer", None),
        "attempts": ("calls made for this key, retries included", None),
        "prompt_tokens": ("input tokens billed, over every call", "tokens"),
        "output_tokens": ("output tokens billed, over every call", "tokens"),
        "thinking_tokens": ("thinking tokens billed, over every call", "tokens"),
        "total_tokens": ("all tokens billed, over every call", "tokens"),
        "latency_s": ("latency of the latest call", "s"),
        "status": ("ok or failed (of the latest answer)", None),
        "finish_reason": ("the model's finish reason, e.g. STOP, MAX_TOKENS", None),
        "error": ("why the request failed", None),
        "temperature": ("judge sampling temperature", None),
        "thinking_budget": ("thinking budget sent (empty = the model's default)", "tokens"),
        "max_output_tokens": ("output limit sent", "tokens"),
        "protocol": ("json (grades only) or assess (a general assessment first); empty = json", None),
        "created_at": ("first request (UTC)", None),
        "updated_at": ("latest answer (UTC)", None),
    },
    "judge_grades": {
        "sample_id": ("the graded completion (samples.id)", None),
        "judge_model": ("the grading model", None),
        "prompt_hash": ("hash of the judge prompt template (and protocol, for assess)", None),
        "repeat": ("repeat index", None),
        "status": ("ok or failed; failed rows carry no grades", None),
        "grammar": ("grammar grade", "1-10"),
        "creativity": ("creativity grade", "1-10"),
        "consistency": ("consistency grade", "1-10"),
        "plot": ("plot grade", "1-10"),
        "average": ("mean of the four grades", "1-10"),
        "finish_reason": ("the judge's finish reason", None),
        "raw_text": ("the judge's raw answer", None),
        "error": ("why parsing failed", None),
        "protocol": ("json (grades only) or assess (a general assessment first); empty = json", None),
        "assessment": ("the judge's general assessment of the story (protocol assess)", None),
        "prompt_tokens": ("input tokens of the call", "tokens"),
        "output_tokens": ("output tokens of the call", "tokens"),
        "thinking_tokens": ("thinking tokens of the call", "tokens"),
        "total_tokens": ("all tokens of the call", "tokens"),
        "created_at": ("when it was graded (UTC)", None),
    },
    "eval_results": {
        "run_id": ("the evaluated run (runs.id)", None),
        "task": ("lm-eval task, e.g. tinystories_ppl", None),
        "metric": ("acc, acc_norm, bits_per_byte, word_perplexity, ...", None),
        "n_recur": ("test-time recurrence used", None),
        "limit_n": ("lm-eval --limit (0 = every document)", "documents"),
        "value": ("the metric's value", None),
        "stderr": ("its standard error (empty when lm-eval gives none)", None),
        "n_samples": ("documents evaluated", "documents"),
        "task_version": ("'<task version>+<hash of the documents>'", None),
        "batch_size": ("requests per forward pass (padding can move scores)", None),
        "lm_eval_version": ("lm-eval version", None),
        "created_at": ("when it was computed (UTC)", None),
        "dtype": ("precision the forward ran in: the run's rule on that device (empty: not recorded)", None),
    },
    "depth_results": {
        "run_id": ("the measured run (runs.id)", None),
        "n_recur": ("inference depth (maximum depth with an exit rule)", None),
        "exit_rule": ("kl or latent (empty: fixed depth)", None),
        "threshold": ("exit threshold (0 for a fixed depth)", None),
        "extrapolate": ("rule for iterations past the trained depth (empty: the arch has none)", None),
        "windows": ("validation windows measured (the first N of the fixed set)", None),
        "val_loss": ("mean next-token cross-entropy", None),
        "mean_depth": ("mean exit iteration over tokens (= n_recur at a fixed depth)", None),
        "tokens": ("tokens measured", "tokens"),
        "seconds": ("wall time of the measurement", "s"),
        "flops_per_token": ("forward FLOPs per token (at the mean depth for exit rows)", "FLOPs/token"),
        "depth_hist": ("JSON {depth: tokens} of per-token exit depths", None),
        "created_at": ("when it was measured (UTC)", None),
    },
    "bench": {
        "id": ("row id", None),
        "bench_id": ("one `benchctl bench` invocation", None),
        "arch": ("architecture", None),
        "preset": ("named recipe", None),
        "impl": ("benchctl, reference (an eager llama2.c copy at benchctl's precision) or reference-fp32 (that copy "
                 "in fp32, as llama2.c runs on a CPU)", None),
        "dtype": ("the precision the row's step ran in (bfloat16 autocast or float32)", None),
        "compiled": ("1 when torch.compile was on", None),
        "device": ("device type", None),
        "device_name": ("CPU or GPU model", None),
        "steps": ("timed steps per repeat", "steps"),
        "repeats": ("repeats (tokens/s is their median)", None),
        "tokens_per_step": ("tokens per optimizer step", "tokens"),
        "tokens_per_s": ("throughput, median over repeats", "tokens/s"),
        "tokens_per_s_min": ("slowest repeat", "tokens/s"),
        "tokens_per_s_max": ("fastest repeat", "tokens/s"),
        "step_seconds": ("optimizer-step time", "s"),
        "step_cpu_seconds": ("median process CPU time of a step, all threads", "s"),
        "flops_per_token": ("training FLOPs per token", "FLOPs/token"),
        "achieved_flops": ("FLOPs per second achieved", "FLOP/s"),
        "peak_flops": ("the device's peak FLOPs per second", "FLOP/s"),
        "peak_flops_source": ("where the peak comes from (datasheet or measured matmul)", None),
        "mfu": ("model FLOPs utilisation: achieved / peak", None),
        "peak_mem_bytes": ("parameters + optimizer state + peak growth of torch allocations in a step", "bytes"),
        "peak_rss_bytes": ("the bench process's peak resident set size", "bytes"),
        "warmup_steps": ("untimed steps before the repeats", "steps"),
        "warmup_seconds": ("their time (compilation happens there)", "s"),
        "load_avg": ("1-minute load average during the repeats", None),
        "threads": ("torch intra-op threads", None),
        "kernel_seconds": ("CPU: self time of matmul and attention ops in a profiled step", "s"),
        "profiled_step_seconds": ("that profiled step's wall time, profiler overhead included", "s"),
        "note": ("how memory was measured, thread settings, what the reference is", None),
        "equivalence_json": ("control with --check-steps: both loss curves from the same weights", None),
        "config_json": ("the resolved configuration", None),
        "torch_version": ("PyTorch version", None),
        "git_commit": ("benchctl commit", None),
        "created_at": ("when it was measured (UTC)", None),
    },
    "plan_runs": {
        "plan": ("the plan's name (study, controls, depth or a plan file's own name)", None),
        "variant": ("the variant's name in that plan", None),
        "preset": ("named recipe the plan ran with", None),
        "seed": ("training seed", None),
        "run_id": ("the run it trained, or found trained (possibly under another variant name)", None),
        "plan_path": ("the plan file", None),
        "plan_sha256": ("SHA-256 of the plan file's bytes", None),
        "created_at": ("when the plan first reached this run (UTC)", None),
        "updated_at": ("when the plan last reached this run (UTC)", None),
    },
    "meta": {
        "key": ("fact name, e.g. schema_version", None),
        "value": ("its value", None),
    },
}

_FACETS = {"runs": ["arch", "variant", "preset", "status"], "metrics": ["name"],
           "judge_grades": ["judge_model", "status"], "eval_results": ["task", "metric"], "bench": ["arch", "impl"],
           "samples": ["finish_reason"], "plan_runs": ["plan", "variant", "preset"]}


def describe(table: str, column: str) -> str | None:
    """The column's description with its unit, as Datasette shows it; None for a column benchctl does not know."""
    text, unit = COLUMNS.get(table, {}).get(column, (None, None))
    if text is None:
        return None
    return f"{text} [{unit}]" if unit else text


# ====================================================================================================================
# The database being served


@dataclass(frozen=True)
class Served:
    path: Path
    name: str  # Datasette's name for it: the file name without extension, as in /results/runs
    columns: dict[str, list[str]]  # table -> columns, as found in the file


def check_database(path: str | Path) -> Served:
    """Check that `path` is a benchctl results database and list its tables; DatabaseError (one line) otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not" if p.is_dir() else "does not exist; expected"
        raise DatabaseError(f"{p} {what} a results database; train something first or pass --db PATH")
    columns = dbm.file_columns(p)
    missing = [t for t in ("meta", "runs") if t not in columns]
    if missing:
        raise DatabaseError(f"{p} is an SQLite file but not a benchctl results database (no "
                            f"{' or '.join(missing)} table); pass the results.db that benchctl wrote")
    return Served(path=p.resolve(), name=p.stem, columns=columns)


# ====================================================================================================================
# Canned queries


def canned_queries(served: Served) -> dict[str, dict[str, Any]]:
    """Datasette canned queries over the tables the file has, keyed by their URL name."""
    cols = served.columns
    # Runs are labelled by their variant where the schema has one (several variants can share an architecture).
    label = "coalesce(r.variant, r.arch)" if "variant" in cols["runs"] else "r.arch"
    queries = _run_queries(label)
    queries.update(_stage_queries(cols, label))
    queries["unfinished_runs"] = {
        "title": "Runs not finished",
        "description": "Runs still running, pending or failed, with their progress and error.",
        "sql": """select r.id, r.arch, r.preset, r.seed, r.status, r.step, r.max_steps, r.error, r.hostname,
  r.updated_at from runs r where r.status != 'done' order by r.status, r.updated_at desc""",
    }
    if "depth_results" in cols:
        queries["depth_results"] = _depth_query(cols["depth_results"], label)
    return queries


def _run_queries(label: str) -> dict[str, dict[str, Any]]:
    """Queries over the runs and metrics tables, which every results database has."""
    return {
        "final_losses": {
            "title": "Final validation loss by model",
            "description": "Finished runs grouped by model and preset: seeds, mean, best and worst final "
                           "validation loss (nats/token), and each seed's loss.",
            "sql": f"""select {label} as model, r.preset, count(*) as n_seeds,
  group_concat(r.seed, ',') as seeds,
  avg(r.final_val_loss) as mean_final_val_loss, min(r.final_val_loss) as best_final_val_loss,
  max(r.final_val_loss) as worst_final_val_loss, avg(r.initial_val_loss) as mean_initial_val_loss,
  group_concat(r.seed || ': ' || printf('%.4f', r.final_val_loss), '; ') as final_val_loss_per_seed
from runs r where r.status = 'done'
group by model, r.preset order by r.preset, mean_final_val_loss""",
        },
        "validation_curve": {
            "title": "Validation curve of one run",
            "description": "val_loss (nats/token) of one run by step, with tokens seen and training time: one row "
                           "per point, ready to chart. Run ids are in the runs table.",
            "sql": """select m.step, m.tokens, m.wall_seconds, m.value as val_loss
from metrics m where m.run_id = :run_id and m.name = 'val_loss' order by m.step""",
        },
        "cost_per_model": {
            "title": "Cost per model",
            "description": "Finished runs grouped by model and preset: training time (s), throughput (tokens/s), "
                           "peak memory (bytes), parameters and training FLOPs/token.",
            "sql": f"""select {label} as model, r.preset, count(*) as n_runs,
  avg(r.train_seconds) as mean_train_seconds, avg(r.tokens_per_s) as mean_tokens_per_s,
  avg(r.step_seconds) as mean_step_seconds, max(r.peak_rss_bytes) as max_peak_rss_bytes,
  max(r.peak_gpu_mem_bytes) as max_peak_gpu_mem_bytes, max(r.n_params) as n_params,
  max(r.effective_params) as effective_params, max(r.flops_per_token) as flops_per_token,
  group_concat(distinct r.device_name) as devices
from runs r where r.status = 'done'
group by model, r.preset order by r.preset, mean_train_seconds""",
        },
    }


def _stage_queries(cols: dict[str, list[str]], label: str) -> dict[str, dict[str, Any]]:
    """Queries over what the later stages wrote (judge, eval, bench), for the tables the file has."""
    queries: dict[str, dict[str, Any]] = {}
    if "judge_grades" in cols and "samples" in cols:
        queries["judge_grades_by_model"] = {
            "title": "Judge grades by model and criterion",
            "description": "Mean grade (1-10) per criterion for each model, judge model and judge prompt; failed "
                           "gradings are counted, never scored.",
            "sql": f"""select {label} as model, r.preset, g.judge_model, g.prompt_hash,
  count(distinct r.seed) as n_seeds, sum(g.status = 'ok') as n_graded, sum(g.status != 'ok') as n_failed,
  avg(g.grammar) as grammar, avg(g.creativity) as creativity, avg(g.consistency) as consistency,
  avg(g.plot) as plot, avg(g.average) as average
from judge_grades g join samples s on s.id = g.sample_id join runs r on r.id = s.run_id
group by model, r.preset, g.judge_model, g.prompt_hash order by g.judge_model, r.preset, average desc""",
        }
    if "eval_results" in cols:
        queries["eval_results_by_model"] = {
            "title": "lm-eval results by model",
            "description": "Mean over seeds of every lm-eval metric per model, task, test-time recurrence and "
                           "document limit (0 = all), with the mean standard error.",
            "sql": f"""select {label} as model, r.preset, e.task, e.metric, e.n_recur, e.limit_n,
  count(*) as n_runs, avg(e.value) as mean_value, avg(e.stderr) as mean_stderr, max(e.n_samples) as n_samples
from eval_results e join runs r on r.id = e.run_id
group by model, r.preset, e.task, e.metric, e.n_recur, e.limit_n
order by e.task, e.metric, r.preset, model, e.n_recur""",
        }
    if "bench" in cols:
        queries["bench_history"] = {
            "title": "Speed benchmark history",
            "description": "Every `benchctl bench` measurement, newest first: throughput (tokens/s), step time "
                           "(s), MFU and peak memory (bytes), with the commit and device they were measured on.",
            "sql": """select b.created_at, b.bench_id, b.arch, b.preset, b.impl, b.compiled, b.device_name,
  b.tokens_per_s, b.step_seconds, b.mfu, b.peak_mem_bytes, b.threads, b.load_avg, b.git_commit, b.torch_version
from bench b order by b.created_at desc, b.bench_id, b.arch, b.impl""",
        }
    return queries


def _depth_query(columns: list[str], label: str) -> dict[str, Any]:
    """Every depth_results row, labelled with its run's model and seed when the table is keyed by run."""
    if "run_id" in columns:
        sql = (f"select {label} as model, r.preset, r.seed, d.* from depth_results d "
               "left join runs r on r.id = d.run_id order by model, r.preset, r.seed")
    else:
        sql = "select d.* from depth_results d"
    return {"title": "Depth results", "description": "Results at each test-time depth, per run.", "sql": sql}


# ====================================================================================================================
# Metadata and server


def metadata(served: Served) -> dict[str, Any]:
    """Datasette metadata: titles, descriptions, units and facets per table, and the canned queries."""
    tables: dict[str, Any] = {}
    for table, cols in served.columns.items():
        entry: dict[str, Any] = {}
        if table in TABLES:
            entry["title"], entry["description"] = TABLES[table]
        described = {c: describe(table, c) for c in cols}
        entry["columns"] = {c: d for c, d in described.items() if d}
        units = {c: _PINT[u] for c, (_, u) in COLUMNS.get(table, {}).items() if c in cols and u in _PINT}
        if units:
            entry["units"] = units
        if table in _FACETS:
            entry["facets"] = [c for c in _FACETS[table] if c in cols]
        if entry:
            tables[table] = entry
    return {
        "title": TITLE,
        "description": "Every number benchctl measured: runs, training curves, samples, judge grades, lm-eval "
                       "results and benchmarks. Read-only. Column headers show descriptions and units; the "
                       "canned queries below the tables answer the usual questions.",
        "custom_units": CUSTOM_UNITS,
        "databases": {served.name: {"tables": tables, "queries": canned_queries(served)}},
    }


def url(host: str, port: int, served: Served) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/{served.name}"


def _check_port(host: str, port: int) -> None:
    """Fail with one line before Datasette starts when the address is taken (uvicorn would log and exit)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise BenchctlError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port") from None


class _ReadOnlyDatabase(Database):
    """results.db as Datasette sees it: the write connection it would hand to plugins is refused."""

    def connect(self, write: bool = False):
        if write:
            raise PermissionError("benchctl browse serves results.db read-only")
        return super().connect(write=False)


def app(served: Served):
    """The Datasette instance serving `served` read-only (also what tests can drive without a server)."""
    ds = Datasette(files=[], metadata=metadata(served), settings={"sql_time_limit_ms": 5000})
    ds.remove_database("_memory")  # Datasette adds a scratch database when started without files
    ds.add_database(_ReadOnlyDatabase(ds, path=str(served.path), is_mutable=True), name=served.name)
    return ds


def serve(served: Served, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, open_browser: bool = False,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve until interrupted. `on_ready` runs once the server accepts connections (then the browser opens)."""
    _check_port(host, port)
    ds = app(served)  # Datasette runs its own start-up hooks on the first request
    server = uvicorn.Server(uvicorn.Config(ds.app(), host=host, port=port, log_level="warning", lifespan="on",
                                           workers=1))

    def when_started() -> None:
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            if on_ready is not None:
                on_ready()
            if open_browser:
                webbrowser.open(url(host, port, served))  # False (no browser here) is fine: the URL was printed

    threading.Thread(target=when_started, daemon=True).start()
    server.run()
