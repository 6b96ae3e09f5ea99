"""Cost numbers that survive a shared machine: what every run records beside its wall time (CPU time, threads, jobs,
load, CUDA time and utilisation, the memory baseline), how the report reads them (headline ratio, contended runs,
seeds that disagree), `benchctl runs`, and the study's bench stage."""

from __future__ import annotations

import json
import re
import sqlite3
import sys

import pytest
import torch

from benchctl import stages
from benchctl.core import telemetry
from benchctl.core.config import RunConfig, make_config
from benchctl.core.errors import ConfigError
from benchctl.stages.bench import tables as bench_tables
from benchctl.stages.report import engine as report
from benchctl.stages.train import tables as train_tables
from benchctl.stages.train.cost import LOAD_SLACK, contention
from tests.fixtures_db import STUDY_ARCHS, build_fixture_db
from tests.test_gpu_paths import fake_pynvml
from tests.test_report import by_model, q, section, tables
from tests.test_train import run_cli

TWO_CORES = "Intel(R) Xeon(R) CPU @ 2.20GHz (2 cores, 2 threads)"  # the fixture bench's CPU


# ---- recording -------------------------------------------------------------------------------------------------------


def _train(tmp_path, tinystories_dir, arch, **kw):
    from benchctl.core import data
    from benchctl.stages.train.engine import train_run

    overrides = {
        "data.source": str(tinystories_dir),
        "train.max_steps": 8,
        "train.eval_interval": 4,
        "train.ckpt_interval": 2,
        "train.warmup_steps": 1,
    }
    cfg = make_config("tiny", arch, overrides=overrides)
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    path = tmp_path / "results.db"
    return train_run(cfg, prepared, stages.connect(path), path, progress=False, log=lambda *_: None, **kw), path


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_run_records_cpu_time_load_threads_jobs_and_its_memory_baseline(tmp_path, tinystories_dir, monkeypatch):
    """A run stopped after 3 steps and resumed: CPU time and timed steps add up over both processes; a run an
    executor started (env vars) records its threads and jobs.

    Memory: what holds whatever the model's size. Each process reads its baseline right after starting a new peak
    phase and before it builds the model, the run's peak is the largest of its processes' peaks, and the baseline
    stored is that of the process the peak belongs to. The model's own share (peak - baseline) is left unasserted:
    here both "processes" are this test process, whose memory already holds what earlier training left resident, so
    a tiny model's share is within the kernel's RSS accounting noise and either sign happens."""
    events: list[str] = []
    baselines: list[int | None] = []

    def spy(name, fn, record=None):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            events.append(name)
            if record is not None:
                record.append(out)
            return out

        return wrapped

    import architectures

    monkeypatch.setattr(telemetry, "reset_peak_rss", spy("reset", telemetry.reset_peak_rss))
    monkeypatch.setattr(telemetry, "current_rss_bytes", spy("baseline", telemetry.current_rss_bytes, baselines))
    monkeypatch.setattr(architectures, "build", spy("build", architectures.build))
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    first, path = _train(tmp_path, tinystories_dir, "control", stop_after=3)
    part = train_tables.get_run(stages.connect(path), first.run_id)
    assert part["timed_steps"] == 1 and part["cpu_seconds"] > 0  # 3 steps, the first 2 untimed
    assert part["step_mem_bytes"] > 0  # measured on the second step, the last untimed one
    done, _ = _train(tmp_path, tinystories_dir, "control")
    row = train_tables.get_run(stages.connect(path), done.run_id)
    assert row["status"] == "done"
    assert row["timed_steps"] == 1 + (8 - 3 - 2)  # each process leaves its first 2 steps out of the timing
    assert row["cpu_seconds"] > part["cpu_seconds"] and row["train_seconds"] > 0
    assert row["load_avg"] is not None and row["load_avg"] >= 0
    assert row["threads"] == torch.get_num_threads() and row["concurrent_jobs"] == 1
    assert row["cuda_seconds"] is None and row["gpu_util"] is None  # no GPU: NULL, not zero
    assert row["step_mem_bytes"] == part["step_mem_bytes"]  # measured again on resuming: the same step's tensors

    starts = [i for i, e in enumerate(events) if e == "baseline"]
    assert len(starts) == 2 and all(events[i - 1 : i + 2] == ["reset", "baseline", "build"] for i in starts)
    assert all(b is not None and b > 0 for b in baselines)
    assert part["baseline_rss_bytes"] == baselines[0] and part["peak_rss_bytes"] > 0
    assert row["peak_rss_bytes"] >= part["peak_rss_bytes"]
    if row["peak_rss_bytes"] > part["peak_rss_bytes"]:  # the resumed process set the run's peak
        assert row["baseline_rss_bytes"] == baselines[1]
    else:  # the first process's peak stands (or the second equalled it)
        assert row["baseline_rss_bytes"] in baselines

    monkeypatch.setenv("BENCHCTL_THREADS", "1")
    monkeypatch.setenv("BENCHCTL_CONCURRENT_JOBS", "2")
    other, _ = _train(tmp_path, tinystories_dir, "frailt")
    row = train_tables.get_run(stages.connect(path), other.run_id)
    assert (row["threads"], row["concurrent_jobs"]) == (1, 2)
    assert row["cpu_seconds"] > 0 and row["load_avg"] is not None


