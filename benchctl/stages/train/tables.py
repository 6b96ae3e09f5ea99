"""The tables training owns (runs, metrics, checkpoints, plan_runs) and every function that writes them.

Other stages read runs through the queries here (`get_run`, `runs`, `finished_runs`, ...); only this module writes
these tables. Retrofit's columns of `runs` (the parent run, the init method, what the parent cost) are described
here as well, since a retrofitted run is trained and stored like any other.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from benchctl.core.config import STORIES
from benchctl.core.db import now, retry_locked
from benchctl.core.errors import BenchctlError, CheckpointError, ConfigError, DatabaseError
from benchctl.core.tables import Column, Table

if TYPE_CHECKING:
    import sqlite_utils

_ENV = "as recorded from the training process"
LOSS = "nats/token"

RUNS = Table(
    "runs",
    "Runs",
    "One row per training run (architecture, preset, seed, data): status, resolved config, losses, parameter counts "
    "and telemetry. A run's id is a hash of its config and its data.",
    (
        Column("id", str, "run id: hash of the resolved config and the data fingerprint"),
        Column("arch", str, "architecture: control, frailt, three-part, relaxed, ..."),
        Column(
            "variant",
            str,
            "the name a study plan gave the run when it was first trained (its architecture without a plan)",
        ),
        Column("preset", str, "named recipe: paper, small or tiny"),
        Column("seed", int, "training seed (weights, batches, dropout of recurrence)"),
        Column("status", str, "pending, running, done or failed"),
        Column("config_json", str, "the resolved configuration, as JSON"),
        Column("data_fingerprint", str, "hash of the prepared data's content"),
        Column("data_source", str, "where the data came from: 'hub' or a path"),
        Column("n_params", int, "unique (trainable) parameters", "parameters"),
        Column("effective_params", int, "parameters applied per token, recurrence unrolled", "parameters"),
        Column(
            "flops_per_token",
            float,
            "training FLOPs per token, forward and backward, recurrence included",
            "FLOPs/token",
        ),
        Column("step", int, "last completed optimizer step", "steps"),
        Column("max_steps", int, "optimizer steps of the recipe", "steps"),
        Column("tokens_seen", int, "training tokens consumed so far", "tokens"),
        Column("initial_val_loss", float, "validation loss before training (step 0)", LOSS),
        Column("final_val_loss", float, "validation loss at the last step", LOSS),
        Column(
            "train_seconds", float, "time in optimizer steps only (no warm-up/compile, evaluation or checkpoints)", "s"
        ),
        Column("warmup_seconds", float, "untimed first steps (compilation happens there)", "s"),
        Column("eval_seconds", float, "time spent on validation loss evaluations", "s"),
        Column("tokens_per_s", float, "training throughput over the timed steps", "tokens/s"),
        Column("step_seconds", float, "median optimizer-step time", "s"),
        Column(
            "peak_gpu_mem_bytes",
            int,
            "peak memory allocated by torch on the GPU (torch.cuda.max_memory_allocated)",
            "bytes",
        ),
        Column(
            "peak_gpu_reserved_bytes",
            int,
            "peak memory reserved by torch's caching allocator (torch.cuda.max_memory_reserved)",
            "bytes",
        ),
        Column("peak_nvml_mem_bytes", int, "peak device memory used, sampled from NVML in a thread", "bytes"),
        Column("peak_rss_bytes", int, "peak resident set size of the training process", "bytes"),
        Column("gpu_telemetry_note", str, "why a GPU reading (NVML memory or utilisation) is absent, when one is"),
        Column("device", str, "device type: cpu, cuda, mps"),
        Column("dtype", str, "the precision train.dtype resolved to on this machine (bfloat16 autocast or float32)"),
        Column(
            "precision_reason",
            str,
            "why that precision: auto or set, and the detected capability (e.g. cpu:avx512_bf16)",
        ),
        Column(
            "compiled",
            int,
            "1 when the training step ran under torch.compile (train.compile as resolved on this machine)",
        ),
        Column("compile_reason", str, "why compiled or eager: set, or what train.compile=auto found"),
        Column(
            "device_name",
            str,
            "CPU or GPU model, then cores and threads; a CPU name without a model number gains its family and model",
        ),
        Column("device_count", int, "devices visible to the process"),
        Column("world_size", int, "processes in the distributed job (1 without torchrun)"),
        Column("driver_version", str, f"NVIDIA driver version, {_ENV}"),
        Column("torch_version", str, f"PyTorch version, {_ENV}"),
        Column("cuda_version", str, f"CUDA version torch was built with, {_ENV}"),
        Column("python_version", str, f"Python version, {_ENV}"),
        Column("benchctl_version", str, f"benchctl version, {_ENV}"),
        Column("git_commit", str, "commit of the benchctl checkout that trained the run"),
        Column("hostname", str, "machine that trained the run"),
        Column("pid", int, "process id of the trainer while the run is running"),
        Column(
            "pid_started",
            float,
            "when that process started (seconds since the epoch, as its machine's kernel records it; empty where "
            "unknown): a later process given the same id is not the trainer",
            "s",
        ),
        Column(
            "heartbeat_at",
            str,
            "the trainer's last sign of life (UTC), stamped every 30 s while it trains: a running run without a "
            "recent one, or whose process is gone from its machine, is shown as interrupted",
        ),
        Column("error", str, "why the run failed (empty otherwise)"),
        Column("created_at", str, "when the run was first registered (UTC)"),
        Column("started_at", str, "when training last started or resumed (UTC)"),
        Column("finished_at", str, "when the run finished or failed (UTC)"),
        Column("updated_at", str, "last update of this row (UTC)"),
        # A retrofitted run (`benchctl retrofit`): the run its weights were converted from, how, and what the parent
        # had already cost, so its compute can be compared with training the same architecture from scratch.
        Column("parent_run_id", str, "a retrofitted run: the finished run its weights were converted from"),
        Column(
            "init_method", str, "how the weights were converted: stepwise, average or select (+svd / +zero LoRA init)"
        ),
        Column("parent_tokens", int, "training tokens the parent run had seen"),
        Column("parent_flops", float, "training FLOPs already spent on the parent run"),
        # What a timing needs to be read: the machine may be shared, and jobs may run side by side on purpose.
        Column(
            "cpu_seconds",
            float,
            "process CPU time of the timed optimizer steps, all threads (robust to other load)",
            "s",
        ),
        Column(
            "cuda_seconds", float, "GPU time of the timed optimizer steps between CUDA events (CUDA runs only)", "s"
        ),
        Column("timed_steps", int, "optimizer steps that train_seconds and cpu_seconds cover", "steps"),
        Column("threads", int, "threads the run computed with (BENCHCTL_THREADS from an executor, else torch's)"),
        Column(
            "concurrent_jobs",
            int,
            "benchctl jobs sharing the machine on purpose while it trained (BENCHCTL_CONCURRENT_JOBS; 1: alone)",
        ),
        Column("load_avg", float, "mean 1-minute load average of the machine during training"),
        Column("gpu_util", float, "mean NVML GPU utilisation during training (CUDA runs only)", "%"),
        Column(
            "baseline_rss_bytes",
            int,
            "process RSS before the model was built (a process fact: in one process that trained other runs first, "
            "peak minus it is not the model's memory; step_mem_bytes is)",
            "bytes",
        ),
        Column(
            "step_mem_bytes",
            int,
            "one training step's own memory, as benchctl bench measures it: parameters + optimizer state + the peak "
            "growth of torch's allocations during an optimizer step (CUDA's allocator peak; on a CPU torch's "
            "profiler memory events); empty when not measured",
            "bytes",
        ),
        Column(
            "data_train_tokens",
            int,
            "tokens in the prepared training split the run drew its windows from (epochs = tokens_seen / this)",
            "tokens",
        ),
    ),
    pk="id",
    not_null=("arch", "preset", "seed", "status", "config_json"),
    defaults={"status": "pending"},
    indexes=(("arch", "preset", "seed"),),
    # runs stored before plans existed are named after their architecture, as runs trained without a plan still are
    backfill={"variant": "update runs set variant = arch where variant is null"},
    facets=("arch", "variant", "preset", "status"),
    report_sort=("preset", "arch", "seed", "id"),
)

METRICS = Table(
    "metrics",
    "Training curves",
    "Long format: one value per (run, step, metric name): val_loss, train_loss, lr, grad_norm, train_flops (training "
    "FLOPs spent so far), and for an architecture that reports them its auxiliary loss terms (aux/<name>) and "
    "metrics (arch/<name>), with val_aux/<name> and val_arch/<name> at each evaluation; with the tokens seen and the "
    "training time at that step.",
    (
        Column("run_id", str, "the run (runs.id)"),
        Column("step", int, "optimizer step the value was measured at", "steps"),
        Column("name", str, "val_loss and train_loss (nats/token), lr, grad_norm, train_flops, aux/..., arch/..."),
        Column("value", float, "the metric's value (losses in nats/token)"),
        Column("tokens", int, "training tokens seen at that step", "tokens"),
        Column("wall_seconds", float, "training time at that step (optimizer steps only)", "s"),
    ),
    pk=("run_id", "step", "name"),
    foreign_keys=(("run_id", "runs", "id"),),
    not_null=("value",),
    facets=("name",),
    report_sort=("run_id", "name", "step"),
    # the report draws validation curves, training compute as spent and what adaptive architectures report
    report_where=(
        "name in ('val_loss', 'train_flops') or substr(name, 1, 4) = 'aux/' or substr(name, 1, 5) = 'arch/' "
        "or substr(name, 1, 8) = 'val_aux/' or substr(name, 1, 9) = 'val_arch/'"
    ),
)

CHECKPOINTS = Table(
    "checkpoints",
    "Checkpoints",
    "Checkpoint files written per run and step (the latest one per path is kept).",
    (
        Column("run_id", str, "the run (runs.id)"),
        Column("step", int, "optimizer step saved", "steps"),
        Column("path", str, "checkpoint file"),
        Column("bytes", int, "file size", "bytes"),
        Column("created_at", str, "when it was written (UTC)"),
    ),
    pk=("run_id", "step"),
    foreign_keys=(("run_id", "runs", "id"),),
)

PLAN_RUNS = Table(
    "plan_runs",
    "Plan runs",
    "Which run each study plan's (variant, preset, seed) trained or found already trained, with the plan file's path "
    "and hash.",
    (
        Column("plan", str, "the plan's name (study, controls, depth or a plan file's own name)"),
        Column("variant", str, "the variant's name in that plan"),
        Column("preset", str, "named recipe the plan ran with"),
        Column("seed", int, "training seed"),
        Column("run_id", str, "the run it trained, or found trained (possibly under another variant name)"),
        Column("plan_path", str, "the plan file"),
        Column("plan_sha256", str, "SHA-256 of the plan file's bytes"),
        Column("created_at", str, "when the plan first reached this run (UTC)"),
        Column("updated_at", str, "when the plan last reached this run (UTC)"),
        Column("isoflop_arch", str, "an IsoFLOP plan's run: the plan's architecture entry it is a size of"),
        Column("isoflop_width", int, "an IsoFLOP plan's run: its width (model.dim)"),
        Column(
            "isoflop_budget",
            float,
            "an IsoFLOP plan's run: the training FLOPs its steps were set to spend (analytic count)",
            "FLOPs",
        ),
    ),
    pk=("plan", "variant", "preset", "seed"),
    foreign_keys=(("run_id", "runs", "id"),),
    facets=("plan", "variant", "preset"),
    report_sort=("plan", "preset", "seed", "variant"),
)

TABLES = (RUNS, METRICS, CHECKPOINTS, PLAN_RUNS)


# --------------------------------------------------------------------------------------------------------------------
# Canned queries (`benchctl browse`)


def model_label(columns: dict[str, list[str]]) -> str:
    """SQL naming the model of a run `r` in a canned query: its variant where the file's runs table has one (several
    variants can share an architecture), else its architecture."""
    return "coalesce(r.variant, r.arch)" if "variant" in columns.get("runs", ()) else "r.arch"


def browse_queries(columns: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Queries over the runs and metrics tables, which every results database has. Numbers are rounded: Datasette
    prints a float with all of its digits."""
    if "runs" not in columns:
        return {}
    label = model_label(columns)
    return {
        "runs_overview": {
            "title": "Runs at a glance",
            "summarises": "runs",  # the runs table's page points here (benchctl.browse.SUMMARY_KEY)
            "hide_sql": True,  # the rows are the first screen; "show" unfolds the SQL
            "description": "One row per run, the columns people read first: model, run id (a link to its validation "
            "curve), architecture, preset, seed, status, steps, final and initial validation loss (nats/token), "
            "MFLOP per token, training TFLOP (spent, as recorded, else FLOPs/token x tokens seen), training time "
            "(s) and throughput (tokens/s); the resolved config last, written without spaces so that it stays on one "
            "line to the right instead of making every row a screen tall. Every column is in the runs table.",
            "sql": f"""select {label} as model, r.id as run_id, r.arch, r.preset, r.seed, r.status, r.step, r.max_steps,
  round(r.final_val_loss, 4) as final_val_loss, round(r.initial_val_loss, 4) as initial_val_loss,
  round(r.flops_per_token / 1e6, 3) as mflop_per_token,
  round(coalesce((select m.value from metrics m where m.run_id = r.id and m.name = 'train_flops'
    order by m.step desc limit 1), r.flops_per_token * r.tokens_seen) / 1e12, 4) as train_tflop,
  round(r.train_seconds, 1) as train_seconds, round(r.tokens_per_s, 1) as tokens_per_s,
  replace(replace(r.config_json, ': ', ':'), ', ', ',') as config_json
from runs r order by r.preset, model, r.seed, r.id""",
        },
        "final_losses": {
            "title": "Final validation loss by model",
            "description": "Finished runs grouped by model and preset: seeds, mean, best and worst final "
            "validation loss (nats/token), and each seed's loss.",
            "sql": f"""select {label} as model, r.preset, count(*) as n_seeds,
  group_concat(r.seed, ',') as seeds,
  round(avg(r.final_val_loss), 4) as mean_final_val_loss, round(min(r.final_val_loss), 4) as best_final_val_loss,
  round(max(r.final_val_loss), 4) as worst_final_val_loss,
  round(avg(r.initial_val_loss), 4) as mean_initial_val_loss,
  group_concat(r.seed || ': ' || printf('%.4f', r.final_val_loss), '; ') as final_val_loss_per_seed
from runs r where r.status = 'done'
group by model, r.preset order by r.preset, avg(r.final_val_loss)""",
        },
        "validation_curve": {
            "title": "Validation curve of one run",
            "link_column": "run_id",  # a run id in any query's results links here (benchctl.browse.LINK_KEY)
            "description": "val_loss (nats/token) of one run by step, with tokens seen and training time (s): one "
            "row per point, ready to chart. Every run id in the results of a query (Runs at a glance lists them "
            "all) links here with the id filled in.",
            "sql": """select m.step, m.tokens, round(m.wall_seconds, 2) as wall_seconds, round(m.value, 4) as val_loss
from metrics m where m.run_id = :run_id and m.name = 'val_loss' order by m.step""",
        },
        "cost_per_model": {
            "title": "Cost per model",
            "description": "Finished runs grouped by model and preset: training time (s), throughput (tokens/s), "
            "peak memory (bytes), parameters and training FLOPs/token.",
            "sql": f"""select {label} as model, r.preset, count(*) as n_runs,
  round(avg(r.train_seconds), 1) as mean_train_seconds, round(avg(r.tokens_per_s), 1) as mean_tokens_per_s,
  round(avg(r.step_seconds), 4) as mean_step_seconds, max(r.peak_rss_bytes) as max_peak_rss_bytes,
  max(r.peak_gpu_mem_bytes) as max_peak_gpu_mem_bytes, max(r.n_params) as n_params,
  max(r.effective_params) as effective_params, cast(round(max(r.flops_per_token)) as integer) as flops_per_token,
  group_concat(distinct r.device_name) as devices
from runs r where r.status = 'done'
group by model, r.preset order by r.preset, avg(r.train_seconds)""",
        },
        "unfinished_runs": {
            "title": "Runs not finished",
            "description": "Runs still running, pending or failed, with their progress and error.",
            "sql": """select r.id as run_id, r.arch, r.preset, r.seed, r.status, r.step, r.max_steps, r.error,
  r.hostname, r.updated_at from runs r where r.status != 'done' order by r.status, r.updated_at desc""",
        },
    }


