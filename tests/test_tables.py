"""The tables of results.db as the stages declare them (benchctl.core.tables, benchctl/stages/<name>/tables.py).

- A fresh database has exactly the schema benchctl wrote before the tables moved into the stages: the same tables,
  columns, types, keys, defaults and indexes, down to the SQL SQLite stores (`EXPECTED_SQL`, taken from a database
  the earlier code created). Changing it changes the stored format; users' queries and older files depend on it.
- Every table and column has a description, each table is owned by one stage, and core's database module imports
  no stage.
- Migration adds a column an older file lacks and fills it where the table says how (runs.variant, bench.mode).
- The report reads every registered table, by name.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from benchctl import report, stages
from benchctl.core.db import META, SCHEMA_VERSION
from tests.conftest import BUILTIN_STAGES

# A fresh database holds every registered stage's tables: an added stage's table is one more here.
pytestmark = pytest.mark.registry


EXPECTED_SQL = {
    "bench": (
        'CREATE TABLE "bench" (\n'
        '   "id" INTEGER PRIMARY KEY,\n'
        '   "bench_id" TEXT,\n'
        '   "arch" TEXT,\n'
        '   "preset" TEXT,\n'
        '   "impl" TEXT,\n'
        '   "compiled" INTEGER,\n'
        '   "dtype" TEXT,\n'
        '   "device" TEXT,\n'
        '   "device_name" TEXT,\n'
        '   "steps" INTEGER,\n'
        '   "repeats" INTEGER,\n'
        '   "tokens_per_step" INTEGER,\n'
        '   "tokens_per_s" REAL,\n'
        '   "tokens_per_s_min" REAL,\n'
        '   "tokens_per_s_max" REAL,\n'
        '   "step_seconds" REAL,\n'
        '   "step_cpu_seconds" REAL,\n'
        '   "flops_per_token" REAL,\n'
        '   "achieved_flops" REAL,\n'
        '   "peak_flops" REAL,\n'
        '   "peak_flops_source" TEXT,\n'
        '   "mfu" REAL,\n'
        '   "peak_mem_bytes" INTEGER,\n'
        '   "peak_rss_bytes" INTEGER,\n'
        '   "warmup_steps" INTEGER,\n'
        '   "warmup_seconds" REAL,\n'
        '   "load_avg" REAL,\n'
        '   "threads" INTEGER,\n'
        '   "kernel_seconds" REAL,\n'
        '   "profiled_step_seconds" REAL,\n'
        '   "note" TEXT,\n'
        '   "equivalence_json" TEXT,\n'
        '   "config_json" TEXT,\n'
        '   "torch_version" TEXT,\n'
        '   "git_commit" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "mode" TEXT,\n'
        '   "batch" INTEGER,\n'
        '   "prompt_tokens" INTEGER,\n'
        '   "new_tokens" INTEGER,\n'
        '   "prefill_tokens_per_s" REAL,\n'
        '   "agreement" REAL,\n'
        '   "impl_detail" TEXT\n'
        ")"
    ),
    "checkpoints": (
        'CREATE TABLE "checkpoints" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "step" INTEGER,\n'
        '   "path" TEXT,\n'
        '   "bytes" INTEGER,\n'
        '   "created_at" TEXT,\n'
        '   PRIMARY KEY ("run_id", "step")\n'
        ")"
    ),
    "accuracy_results": (
        'CREATE TABLE "accuracy_results" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "task" TEXT,\n'
        '   "level" TEXT,\n'
        '   "in_distribution" INTEGER,\n'
        '   "n_recur" INTEGER,\n'
        '   "trained_n_recur" INTEGER,\n'
        '   "problems" INTEGER,\n'
        '   "seed" INTEGER,\n'
        '   "correct" INTEGER,\n'
        '   "accuracy" REAL NOT NULL,\n'
        '   "position_accuracy" REAL,\n'
        '   "answer_loss" REAL,\n'
        '   "by_difficulty" TEXT,\n'
        '   "decode_path" TEXT,\n'
        '   "seconds" REAL,\n'
        '   "created_at" TEXT,\n'
        '   PRIMARY KEY ("run_id", "level", "n_recur", "problems", "seed")\n'
        ")"
    ),
    "depth_results": (
        'CREATE TABLE "depth_results" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "n_recur" INTEGER,\n'
        '   "exit_rule" TEXT,\n'
        '   "threshold" REAL,\n'
        '   "extrapolate" TEXT,\n'
        '   "windows" INTEGER,\n'
        '   "val_loss" REAL NOT NULL,\n'
        '   "mean_depth" REAL,\n'
        '   "tokens" INTEGER,\n'
        '   "seconds" REAL,\n'
        '   "flops_per_token" REAL,\n'
        '   "depth_hist" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   PRIMARY KEY ("run_id", "n_recur", "exit_rule", "threshold", "extrapolate", "windows")\n'
        ")"
    ),
    "eval_results": (
        'CREATE TABLE "eval_results" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "task" TEXT,\n'
        '   "metric" TEXT,\n'
        '   "n_recur" INTEGER,\n'
        '   "limit_n" INTEGER,\n'
        '   "value" REAL,\n'
        '   "stderr" REAL,\n'
        '   "n_samples" INTEGER,\n'
        '   "task_version" TEXT,\n'
        '   "batch_size" INTEGER,\n'
        '   "lm_eval_version" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "dtype" TEXT,\n'
        '   "dtype_reason" TEXT,\n'
        '   PRIMARY KEY ("run_id", "task", "metric", "n_recur", "limit_n")\n'
        ")"
    ),
    "idx_eval_results_task": ('CREATE INDEX "idx_eval_results_task"\n    ON "eval_results" ("task")'),
    "idx_judge_grades_judge_model_prompt_hash": (
        'CREATE INDEX "idx_judge_grades_judge_model_prompt_hash"\n    ON "judge_grades" ("judge_model", "prompt_hash")'
    ),
    "idx_runs_arch_preset_seed": ('CREATE INDEX "idx_runs_arch_preset_seed"\n    ON "runs" ("arch", "preset", "seed")'),
    "idx_samples_run_id": ('CREATE INDEX "idx_samples_run_id"\n    ON "samples" ("run_id")'),
    "judge_grades": (
        'CREATE TABLE "judge_grades" (\n'
        '   "sample_id" TEXT REFERENCES "samples"("id"),\n'
        '   "judge_model" TEXT,\n'
        '   "prompt_hash" TEXT,\n'
        '   "repeat" INTEGER,\n'
        '   "status" TEXT NOT NULL,\n'
        '   "grammar" INTEGER,\n'
        '   "creativity" INTEGER,\n'
        '   "consistency" INTEGER,\n'
        '   "plot" INTEGER,\n'
        '   "average" REAL,\n'
        '   "finish_reason" TEXT,\n'
        '   "raw_text" TEXT,\n'
        '   "error" TEXT,\n'
        '   "protocol" TEXT,\n'
        '   "assessment" TEXT,\n'
        '   "prompt_tokens" INTEGER,\n'
        '   "output_tokens" INTEGER,\n'
        '   "thinking_tokens" INTEGER,\n'
        '   "total_tokens" INTEGER,\n'
        '   "created_at" TEXT,\n'
        '   "backend" TEXT,\n'
        '   "model" TEXT,\n'
        '   "endpoint" TEXT,\n'
        '   "model_revision" TEXT,\n'
        '   PRIMARY KEY ("sample_id", "judge_model", "prompt_hash", "repeat")\n'
        ")"
    ),
    "judge_requests": (
        'CREATE TABLE "judge_requests" (\n'
        '   "key" TEXT PRIMARY KEY,\n'
        '   "judge_model" TEXT,\n'
        '   "prompt_hash" TEXT,\n'
        '   "sample_id" TEXT REFERENCES "samples"("id"),\n'
        '   "repeat" INTEGER,\n'
        '   "request_json" TEXT,\n'
        '   "response_json" TEXT,\n'
        '   "http_status" INTEGER,\n'
        '   "attempts" INTEGER,\n'
        '   "prompt_tokens" INTEGER,\n'
        '   "output_tokens" INTEGER,\n'
        '   "thinking_tokens" INTEGER,\n'
        '   "total_tokens" INTEGER,\n'
        '   "latency_s" REAL,\n'
        '   "status" TEXT,\n'
        '   "finish_reason" TEXT,\n'
        '   "error" TEXT,\n'
        '   "temperature" REAL,\n'
        '   "thinking_budget" INTEGER,\n'
        '   "max_output_tokens" INTEGER,\n'
        '   "protocol" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "updated_at" TEXT,\n'
        '   "seed" INTEGER,\n'
        '   "backend" TEXT,\n'
        '   "model" TEXT,\n'
        '   "endpoint" TEXT,\n'
        '   "model_revision" TEXT\n'
        ")"
    ),
    "meta": ('CREATE TABLE "meta" (\n   "key" TEXT PRIMARY KEY,\n   "value" TEXT\n)'),
    "metrics": (
        'CREATE TABLE "metrics" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "step" INTEGER,\n'
        '   "name" TEXT,\n'
        '   "value" REAL NOT NULL,\n'
        '   "tokens" INTEGER,\n'
        '   "wall_seconds" REAL,\n'
        '   PRIMARY KEY ("run_id", "step", "name")\n'
        ")"
    ),
    "plan_runs": (
        'CREATE TABLE "plan_runs" (\n'
        '   "plan" TEXT,\n'
        '   "variant" TEXT,\n'
        '   "preset" TEXT,\n'
        '   "seed" INTEGER,\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "plan_path" TEXT,\n'
        '   "plan_sha256" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "updated_at" TEXT,\n'
        '   "isoflop_arch" TEXT,\n'
        '   "isoflop_width" INTEGER,\n'
        '   "isoflop_budget" REAL,\n'
        '   PRIMARY KEY ("plan", "variant", "preset", "seed")\n'
        ")"
    ),
    "prompts": (
        'CREATE TABLE "prompts" (\n'
        '   "id" TEXT PRIMARY KEY,\n'
        '   "prompt_set" TEXT NOT NULL,\n'
        '   "idx" INTEGER NOT NULL,\n'
        '   "text" TEXT NOT NULL,\n'
        '   "source_story" INTEGER,\n'
        '   "rule" TEXT,\n'
        '   "data_fingerprint" TEXT,\n'
        '   "created_at" TEXT\n'
        ")"
    ),
    "runs": (
        'CREATE TABLE "runs" (\n'
        '   "id" TEXT PRIMARY KEY,\n'
        '   "arch" TEXT NOT NULL,\n'
        '   "variant" TEXT,\n'
        '   "preset" TEXT NOT NULL,\n'
        '   "seed" INTEGER NOT NULL,\n'
        "   \"status\" TEXT NOT NULL DEFAULT 'pending',\n"
        '   "config_json" TEXT NOT NULL,\n'
        '   "data_fingerprint" TEXT,\n'
        '   "data_source" TEXT,\n'
        '   "n_params" INTEGER,\n'
        '   "effective_params" INTEGER,\n'
        '   "flops_per_token" REAL,\n'
        '   "step" INTEGER,\n'
        '   "max_steps" INTEGER,\n'
        '   "tokens_seen" INTEGER,\n'
        '   "initial_val_loss" REAL,\n'
        '   "final_val_loss" REAL,\n'
        '   "train_seconds" REAL,\n'
        '   "warmup_seconds" REAL,\n'
        '   "eval_seconds" REAL,\n'
        '   "tokens_per_s" REAL,\n'
        '   "step_seconds" REAL,\n'
        '   "peak_gpu_mem_bytes" INTEGER,\n'
        '   "peak_gpu_reserved_bytes" INTEGER,\n'
        '   "peak_nvml_mem_bytes" INTEGER,\n'
        '   "peak_rss_bytes" INTEGER,\n'
        '   "gpu_telemetry_note" TEXT,\n'
        '   "device" TEXT,\n'
        '   "dtype" TEXT,\n'
        '   "precision_reason" TEXT,\n'
        '   "compiled" INTEGER,\n'
        '   "compile_reason" TEXT,\n'
        '   "device_name" TEXT,\n'
        '   "device_count" INTEGER,\n'
        '   "world_size" INTEGER,\n'
        '   "driver_version" TEXT,\n'
        '   "torch_version" TEXT,\n'
        '   "cuda_version" TEXT,\n'
        '   "python_version" TEXT,\n'
        '   "benchctl_version" TEXT,\n'
        '   "git_commit" TEXT,\n'
        '   "hostname" TEXT,\n'
        '   "pid" INTEGER,\n'
        '   "pid_started" REAL,\n'
        '   "heartbeat_at" TEXT,\n'
        '   "error" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "started_at" TEXT,\n'
        '   "finished_at" TEXT,\n'
        '   "updated_at" TEXT,\n'
        '   "parent_run_id" TEXT,\n'
        '   "init_method" TEXT,\n'
        '   "parent_tokens" INTEGER,\n'
        '   "parent_flops" REAL,\n'
        '   "cpu_seconds" REAL,\n'
        '   "cuda_seconds" REAL,\n'
        '   "timed_steps" INTEGER,\n'
        '   "threads" INTEGER,\n'
        '   "concurrent_jobs" INTEGER,\n'
        '   "load_avg" REAL,\n'
        '   "gpu_util" REAL,\n'
        '   "baseline_rss_bytes" INTEGER,\n'
        '   "step_mem_bytes" INTEGER,\n'
        '   "data_train_tokens" INTEGER\n'
        ")"
    ),
    "inference_results": (
        'CREATE TABLE "inference_results" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "setting" TEXT,\n'
        '   "prompts" INTEGER,\n'
        '   "single" INTEGER,\n'
        '   "prompt_tokens" INTEGER,\n'
        '   "new_tokens" INTEGER,\n'
        '   "windows" INTEGER,\n'
        '   "kind" TEXT,\n'
        '   "n_recur" INTEGER,\n'
        '   "exit_rule" TEXT,\n'
        '   "exit_threshold" REAL,\n'
        '   "kv" TEXT,\n'
        '   "warm_start" INTEGER,\n'
        '   "draft_n_recur" INTEGER,\n'
        '   "spec_k" INTEGER,\n'
        '   "device" TEXT,\n'
        '   "threads" INTEGER,\n'
        '   "tokens_per_s_1" REAL,\n'
        '   "prefill_tokens_per_s_1" REAL,\n'
        '   "tokens_per_s_batch" REAL,\n'
        '   "prefill_tokens_per_s_batch" REAL,\n'
        '   "peak_mem_bytes" INTEGER,\n'
        '   "peak_mem_source" TEXT,\n'
        '   "kv_bytes" INTEGER,\n'
        '   "kv_bytes_per_1k" REAL,\n'
        '   "flops_per_token" REAL,\n'
        '   "mean_depth" REAL,\n'
        '   "mean_exit_depth" REAL,\n'
        '   "val_loss" REAL NOT NULL,\n'
        '   "val_flops_per_token" REAL,\n'
        '   "val_mean_depth" REAL,\n'
        '   "agreement" REAL,\n'
        '   "proposed" INTEGER,\n'
        '   "accepted" INTEGER,\n'
        '   "acceptance_rate" REAL,\n'
        '   "tokens_json" TEXT,\n'
        '   "seconds" REAL,\n'
        '   "created_at" TEXT,\n'
        '   "repeats" INTEGER,\n'
        '   "tokens_per_s_1_min" REAL,\n'
        '   "tokens_per_s_1_max" REAL,\n'
        '   "tokens_per_s_batch_min" REAL,\n'
        '   "tokens_per_s_batch_max" REAL,\n'
        '   "speedup_1" REAL,\n'
        '   "speedup_1_min" REAL,\n'
        '   "speedup_1_max" REAL,\n'
        '   "speedup_batch" REAL,\n'
        '   "speedup_batch_min" REAL,\n'
        '   "speedup_batch_max" REAL,\n'
        '   "speedups_json" TEXT,\n'
        '   "load_avg" REAL,\n'
        '   "cores" INTEGER,\n'
        '   "cpu_share" REAL,\n'
        '   PRIMARY KEY ("run_id", "setting", "prompts", "single", "prompt_tokens", "new_tokens", "windows")\n'
        ")"
    ),
    "inference_latents": (
        'CREATE TABLE "inference_latents" (\n'
        '   "run_id" TEXT REFERENCES "runs"("id"),\n'
        '   "sequence" INTEGER,\n'
        '   "n_recur" INTEGER,\n'
        '   "tokens" INTEGER,\n'
        '   "token_ids_json" TEXT,\n'
        '   "convergence_json" TEXT NOT NULL,\n'
        '   "positions_json" TEXT,\n'
        '   "pca_json" TEXT,\n'
        '   "explained" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   PRIMARY KEY ("run_id", "sequence", "n_recur")\n'
        ")"
    ),
    "samples": (
        'CREATE TABLE "samples" (\n'
        '   "id" TEXT PRIMARY KEY,\n'
        '   "run_id" TEXT NOT NULL REFERENCES "runs"("id"),\n'
        '   "prompt_id" TEXT NOT NULL REFERENCES "prompts"("id"),\n'
        '   "prompt_set" TEXT,\n'
        '   "completion" TEXT NOT NULL,\n'
        '   "settings_json" TEXT,\n'
        '   "settings_hash" TEXT,\n'
        '   "temperature" REAL,\n'
        '   "top_k" INTEGER,\n'
        '   "top_p" REAL,\n'
        '   "max_new_tokens" INTEGER,\n'
        '   "seed" INTEGER,\n'
        '   "n_recur" INTEGER,\n'
        '   "batch_size" INTEGER,\n'
        '   "device" TEXT,\n'
        '   "dtype" TEXT,\n'
        '   "n_tokens" INTEGER,\n'
        '   "finish_reason" TEXT,\n'
        '   "created_at" TEXT,\n'
        '   "extrapolate" TEXT,\n'
        '   "exit_rule" TEXT,\n'
        '   "exit_threshold" REAL,\n'
        '   "mean_depth" REAL,\n'
        '   "dtype_reason" TEXT,\n'
        '   "decode" TEXT\n'
        ")"
    ),
}


def _schema_sql(path) -> dict[str, str]:
    """The stored SQL of every table and index the built-in stages make (a stage added beside them, like the
    extension guide's example, adds its own objects; they are not part of this pin)."""
    conn = sqlite3.connect(path)
    try:
        sql = dict(conn.execute("select name, sql from sqlite_master where sql is not null"))
    finally:
        conn.close()
    builtin = {t.name for s in stages.registered() if s.name in BUILTIN_STAGES for t in s.tables} | {"meta"}
    return {k: v for k, v in sql.items() if k in builtin or any(k.startswith(f"idx_{t}_") for t in builtin)}


def test_a_fresh_database_has_the_schema_benchctl_always_wrote(tmp_path):
    db = stages.connect(tmp_path / "results.db")
    assert db.execute("select value from meta where key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    db.conn.close()
    assert _schema_sql(tmp_path / "results.db") == EXPECTED_SQL
    stages.connect(tmp_path / "results.db").conn.close()  # opening it again changes nothing
    assert _schema_sql(tmp_path / "results.db") == EXPECTED_SQL


def test_every_table_and_column_is_described():
    tables = (*stages.tables(), META)
    for table in tables:
        assert table.title.strip() and table.description.strip(), f"{table.name}: no title or description"
        for col in table.columns:
            assert col.description.strip(), f"{table.name}.{col.name}: empty description"
            assert col.type in (str, int, float), f"{table.name}.{col.name}: type {col.type!r}"
    owners = {t.name: s.name for s in stages.registered() if s.name in BUILTIN_STAGES for t in s.tables}
    assert owners == {
        "runs": "train",
        "metrics": "train",
        "checkpoints": "train",
        "plan_runs": "train",
        "bench": "bench",
        "prompts": "sample",
        "samples": "sample",
        "judge_requests": "judge",
        "judge_grades": "judge",
        "eval_results": "eval",
        "accuracy_results": "accuracy",
        "depth_results": "depth",
        "inference_results": "infer",
        "inference_latents": "infer",
    }
    order = [t.name for t in stages.tables()]
    for table in stages.tables():  # created parents first: a foreign key points at a table made before it
        for _col, other, _other_col in table.foreign_keys:
            assert order.index(other) < order.index(table.name), f"{table.name} -> {other}"


def test_core_db_imports_no_stage():
    code = "import sys, benchctl.core.db; print(sorted(m for m in sys.modules if m.startswith('benchctl.stages')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_migration_adds_a_missing_column_and_backfills_it(tmp_path):
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:  # a database from before plans named runs: no variant column, a run already stored
        conn.execute("drop index idx_runs_arch_preset_seed")
        conn.execute("alter table runs drop column variant")
        conn.execute("insert into runs (id, arch, preset, seed, config_json) values ('r1', 'frailt', 'tiny', 0, '{}')")
    conn.close()
    db = stages.connect(path)
    assert db.execute("select variant from runs where id = 'r1'").fetchone()[0] == "frailt"
    db.conn.close()
    assert _schema_sql(path)["idx_runs_arch_preset_seed"] == EXPECTED_SQL["idx_runs_arch_preset_seed"]
    assert '"variant" TEXT' in _schema_sql(path)["runs"]


def test_runs_from_before_heartbeats_are_read_as_they_are_and_migrated_when_written(tmp_path, capsys):
    """A file whose runs table predates pid_started and heartbeat_at: `runs` (read-only) lists it unchanged, with
    its running run judged by what the row has; the next writing connection adds both columns, empty."""
    from benchctl.cli import main

    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("alter table runs drop column pid_started")
        conn.execute("alter table runs drop column heartbeat_at")
        conn.execute(
            "insert into runs (id, arch, preset, seed, status, config_json, hostname, started_at) "
            "values ('r1', 'control', 'tiny', 0, 'running', '{}', 'elsewhere', '2025-06-02T00:00:00+00:00')"
        )
    conn.close()
    try:
        main(["runs", "--db", str(path), "--json"])
    except SystemExit as e:
        assert e.code == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["interrupted"]
    assert "heartbeat_at" not in _schema_sql(path)["runs"]  # a reader changes nothing
    db = stages.connect(path)
    assert db.execute("select pid_started, heartbeat_at from runs").fetchone() == (None, None)
    db.conn.close()


def test_eval_results_from_before_the_cast_once_say_how_they_ran(tmp_path):
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:  # a database from before eval recorded why its precision: results computed under autocast
        conn.execute("alter table eval_results drop column dtype_reason")
        conn.execute(
            "insert into eval_results (run_id, task, metric, n_recur, limit_n, dtype) "
            "values ('r1', 't', 'acc', 1, 0, 'bfloat16'), ('r1', 't', 'acc_norm', 1, 0, null)"
        )
    conn.close()
    db = stages.connect(path)
    got = dict(db.execute("select metric, dtype_reason from eval_results").fetchall())
    assert got["acc"].startswith("autocast: the run's training precision rule") and got["acc_norm"] is None
    db.conn.close()


def test_bench_rows_from_before_decode_timing_become_training_rows(tmp_path):
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:  # a database from before bench --decode: no mode column, a training row already stored
        conn.execute("alter table bench drop column mode")
        conn.execute("insert into bench (bench_id, arch, impl) values ('b1', 'control', 'benchctl')")
    conn.close()
    db = stages.connect(path)
    assert db.execute("select mode from bench where bench_id = 'b1'").fetchone()[0] == "train"
    db.conn.close()


def test_decode_rows_from_before_impl_detail_name_benchctls_paths(tmp_path):
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:  # a database from before impl_detail: decode rows of the two benchctl paths, and a training row
        conn.execute("alter table bench drop column impl_detail")
        for impl, mode in (("decode", "decode"), ("decode-reference", "decode"), ("benchctl", "train")):
            conn.execute("insert into bench (bench_id, arch, impl, mode) values ('b1', 'control', ?, ?)", [impl, mode])
    conn.close()
    db = stages.connect(path)
    got = dict(db.execute("select impl, impl_detail from bench").fetchall())
    assert got == {
        "decode": "benchctl architectures.generate, decode path (fast=True)",
        "decode-reference": "benchctl architectures.generate, reference loop (fast=False)",
        "benchctl": None,
    }
    db.conn.close()


def test_migration_names_the_judge_of_grades_stored_before_judges_were_named(tmp_path):
    """Grades from before a judge was named by backend were all Gemini's: the added columns say so; where they were
    sent and which revision answered were not recorded, and stay empty."""
    path = tmp_path / "old.db"
    stages.connect(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("insert into runs (id, arch, preset, seed, config_json) values ('r1', 'control', 'tiny', 0, '{}')")
        conn.execute("insert into prompts (id, prompt_set, idx, text) values ('p:0', 'p', 0, 'Once')")
        conn.execute("insert into samples (id, run_id, prompt_id, completion) values ('s1', 'r1', 'p:0', ' upon')")
        for col in ("backend", "model", "endpoint", "model_revision"):
            conn.execute(f"alter table judge_grades drop column {col}")
            conn.execute(f"alter table judge_requests drop column {col}")
        conn.execute("alter table judge_requests drop column seed")
        conn.execute(
            "insert into judge_grades (sample_id, judge_model, prompt_hash, repeat, status) "
            "values ('s1', 'gemini-2.5-flash', 'h', 0, 'ok')"
        )
        conn.execute(
            "insert into judge_requests (key, judge_model, prompt_hash, sample_id, repeat, status) "
            "values ('gemini-2.5-flash|h|s1|0', 'gemini-2.5-flash', 'h', 's1', 0, 'ok')"
        )
    conn.close()
    db = stages.connect(path)
    for table in ("judge_grades", "judge_requests"):
        row = db.execute(f"select backend, model, endpoint, model_revision from {table}").fetchone()
        assert row == ("gemini", "gemini-2.5-flash", None, None)
    assert db.execute("select seed from judge_requests").fetchone() == (None,)
    for table in ("judge_grades", "judge_requests"):  # every column a fresh database has (added ones go last)
        fresh = stages.connect(tmp_path / "fresh.db")[table].columns_dict
        assert db[table].columns_dict == fresh
    db.conn.close()


def test_the_report_reads_every_registered_table_by_name(tmp_path):
    stages.connect(tmp_path / "results.db").conn.close()
    data = report.read(tmp_path / "results.db", stages.tables())
    for table in stages.tables():
        frame = data[table.name]
        assert frame is getattr(data, table.name) and frame.empty
        assert list(frame.columns) == [c for c in table.column_names if c not in table.report_skip]


def test_a_canned_query_shows_floats_rounded_and_keys_as_stored():
    from benchctl.stages.depth.tables import DEPTH_RESULTS

    present = ["run_id", "n_recur", "threshold", "val_loss", "mean_depth", "seconds", "depth_hist", "newer_column"]
    assert DEPTH_RESULTS.browse_select("d", present, exact=("seconds",)) == (
        "d.run_id, d.n_recur, d.threshold, round(d.val_loss, 4) as val_loss, round(d.mean_depth, 4) as mean_depth, "
        "d.seconds, d.depth_hist, d.newer_column"
    )
    conn = sqlite3.connect(":memory:")
    conn.execute("create table depth_results (val_loss real, threshold real)")
    conn.execute("insert into depth_results values (3.141592653589793, 0.123456789)")
    select = DEPTH_RESULTS.browse_select("d", ["val_loss", "threshold"])
    assert conn.execute(f"select {select} from depth_results d").fetchone() == (3.1416, 0.123456789)