@pytest.mark.slow  # two training runs, then bench's profiled step of each
def test_each_run_records_its_steps_own_memory_as_bench_measures_it(tmp_path, tinystories_dir, monkeypatch):
    """step_mem_bytes: parameters + optimizer state + the peak of torch's allocations during one optimizer step, as
    `benchctl bench` measures it. Unlike the process's RSS, a run trained after a larger one in the same process
    gets the same figure as bench's fresh measurement (relaxed first: four times the control's activations)."""
    from benchctl.stages.bench import engine as bench

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    rows = {}
    for arch in ("relaxed", "control"):
        done, path = _train(tmp_path, tinystories_dir, arch)
        rows[arch] = train_tables.get_run(stages.connect(path), done.run_id)
    assert rows["relaxed"]["step_mem_bytes"] > 2 * rows["control"]["step_mem_bytes"]
    for arch, row in rows.items():
        cfg = RunConfig.from_json(row["config_json"])
        s = bench.build_subject(cfg, torch.device("cpu"), "benchctl", False)
        bench.warm_up(s, torch.device("cpu"), 1)
        measured = bench.profile_cpu_step(s.step).peak_growth + telemetry.state_bytes(s.model, s.optimizer)
        # the same step's tensors; train's batches come from its sampler, bench's are pre-generated
        assert abs(row["step_mem_bytes"] - measured) <= 0.01 * measured, (arch, row["step_mem_bytes"], measured)
        assert row["step_mem_bytes"] > telemetry.state_bytes(s.model, s.optimizer)


def test_bad_executor_settings_are_one_clear_error(monkeypatch):
    monkeypatch.setenv("BENCHCTL_CONCURRENT_JOBS", "two")
    with pytest.raises(ConfigError, match="BENCHCTL_CONCURRENT_JOBS='two' must be a whole number >= 1"):
        telemetry.concurrent_jobs()
    monkeypatch.setenv("BENCHCTL_THREADS", "0")
    with pytest.raises(ConfigError, match="BENCHCTL_THREADS"):
        telemetry.threads_used()
    monkeypatch.delenv("BENCHCTL_CONCURRENT_JOBS")
    assert telemetry.concurrent_jobs() == 1


def test_a_checkpoint_from_before_cpu_time_leaves_it_unknown():
    old = {
        "train_seconds": 5.0,
        "warmup_seconds": 1.0,
        "eval_seconds": 1.0,
        "step_times": [0.5] * 10,
        "peak_rss": 100,
        "peak_alloc": None,
        "peak_reserved": None,
        "peak_nvml": None,
        "initial_val_loss": 6.0,
    }
    carried = telemetry.carried_from(old)
    assert carried["cpu_seconds"] is None and telemetry.add(carried["cpu_seconds"], 2.0) is None
    cols = telemetry.run_columns(carried, 512)
    assert cols["cpu_seconds"] is None and cols["load_avg"] is None and cols["train_seconds"] == 5.0


def test_stopwatch_counts_cpu_time_and_cuda_event_time(monkeypatch):
    class Event:
        clock = [0.0]

        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            Event.clock[0] += 250.0  # ms between the two records
            self.t = Event.clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(telemetry, "sync", lambda d: None)
    sw = telemetry.Stopwatch(torch.device("cuda", 0), cuda_events=True)
    for _ in range(2):
        with sw:
            sum(i * i for i in range(200_000))  # CPU work: process time advances
    assert sw.count == 2 and sw.cuda_total == pytest.approx(0.5) and sw.cpu_total > 0
    assert telemetry.Stopwatch(torch.device("cpu"), cuda_events=True).cuda_total is None