# --------------------------------------------------------------------------------------------------------------------
# Queries: runs


def get_run(db: sqlite_utils.Database, run_id: str) -> dict[str, Any] | None:
    rows = list(db.query("select * from runs where id = ?", [run_id]))
    return rows[0] if rows else None


def update_run(db: sqlite_utils.Database, run_id: str, **values: Any) -> None:
    values["updated_at"] = now()
    with db.atomic():
        db["runs"].update(run_id, values)


def finished_runs(
    db: sqlite_utils.Database,
    *,
    run_ids: Iterable[str] | None = None,
    archs: Iterable[str] | None = None,
    preset: str | None = None,
    bad_selection: type[BenchctlError] = ConfigError,
    none_left: type[BenchctlError] = CheckpointError,
    purpose: str = "to use",
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """The finished runs a stage works on (sample, judge, eval), in registry order of architecture, then seed.

    `run_ids` must all exist and be finished, `archs` must all be registered (`bad_selection` otherwise); an empty
    result is `none_left`. Each command picks the error classes, so their exit codes stay theirs. `kind` keeps
    "stories" runs (TinyStories language modelling) or "tasks" runs (a reasoning task) only; a run of the other kind
    named in `run_ids` is a `bad_selection`.
    """
    import architectures

    run_ids, archs = list(dict.fromkeys(run_ids or [])), list(archs or [])
    for a in archs:
        try:
            architectures.get(a)
        except architectures.UnknownArchitectureError as e:
            raise bad_selection(f"--archs: {e}") from None
    if run_ids:
        found = {r["id"]: r for r in runs(db, ids=run_ids)}
        unknown = [r for r in run_ids if r not in found]
        if unknown:
            raise bad_selection(f"unknown run id(s): {', '.join(unknown)}; list them with 'benchctl runs --wide'")
        unfinished = [f"{i} ({found[i]['status']})" for i in run_ids if found[i]["status"] != "done"]
        if unfinished:
            raise bad_selection(
                f"run(s) not finished: {', '.join(unfinished)}; finish them with 'benchctl train-all' first"
            )
    rows = runs(db, status="done", preset=preset, ids=run_ids)
    if archs:
        rows = [r for r in rows if r["arch"] in archs]
    if kind is not None:
        other = [r["id"] for r in rows if (run_task(r) == STORIES) != (kind == "stories")]
        if other and run_ids:  # asked for by id: a stage that means nothing for them says so
            what = "reasoning-task runs" if kind == "stories" else "TinyStories runs"
            scope = "only means something for TinyStories runs" if kind == "stories" else "scores reasoning-task runs"
            raise bad_selection(f"this command {scope}; {', '.join(other)} are {what}")
        rows = [r for r in rows if r["id"] not in other]
    if not rows:
        scope = ([f"preset '{preset}'"] if preset else []) + ([f"architectures {', '.join(archs)}"] if archs else [])
        where = f" for {' and '.join(scope)}" if scope else ""
        raise none_left(f"no finished runs{where} {purpose} in results.db; run 'benchctl train-all' first")
    order = {n: i for i, n in enumerate(architectures.names())}
    return sorted(rows, key=lambda r: (order.get(r["arch"], len(order)), r["arch"], r["preset"], r["seed"], r["id"]))


def run_task(row: dict[str, Any]) -> str:
    """The task a stored run learned (stories for every run stored before tasks existed)."""
    try:
        section = json.loads(row.get("config_json") or "{}").get("task") or {}
    except json.JSONDecodeError:
        return STORIES
    return str(section.get("name", STORIES)) if isinstance(section, dict) else STORIES


def runs(
    db: sqlite_utils.Database | sqlite3.Connection,
    *,
    status: str | None = None,
    preset: str | None = None,
    ids: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """Runs rows, oldest first. `db` may be a plain read-only connection (`benchctl.core.db.read_only`): a listing
    needs nothing sqlite_utils adds."""
    where, params = [], []
    if status:
        where.append("status = ?")
        params.append(status)
    if preset:
        where.append("preset = ?")
        params.append(preset)
    ids = list(ids or [])
    if ids:
        where.append(f"id in ({','.join('?' * len(ids))})")
        params += ids
    sql = "select * from runs" + (" where " + " and ".join(where) if where else "") + " order by created_at, id"
    cur = db.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur]


def run_ids(db: sqlite_utils.Database | sqlite3.Connection) -> list[str]:
    """Every run's id, oldest first."""
    return [row[0] for row in db.execute("select id from runs order by created_at, id")]


# --------------------------------------------------------------------------------------------------------------------
# Writes: runs, metrics, checkpoints


def start_run(db: sqlite_utils.Database, run: dict[str, Any], *, new: bool, resume_step: int) -> None:
    """A run starts (or restarts) training: its row marked running, and in the same transaction every metric row
    past the checkpoint it resumes from deleted (they belong to a future this run recomputes). A run starting from
    step 0 also forgets any earlier checkpoint rows."""
    rid, stamp = run["id"], now()
    values = {**run, "started_at": stamp, "updated_at": stamp}
    variant = values.pop("variant", None) or run.get("arch")
    with db.atomic():
        if new:
            db["runs"].insert(
                {**values, "variant": variant, "created_at": stamp, "step": 0, "tokens_seen": 0}, alter=True
            )
        else:
            db["runs"].update(rid, values, alter=True)
            _keep_first_variant(db, rid, variant)
        _truncate_metrics_after(db, rid, resume_step)
        if resume_step == 0:
            db.execute("delete from metrics where run_id = ?", [rid])
            db.execute("delete from checkpoints where run_id = ?", [rid])


def _truncate_metrics_after(db: sqlite_utils.Database, run_id: str, step: int) -> None:
    db.execute("delete from metrics where run_id = ? and step > ?", [run_id, step])


def record_metrics(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """Metric rows keyed by (run, step, name): rewriting a step after a resume replaces, never duplicates."""
    if rows:
        with db.atomic():
            db["metrics"].upsert_all(rows, pk=("run_id", "step", "name"))


def record_initial_loss(db: sqlite_utils.Database, run_id: str, value: float, metrics: list[dict[str, Any]]) -> None:
    """The step-0 evaluation: its metric rows and the run's initial loss together."""
    with db.atomic():
        if metrics:
            db["metrics"].upsert_all(metrics, pk=("run_id", "step", "name"))
        db["runs"].update(run_id, {"initial_val_loss": value, "updated_at": now()})


def record_checkpoint(
    db: sqlite_utils.Database,
    run_id: str,
    *,
    step: int,
    path: str,
    size: int,
    metrics: list[dict[str, Any]],
    run_values: dict[str, Any],
) -> None:
    """A checkpoint was written: the metrics up to it, its row (one per path: the file is overwritten in place) and
    the run's progress and telemetry, in one transaction, so a kill never leaves a checkpoint without its rows."""
    stamp = now()
    with db.atomic():
        if metrics:
            db["metrics"].upsert_all(metrics, pk=("run_id", "step", "name"))
        db["checkpoints"].delete_where("run_id = ? and path = ?", [run_id, path])
        db["checkpoints"].insert(
            {"run_id": run_id, "step": step, "path": path, "bytes": size, "created_at": stamp}, replace=True
        )
        db["runs"].update(run_id, {"step": step, "updated_at": stamp, **run_values})


def checkpoint_step(db: sqlite_utils.Database, run_id: str, path: str) -> int | None:
    """The step of the checkpoint recorded at `path` for the run (None: none recorded there)."""
    row = db.execute("select step from checkpoints where run_id = ? and path = ?", [run_id, path]).fetchone()
    return None if row is None else int(row[0])


def incomplete(db: sqlite_utils.Database, run_id: str) -> str | None:
    """What a run lacks to be done, or None: its last step recorded at max_steps, the final checkpoint's row and
    the final validation loss among its metrics. A run is never recorded done without the data that shows it."""
    run = get_run(db, run_id)
    if run is None:
        return "it has no row"
    last = run.get("max_steps")
    if last is None or run.get("step") != last:
        return f"its recorded step is {run.get('step')} of {last}"
    if not db.execute("select 1 from checkpoints where run_id = ? and step = ?", [run_id, last]).fetchone():
        return f"no checkpoint is recorded at step {last}"
    if not db.execute(
        "select 1 from metrics where run_id = ? and step = ? and name = 'val_loss'", [run_id, last]
    ).fetchone():
        return f"no validation loss is recorded at step {last}"
    return None


def finish_run(
    db: sqlite_utils.Database, run_id: str, *, final_val_loss: float, initial_val_loss: float | None
) -> None:
    """The run reached its last step: recorded done, in a transaction that first checks its rows (`incomplete`)."""
    stamp = now()
    with db.atomic():
        missing = incomplete(db, run_id)
        if missing is not None:
            raise DatabaseError(f"run {run_id} cannot be recorded done: {missing}; rerun to train it")
        db["runs"].update(
            run_id,
            {
                "status": "done",
                "final_val_loss": final_val_loss,
                "finished_at": stamp,
                "updated_at": stamp,
                "initial_val_loss": initial_val_loss,
                "pid": None,
            },
            alter=True,
        )


def heartbeat(path: str, run_id: str, pid: int) -> None:
    """The trainer `pid` of a running run is alive: its `heartbeat_at` set to now. A connection of its own, made and
    closed here: the heartbeat thread calls this, and an SQLite connection belongs to the thread that made it.
    A row another process has taken over, or that is no longer running, is left as it is."""
    conn = sqlite3.connect(path, timeout=10.0)
    try:
        with conn:
            conn.execute(
                "update runs set heartbeat_at = ? where id = ? and pid = ? and status = 'running'", [now(), run_id, pid]
            )
    finally:
        conn.close()


def fail_run(db: sqlite_utils.Database, run_id: str, error: str) -> None:
    """The run stopped with an error (or was interrupted): it is no longer owned by a live process."""
    update_run(db, run_id, status="failed", error=error[:2000], pid=None)


def record_gpu_telemetry_note(db: sqlite_utils.Database, run_id: str, note: str | None) -> None:
    """Why some GPU readings of the run are absent (None: all present, or not a GPU run)."""
    with db.atomic():
        db["runs"].update(run_id, {"gpu_telemetry_note": note, "updated_at": now()})


# --------------------------------------------------------------------------------------------------------------------
# ---- retrofit: runs whose weights were converted from a finished run


def retrofit_parent(db: sqlite_utils.Database, ref: str, preset: str | None = None) -> dict[str, Any]:
    """The finished run a retrofit starts from: `ref` is a run id, or an architecture/variant name matched against
    the finished runs (of `preset` when given), which must then be unique."""
    row = get_run(db, ref)
    if row is None:
        # a variant name (when runs record one) or an architecture name
        by_variant = "variant" in db["runs"].columns_dict
        named = "(variant = ? or arch = ?)" if by_variant else "arch = ?"
        sql = f"select * from runs where status = 'done' and {named}" + (" and preset = ?" if preset else "")
        params = [ref] * (2 if by_variant else 1) + ([preset] if preset else [])
        rows = list(db.query(sql + " order by created_at, id", params))
        if not rows:
            raise ConfigError(
                f"--from {ref!r}: no run with that id and no finished run of that name"
                + (f" at preset '{preset}'" if preset else "")
                + "; list them with 'benchctl runs --wide'"
            )
        if len(rows) > 1:
            raise ConfigError(
                f"--from {ref!r} matches {len(rows)} finished runs ({', '.join(r['id'] for r in rows)}); "
                "pass one run id"
            )
        row = rows[0]
    if row["status"] != "done":
        raise ConfigError(f"--from {row['id']}: the run is {row['status']}, not done; finish it first")
    return row


def retrofit_runs(db: sqlite_utils.Database) -> list[dict[str, Any]]:
    """Every run that started from converted weights, oldest first."""
    return list(db.query("select * from runs where parent_run_id is not null order by created_at, id"))


def last_metric(db: sqlite_utils.Database, run_id: str, name: str) -> float | None:
    """The value of a run's metric at its latest step (None when it never recorded it)."""
    row = db.execute(
        "select value from metrics where run_id = ? and name = ? order by step desc limit 1", [run_id, name]
    ).fetchone()
    return None if row is None else float(row[0])


# --------------------------------------------------------------------------------------------------------------------
# ---- plans: run variants and the runs each plan trained


def _keep_first_variant(db: sqlite_utils.Database, run_id: str, variant: str | None) -> None:
    """A run keeps the variant name it was first trained under; one without a name (an older row) takes this one."""
    if variant:
        db.execute("update runs set variant = ? where id = ? and variant is null", [variant, run_id])


def record_plan_runs(db: sqlite_utils.Database, rows: list[dict[str, Any]]) -> None:
    """Which run each (plan, variant, preset, seed) trained, in one transaction. A run reached under a second
    variant name keeps its first in `runs.variant`; this table is how a plan still finds it under its own name."""
    if not rows:
        return
    stamp = now()

    def write() -> None:
        with db.atomic():
            for row in rows:
                prev = next(
                    iter(
                        db.query(
                            "select created_at from plan_runs "
                            "where plan = ? and variant = ? and preset = ? and seed = ?",
                            [row["plan"], row["variant"], row["preset"], row["seed"]],
                        )
                    ),
                    None,
                )
                created = prev["created_at"] if prev else stamp
                db["plan_runs"].upsert(
                    {**row, "created_at": created, "updated_at": stamp}, pk=("plan", "variant", "preset", "seed")
                )
                _keep_first_variant(db, row["run_id"], row["variant"])

    retry_locked(write)


def plan_runs(db: sqlite_utils.Database, plan: str | None = None) -> list[dict[str, Any]]:
    """Every plan_runs row (of one plan), by plan, preset, seed and variant."""
    where, params = ("where plan = ?", [plan]) if plan else ("", [])
    return list(db.query(f"select * from plan_runs {where} order by plan, preset, seed, variant", params))


# --------------------------------------------------------------------------------------------------------------------
# ---- executors: a run trained into its own file

# Every table training (benchctl.stages.train.engine.train_run) writes, parents first; a new one must be listed here so
# runs trained on other machines bring it along (a test trains a run and checks).
RUN_TABLES = ("runs", "metrics", "checkpoints")


def copy_run_rows(src: sqlite_utils.Database, dst: sqlite_utils.Database, run_id: str) -> int:
    """Make `dst` hold exactly `src`'s training rows of `run_id` (RUN_TABLES), in one transaction: how the driver
    of a Ray study takes in a run a worker trained into its own file, and hands a run's history to the worker that
    resumes it. The run row is updated in place (rows of other stages that point at it stay), keeping the first
    variant name `dst` knew it by. Returns the rows copied (0 when `src` does not have the run)."""
    run = get_run(src, run_id)
    if run is None:
        return 0
    copied = 1
    with dst.atomic():
        known = get_run(dst, run_id)
        if known is not None and known.get("variant"):
            run["variant"] = known["variant"]
        dst["runs"].upsert(run, pk="id", alter=True)
        for table in RUN_TABLES[1:]:
            rows = list(src[table].rows_where("run_id = ?", [run_id]))
            dst[table].delete_where("run_id = ?", [run_id])
            if rows:
                dst[table].insert_all(rows, alter=True)
            copied += len(rows)
    return copied