def test_nvml_utilisation_mean_and_load_samples(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail=set()))
    monkeypatch.setattr(telemetry, "nvml_target", lambda d: ("uuid", "GPU-x"))
    s = telemetry.NvmlSampler(torch.device("cuda", 0), interval=0.01).start()
    s.stop()
    assert s.util_n >= 2 and s.util_total == 7 * s.util_n
    monkeypatch.setattr(telemetry, "load_average", lambda: 3.0)
    load = telemetry.LoadSampler(interval=0.01).start()
    load.stop()
    assert load.n >= 2 and load.total == 3.0 * load.n
    tel = {
        **telemetry.FRESH_RUN_TELEMETRY,
        "load_total": load.total,
        "load_n": load.n,
        "util_total": s.util_total,
        "util_n": s.util_n,
    }
    cols = telemetry.run_columns(tel, 512)
    assert cols["load_avg"] == 3.0 and cols["gpu_util"] == 7.0


def test_contention_rule():
    quiet = {"device_name": TWO_CORES, "load_avg": 2.0 + LOAD_SLACK, "concurrent_jobs": 1}
    assert contention(quiet) is None  # every core busy with the run itself: not contended
    assert contention({**quiet, "load_avg": 2.6}) == "mean load 2.6 on 2 cores"
    assert contention({**quiet, "concurrent_jobs": 2}) == "trained beside 1 other job(s) (2 at once)"
    assert contention({**quiet, "load_avg": 9.0, "device_name": "NVIDIA A100"}) is None  # cores unknown
    assert contention({"device_name": TWO_CORES, "load_avg": None, "concurrent_jobs": None}) is None  # older rows
    # a row that records its machine's cores (inference_results) is read against them, whatever the device
    assert contention({"cores": 2, "load_avg": 2.6, "device_name": "NVIDIA A100"}) == "mean load 2.6 on 2 cores"
    assert contention({"cores": 4, "load_avg": 2.6}) is None


# ---- the report ------------------------------------------------------------------------------------------------------


def _report(tmp_path, **kw):
    db = build_fixture_db(tmp_path / "results.db", judge=False, evals=False, **kw)
    md = report.build(db).markdown
    return db, section(md, "Training cost"), md


def _timing_table(sec: str) -> dict[str, dict[str, str]]:
    return by_model(tables(sec)[1])


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_quiet_machine_report_has_the_bench_headline_and_no_warning(tmp_path):
    db, sec, _ = _report(tmp_path, bench=True, run_extra=lambda a, s: {"device_name": TWO_CORES})
    t = _timing_table(sec)
    bench = {
        a: (tps, f)
        for a, tps, f in q(db, "select arch, tokens_per_s, flops_per_token from bench where impl = 'benchctl'")
    }
    for arch in STUDY_ARCHS:
        time_ratio = bench["control"][0] / bench[arch][0]
        assert t[arch]["bench × control"] == f"{time_ratio:.2f}"
        assert t[arch]["bench cost ratio"] == f"{time_ratio / (bench[arch][1] / bench['control'][1]):.2f}"
    assert "Headline: the bench ratio" in sec
    assert "not a cost measure" not in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_contended_runs_point_to_the_cpu_time_and_bench_ratios(tmp_path):
    """A CPU hog beside training: the load average stays far above the cores, the wall times say nothing about
    cost, and the report says so for every run and names the number to trust."""
    hog = lambda a, s: {"device_name": TWO_CORES, "load_avg": 6.2}  # noqa: E731
    db, sec, _ = _report(tmp_path, archs=("control", "frailt"), seeds=(0, 1), bench=True, run_extra=hog)
    lines = [ln for ln in sec.splitlines() if "contended" in ln and ln.startswith("- ")]
    assert lines == [
        "- All 4 runs were contended (mean load 6.2 on 2 cores): their wall times are not a cost measure here; trust "
        "the bench ratio instead."
    ]
    # the training-time table gives no wall-time ratio for them, and says why
    frailt = next(ln for ln in sec.splitlines() if ln.startswith("| frailt | 2 |"))
    assert frailt.split(" | ")[4] == "contended"
    assert "not given ('contended') where the model's or the control's runs shared the machine" in sec
    rows = q(db, "select arch, cpu_seconds, timed_steps, tokens_seen, step from runs where status = 'done'")
    per = {a: [] for a in ("control", "frailt")}
    for arch, cpu, steps, seen, step in rows:
        per[arch].append(cpu / (steps * seen / step))
    ratio = (sum(per["frailt"]) / 2) / (sum(per["control"]) / 2)
    assert _timing_table(sec)["frailt"]["× control (2)"] == f"{ratio:.2f}"  # the CPU-time ratio

    _, sec, _ = _report(tmp_path / "nobench", archs=("control", "frailt"), seeds=(0, 1), run_extra=hog)
    assert "Headline: the CPU-time ratio" in sec
    assert "trust the CPU-time ratio (better: run `benchctl bench`) instead." in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_the_training_time_figure_flags_the_runs_the_notes_flag(tmp_path):
    """The figure says what the notes under the timing table say: a model with a contended run has a hatched bar
    and a legend entry says what hatching means; where only some of a model's seeds were contended, their dots are
    red. Memory is not a timing: its figure is never hatched. A quiet study's figure has neither."""
    from matplotlib.colors import to_hex

    def extra(arch, seed):
        out = {"device_name": TWO_CORES}
        if arch == "frailt" and seed == 1:
            out["load_avg"] = 6.2
        if arch == "relaxed":
            out["concurrent_jobs"] = 2
        return out

    archs = ("control", "frailt", "relaxed")
    db = build_fixture_db(tmp_path / "results.db", archs=archs, seeds=(0, 1), judge=False, evals=False, run_extra=extra)
    built = report.build(db)
    sec = section(built.markdown, "Training cost")
    assert "- frailt seed 1 was contended (mean load 6.2 on 2 cores)" in sec
    assert "- relaxed seeds 0 and 1 were contended (trained beside 1 other job(s) (2 at once))" in sec
    fig = built.figures["training_time.png"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(archs)
    assert [bar.get_hatch() for bar in ax.patches] == [None, "///", "///"]
    dots = [  # one colour for every dot, or one per dot
        [to_hex(c) for c in coll.get_facecolors()] * (len(coll.get_offsets()) if len(coll.get_facecolors()) == 1 else 1)
        for coll in ax.collections
    ]
    assert dots == [["#ffffff"] * 2, ["#ffffff", "#c00000"], ["#ffffff"] * 2]  # seeds 0, 1; relaxed: all flagged
    legend = " ".join(t.get_text() for leg in fig.legends for t in leg.get_texts()).replace("\n", " ")
    assert "hatched: contended runs (3 of 6;" in legend and "red dot: a contended seed" in legend
    memory = built.figures["peak_memory.png"]
    assert all(bar.get_hatch() is None for bar in memory.axes[0].patches) and not memory.legends

    quiet = report.build(
        build_fixture_db(tmp_path / "quiet.db", archs=archs, seeds=(0, 1), judge=False, evals=False)
    ).figures["training_time.png"]
    assert all(bar.get_hatch() is None for bar in quiet.axes[0].patches) and not quiet.legends


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_bench_of_some_models_is_trusted_for_those_models(tmp_path):
    """`benchctl bench --archs control,frailt` beside a four-model study: the CPU-time ratio stays the headline (the
    one every model has), but the benched models' sentences and a line under the headline point to their bench
    ratio."""
    hog = lambda a, s: {"device_name": TWO_CORES, "load_avg": 6.2}  # noqa: E731
    db = build_fixture_db(
        tmp_path / "results.db",
        archs=("control", "frailt", "relaxed"),
        seeds=(0,),
        judge=False,
        evals=False,
        bench=True,
        run_extra=hog,
    )
    with sqlite3.connect(db) as con:
        con.execute("delete from bench where arch = 'relaxed'")
    sec = section(report.build(db).markdown, "Training cost")
    assert "Headline: the CPU-time ratio" in sec
    assert (
        "The latest `benchctl bench` measured only control, frailt: for them the bench ratio is the cleaner "
        "number." in sec
    )
    assert (  # one sentence for the runs with the same reason and the same number to trust
        "- control seed 0, frailt seed 0 were contended (mean load 6.2 on 2 cores): their wall times are not a cost "
        "measure here; trust the bench ratio instead." in sec
    )
    assert (
        "relaxed seed 0 was contended (mean load 6.2 on 2 cores): its wall time is not a cost measure here; "
        "trust the CPU-time ratio (better: run `benchctl bench`) instead." in sec
    )


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_seeds_that_disagree_and_parallel_jobs_get_a_sentence(tmp_path):
    def extra(arch, seed):
        out = {"device_name": TWO_CORES}
        if arch == "control" and seed == 1:  # this seed ran while something else had the machine
            out.update(train_seconds=80.0, tokens_per_s=100.0)
        if arch == "frailt":
            out["concurrent_jobs"] = 2
        return out

    _, sec, _ = _report(tmp_path, archs=("control", "frailt"), seeds=(0, 1), run_extra=extra)
    spread = [ln for ln in sec.splitlines() if "seeds took" in ln]
    assert len(spread) == 1 and spread[0].startswith("- control's seeds took ")
    assert (
        "its wall time is not a cost measure here; trust the CPU-time ratio (better: run `benchctl bench`) "
        "instead." in spread[0]
    )
    assert "- frailt seeds 0 and 1 were contended (trained beside 1 other job(s) (2 at once)): their" in sec
    assert "control seed" not in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_memory_compared_is_each_steps_own_and_rss_only_a_process_fact(tmp_path):
    """The compared memory is a training step's own (`step_mem_bytes`, as bench measures it), with its ratio to the
    control; the process's peak RSS is shown as such, with no ratio, and never as the model's."""
    db, sec, _ = _report(tmp_path, archs=("control", "frailt"), seeds=(0, 1))
    cost = by_model(tables(sec)[0])
    mean = {}
    for arch in ("control", "frailt"):
        step = [v for (v,) in q(db, "select step_mem_bytes from runs where status = 'done' and arch = ?", (arch,))]
        rss = [v for (v,) in q(db, "select peak_rss_bytes from runs where status = 'done' and arch = ?", (arch,))]
        mean[arch] = sum(step) / len(step)
        assert cost[arch]["step memory (MiB)"] == f"{mean[arch] / 2**20:,.2f}"
        assert cost[arch]["process peak RSS (MiB)"] == f"{sum(rss) / len(rss) / 2**20:,.2f}"
    headers = list(cost["frailt"])
    assert headers[headers.index("step memory (MiB)") + 1] == "× control (2)"  # the second ratio: memory's
    assert cost["frailt"]["× control (2)"] == f"{mean['frailt'] / mean['control']:.2f}"
    assert "model's own" not in sec and "Process peak RSS is a fact about the training process" in sec
    assert "as `benchctl bench` measures it" in sec and "not measured" not in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_database_from_before_the_step_memory_shows_it_not_measured(tmp_path):
    db = build_fixture_db(tmp_path / "results.db", judge=False, evals=False, archs=("control", "frailt"), seeds=(0,))
    conn = sqlite3.connect(db)
    conn.execute("alter table runs drop column step_mem_bytes")
    conn.commit()
    conn.close()
    rendered = report.build(db)
    sec = section(rendered.markdown, "Training cost")
    cost = by_model(tables(sec)[0])
    assert cost["frailt"]["step memory (MiB)"] == "not measured" and cost["frailt"]["process peak RSS (MiB)"] != "-"
    assert "Not measured: runs recorded by a benchctl from before this measurement" in sec
    assert "peak_memory.png" not in rendered.figures  # no memory to compare: the process's RSS is not drawn per model


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_bench_rows_of_another_config_or_device_give_no_bench_ratio(tmp_path):
    db = build_fixture_db(tmp_path / "results.db", judge=False, evals=False, bench=True)
    conn = stages.connect(db)
    conn.execute(
        "update bench set config_json = ?", [make_config("tiny", "control", 0, {"model.n_layers": 2}).to_json()]
    )
    conn.conn.commit()
    sec = section(report.build(db).markdown, "Training cost")
    assert _timing_table(sec)["frailt"]["bench × control"] == "-" and "Headline: the CPU-time ratio" in sec


def test_runs_command_shows_the_timing_columns(tmp_path, capsys):
    db = build_fixture_db(
        tmp_path / "results.db",
        judge=False,
        evals=False,
        archs=("control",),
        seeds=(0,),
        run_extra=lambda a, s: {"load_avg": 3.25},
    )
    assert run_cli(["runs", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\bCPU\b", out) and "load" in out and "3.25" in out
    assert run_cli(["runs", "--db", str(db), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    done = [r for r in rows if r["status"] == "done"]
    assert done[0]["load_avg"] == 3.25 and done[0]["cpu_seconds"] > 0 and done[0]["concurrent_jobs"] == 1


# ---- study --bench ---------------------------------------------------------------------------------------------------


def _study(tmp_path, **opts):
    from benchctl.study import StudyOptions

    o = StudyOptions(preset="tiny", db_path=tmp_path / "r.db", **opts)
    lines: list[str] = []
    cfgs = [make_config("tiny", a) for a in ("control", "frailt")]
    return stages.StudyRun(opts=o, cfgs=cfgs, archs=["control", "frailt"], log=lines.append), lines


def test_study_bench_runs_once_per_preset_device_and_config(tmp_path, monkeypatch):
    from benchctl.stages.bench import engine as bench
    from benchctl.stages.bench import stage

    calls = []

    def fake_run(opts, db_path, log=None):
        calls.append(opts)
        dev = telemetry.device_name(torch.device("cpu"))
        rows = [
            {
                "bench_id": "b",
                "arch": a,
                "preset": opts.preset,
                "impl": "benchctl",
                "device": "cpu",
                "device_name": dev,
                "tokens_per_s": 100.0 / (i + 1),
                "flops_per_token": 1.0 + i,
                "config_json": make_config(opts.preset, a, 0, opts.overrides).to_json(),
                "created_at": "x",
            }
            for i, a in enumerate(opts.archs)
        ]
        bench_tables.record_bench_rows(stages.connect(db_path), rows)
        return [{"arch": r["arch"], "cost_ratio": 1.0} for r in rows]

    monkeypatch.setattr(bench, "run", fake_run)
    study, lines = _study(tmp_path, bench=True)
    stage.run(study)
    assert len(calls) == 1 and calls[0].archs == ["control", "frailt"] and calls[0].reference is False
    assert re.match(r"   benchmarked in \d+ s; cost ratios control 1.00, frailt 1.00", lines[-1])
    study, lines = _study(tmp_path, bench=True)
    stage.run(study)
    assert len(calls) == 1 and "already benchmarked" in lines[-1]
    study, lines = _study(tmp_path, bench=True, overrides={"model.n_layers": 2})  # another config: measured again
    stage.run(study)
    assert len(calls) == 2


def test_study_bench_defaults(tmp_path):
    from benchctl.stages.bench.stage import enabled

    study, _ = _study(tmp_path)  # tiny: a smoke run, not timed unless asked
    assert enabled(study, "cpu") == (False, "on by default only on a CPU at small; --bench runs it")
    study.opts.preset = "small"
    assert enabled(study, "cpu") == (True, "")
    assert enabled(study, "cuda")[0] is False
    study.opts.preset = "paper"
    assert enabled(study, "cpu")[0] is False
    study.opts.bench = True
    assert enabled(study, "cuda") == (True, "--no-bench")
    study.opts.bench = False
    assert enabled(study, "cpu") == (False, "--no-bench")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_cuda_runs_show_gpu_time_and_utilisation(tmp_path):
    extra = lambda a, s: {"cuda_seconds": 6.0, "gpu_util": 81.0}  # noqa: E731
    db, sec, _ = _report(
        tmp_path,
        archs=("control", "frailt"),
        seeds=(0,),
        device="cuda",
        run_extra=extra,
        failed_run=False,
        running_run=False,
    )
    t = _timing_table(sec)
    ((steps, seen, step),) = q(db, "select timed_steps, tokens_seen, step from runs where arch = 'control'")
    assert t["control"]["GPU (µs/token)"] == f"{6.0 / (steps * seen / step) * 1e6:,.1f}"
    assert t["frailt"]["GPU util (%)"] == "81"


def test_a_database_from_before_the_cost_columns_still_reports_and_migrates(tmp_path):
    db = build_fixture_db(tmp_path / "results.db", judge=False, evals=False, archs=("control", "frailt"), seeds=(0,))
    new = (
        "cpu_seconds",
        "cuda_seconds",
        "timed_steps",
        "threads",
        "concurrent_jobs",
        "load_avg",
        "gpu_util",
        "baseline_rss_bytes",
    )
    conn = sqlite3.connect(db)
    for col in new:
        conn.execute(f"alter table runs drop column {col}")
    conn.commit()
    conn.close()
    sec = section(report.build(db).markdown, "Training cost")
    t = _timing_table(sec)
    assert t["frailt"]["CPU (µs/token)"] == "-" and t["frailt"]["wall (µs/token)"] != "-"
    assert "Headline: the wall-time ratio" in sec and "model's own" not in sec
    assert set(new) <= set(stages.connect(db)["runs"].columns_dict)  # added back by migration, empty
