"""The study as a loop over registered stages, the stage registry, and how the engine asks before long runs."""

from __future__ import annotations

import sqlite3
import types

import pytest
from fixtures_db import build_fixture_db

from benchctl import stages, study
from benchctl.cli import main
from benchctl.core.errors import Aborted, BenchctlError
from benchctl.stages.report import engine as report
from benchctl.stages.train import sweep
from benchctl.study import StudyOptions, run_study
from tests.conftest import BUILTIN_STAGES

# The study runs every registered stage, in order: an added stage changes what each test here drives.
pytestmark = pytest.mark.registry


def test_registry_is_the_study_in_order():
    orders = [s.order for s in stages.registered()]
    assert orders == sorted(orders)
    assert [n for n in stages.names() if n in BUILTIN_STAGES] == list(BUILTIN_STAGES)
    assert [n for n in stages.skippable() if n in BUILTIN_STAGES] == [
        "sample",
        "judge",
        "eval",
        "accuracy",
        "depth",
        "infer",
    ]
    builtin_figures = tuple(f for s in stages.registered() if s.name in BUILTIN_STAGES for f in s.figures)
    assert [f for f in report.figure_names() if f in builtin_figures] == list(builtin_figures)
    assert builtin_figures == (
        "training_time.png",
        "peak_memory.png",
        "final_val_loss.png",
        "val_loss_curves.png",
        "loss_vs_compute.png",
        "loss_vs_params.png",
        "loss_vs_depth.png",
        "adaptive_metrics.png",
        "isoflop.png",
        "retrofit_loss_flops.png",
        "judge_grades.png",
        "task_accuracy_depth.png",
        "depth_loss.png",
        "depth_frontier.png",
        "depth_exit_hist.png",
        "infer_frontier.png",
        "infer_convergence.png",
        "infer_trajectories.png",
    )
    assert not hasattr(study, "STAGES")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_new_stage_runs_in_order_and_adds_its_section(tmp_path, monkeypatch):
    seen: list[str] = []

    def fake(name):
        def run(s: stages.StudyRun) -> None:
            seen.append(name)
            s.say(f"{name} ran")
            if name == "train":
                s.trained = stages.TrainAllResult(done=["r1"])
            if name == "report":
                s.report_path = tmp_path / "report.md"

        return run

    def probe_section(frames) -> list[str]:
        return ["## Probe", "", f"{len(frames.ctx.done_models)} models", ""]

    depth = stages.Stage(name="probe", order=60, run=fake("probe"), sections=(probe_section,))
    fakes = tuple(
        stages.Stage(
            name=s.name, order=s.order, run=fake(s.name) if s.run else None, sections=s.sections, tables=s.tables
        )
        for s in stages.registered()
        if s.name in BUILTIN_STAGES
    )
    monkeypatch.setattr(stages, "registered", lambda: tuple(sorted(fakes + (depth,), key=lambda s: s.order)))
    lines: list[str] = []
    path = run_study(StudyOptions(preset="tiny", archs=["control"], db_path=tmp_path / "r.db"), log=lines.append)
    assert path == tmp_path / "report.md"
    assert seen == [
        "prepare",
        "train",
        "bench",
        "retrofit",
        "sample",
        "judge",
        "eval",
        "accuracy",
        "depth",
        "infer",
        "probe",
        "report",
        "export",
    ]
    assert lines[: len(seen)] == [f"== {i}/13 {n}: {n} ran" for i, n in enumerate(seen, 1)]
    assert lines[len(seen)] == "== summary"  # the study ends with its summary

    db = build_fixture_db(tmp_path / "fixture.db", judge=False, evals=False)
    md = report.build(db).markdown
    assert md.index("\n## lm-eval\n") < md.index("\n## Probe\n\n4 models\n") < md.index("\n## Comparisons\n")


def test_failed_training_runs_are_reported_after_the_report(tmp_path, monkeypatch):
    def train(s: stages.StudyRun) -> None:
        s.trained = stages.TrainAllResult(done=["ok1"], failed=[("bad1", "diverged")])

    def write(s: stages.StudyRun) -> None:
        s.report_path = tmp_path / "report.md"

    only = (stages.Stage("train", 20, train), stages.Stage("report", 100, write))
    monkeypatch.setattr(stages, "registered", lambda: only)
    with pytest.raises(
        BenchctlError,
        match=r"report written to .*report\.md, but 1 training run\(s\) failed: "
        r"bad1: diverged",
    ):
        run_study(StudyOptions(preset="tiny", archs=["control"], db_path=tmp_path / "r.db"), log=lambda _: None)


def test_duplicate_stage_names_are_refused(monkeypatch):
    stages.registered.cache_clear()
    fake_mod = types.ModuleType("benchctl.stages.twin.stage")
    fake_mod.STAGE = stages.Stage(name="judge", order=45)
    monkeypatch.setitem(__import__("sys").modules, "benchctl.stages.twin", types.ModuleType("benchctl.stages.twin"))
    monkeypatch.setitem(__import__("sys").modules, "benchctl.stages.twin.stage", fake_mod)
    real_iter = stages.pkgutil.iter_modules
    monkeypatch.setattr(
        stages.pkgutil,
        "iter_modules",
        lambda path: list(real_iter(path)) + [types.SimpleNamespace(name="twin", ispkg=True)],
    )
    try:
        with pytest.raises(RuntimeError, match="same name 'judge'"):
            stages.registered()
    finally:
        stages.registered.cache_clear()


@pytest.fixture
def slow_estimate(monkeypatch):
    """Training that would take two hours on a CPU."""
    import torch

    from benchctl.stages.train import engine as train

    monkeypatch.setattr(train, "estimate_seconds", lambda cfgs, prepared: 7200.0)
    monkeypatch.setattr(train, "resolve_device", lambda device: torch.device("cpu"))
    return sweep.sweep("tiny", ["control"], [0])


def test_long_run_without_anyone_to_ask_needs_yes(slow_estimate):
    with pytest.raises(
        Aborted,
        match=r"would take about 2\.0 h on this CPU \(try --preset small on a CPU\); "
        "pass --yes to start anyway",
    ):
        sweep.confirm_long_run(slow_estimate, None, yes=False, log=print)
    sweep.confirm_long_run(slow_estimate, None, yes=True, log=print)


def test_long_run_asks_through_the_callback(slow_estimate):
    asked: list[str] = []
    sweep.confirm_long_run(slow_estimate, None, yes=False, log=print, confirm=lambda q: asked.append(q) or True)
    assert asked == [
        "1 run(s) of preset 'tiny' would take about 2.0 h on this CPU (try --preset small on a CPU). Start?"
    ]
    with pytest.raises(Aborted, match="not started"):
        sweep.confirm_long_run(slow_estimate, None, yes=False, log=print, confirm=lambda q: False)


def test_skip_accepts_only_skippable_stages(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["study", "--preset", "tiny", "--skip", "judge,train", "--db", str(tmp_path / "r.db")])
    assert e.value.code == 2
    assert f"--skip accepts {', '.join(stages.skippable())}; got train" in capsys.readouterr().err


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_study_end_to_end_on_tiny_data(tmp_path, tinystories_dir, monkeypatch, capsys):
    """The real stages from the command line, as a user sees them with output going to a file: prepare, train two
    small runs, evaluate them with lm-eval (the tiny preset's few documents, one task), skip the rest, write the
    report. No library's own progress bar reaches the output, and it ends with the summary naming every model."""
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db, out = tmp_path / "r.db", tmp_path / "reports"
    args = ["study", "--preset", "tiny", "--archs", "control,frailt", "--seeds", "0", "--db", str(db)]
    args += ["--out", str(out), "--data", str(tinystories_dir), "--tasks", "tinystories_ending", "--yes"]
    args += ["--skip", "sample,judge,depth,infer"]
    for key, value in (("train.max_steps", 2), ("train.eval_interval", 1), ("train.warmup_steps", 1)):
        args += ["--set", f"{key}={value}"]
    with pytest.raises(SystemExit) as e:
        main(args)
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err
    text = captured.out + captured.err
    assert "it/s]" not in text and "%|" not in text  # lm-eval's bars (and any other library's) draw nothing
    lines = [" ".join(ln.split()) for ln in captured.out.splitlines()]
    heads = [ln for ln in lines if ln.startswith("== ")]
    ran = [s.name for s in stages.registered() if s.run is not None]
    assert [h.split(":")[0] for h in heads] == [f"== {i}/{len(ran)} {n}" for i, n in enumerate(ran, 1)] + ["== summary"]
    said = {h.split(":")[0].split()[-1]: h.split(" ", 2)[2] for h in heads[:-1]}  # stage -> "bench: skipped (...)"
    assert said["train"].startswith("train: plan study: 2 run(s) — control, frailt × seeds [0] (about ")
    assert [said[n] for n in ("bench", "retrofit", "sample", "judge", "depth", "infer", "export")] == [
        "bench: skipped (on by default only on a CPU at small; --bench runs it)",
        "retrofit: no conversions in this plan",
        "sample: skipped",
        "judge: skipped",
        "depth: skipped",
        "infer: skipped",
        "export: off (--export hf writes every finished run as a Hugging Face folder)",
    ]
    assert lines[0].startswith("estimate: train about ") and lines[0].endswith(
        " (2 run(s); 2 model shape(s), each from steps timed here now); the later stages show their progress as they go"
    )
    summary = lines[lines.index("== summary") :]
    rows = {ln.split()[0]: ln.split() for ln in summary[2:4]}
    assert set(rows) == {"control", "frailt"} and all(r[1] == "1/1" for r in rows.values())
    assert all(float(r[2]) > 0 for r in rows.values())  # one seed: the loss alone, no interval
    assert summary[4].startswith("time: ") and summary[4].endswith(" CPU") and " wall, " in summary[4]
    assert summary[5].startswith("stages (wall, CPU): ") and "train " in summary[5] and "eval " in summary[5]
    assert summary[6:8] == [f"report: {out / 'report.md'}", f"database: {db}"]
    assert summary[-3:] == [
        f"benchctl runs --db {db} (the runs, their timings and status)",
        f"benchctl report --db {db} --out {out} --preset tiny --plan study (the report again, e.g. after "
        "'benchctl judge')",
        f"benchctl browse --db {db} (results.db in Datasette, every table and query)",
    ]
    assert "| control | 1 | 0 | 0 | 0 | 0 |" in (out / "report.md").read_text()
    evals = sqlite3.connect(db).execute("select distinct task, limit_n from eval_results").fetchall()
    assert evals == [("tinystories_ending", 10)]  # the smoke preset's few documents


@pytest.mark.parametrize(
    ("plan", "skip", "export", "needed"),
    [
        ("study", (), (), True),
        ("study", ("sample", "judge", "eval", "depth"), (), True),  # infer still loads them
        ("study", ("sample", "judge", "eval", "depth", "infer"), (), False),
        ("study", ("sample", "judge", "eval", "depth", "infer"), ("hf",), True),
        ("retrofit", ("sample", "judge", "eval", "depth", "infer"), (), True),  # conversions start from weights
    ],
)
def test_training_knows_whether_a_later_stage_loads_the_weights(plan, skip, export, needed):
    from benchctl import plans
    from benchctl.stages import StudyOptions, StudyRun, weights_read_after
    from benchctl.stages.train.stage import ORDER

    opts = StudyOptions(preset="tiny", plan=plan, seeds=[0], skip=skip, export=export)
    study = StudyRun(opts=opts, cfgs=[], archs=[], plan=plans.load(plan))
    assert weights_read_after(study, ORDER) is needed


def test_the_smoke_preset_runs_each_stage_on_less_work_and_small_measures_in_full():
    """At tiny a study is a smoke run: each stage's options declare a short version of its work (every path still
    runs); at small and paper the stages keep their full defaults."""
    import architectures
    from benchctl.stages.depth import engine as depth_engine
    from benchctl.stages.depth.options import for_study as depth_options
    from benchctl.stages.eval.options import study_limit
    from benchctl.stages.infer import engine as infer_engine
    from benchctl.stages.infer.options import InferOptions
    from benchctl.stages.infer.options import for_study as infer_options
    from benchctl.stages.sample.options import study_n_prompts

    sel = stages.RunSelection(run_ids=["r"])
    frailt, control = architectures.get("frailt"), architectures.get("control")

    def infer_settings(preset, cls):
        return [m.label for m in infer_engine.settings_for(cls, infer_options(preset, sel))]

    assert infer_settings("tiny", frailt) == ["full depth", "n=trained exit=0.01 rule=kl", "speculative draft n=1 k=4"]
    assert infer_settings("tiny", control) == ["full depth"]
    full = [m.label for m in infer_engine.settings_for(frailt, InferOptions(select=sel))]
    assert infer_settings("small", frailt) == infer_settings("paper", frailt) == full and len(full) == 14
    smoke = infer_options("tiny", sel)
    assert smoke.repeats == 1 and (smoke.batch, smoke.windows) < (InferOptions().batch, InferOptions().windows)

    def depths(preset, exit_rule=None):
        o = depth_options(preset, sel, exit_rule)
        settings = depth_engine.settings_for(
            frailt,
            4,
            depths=o.depths or o.sweep,
            exit_rule=exit_rule,
            thresholds=o.thresholds,
            max_depth=None,
            extrapolate=None,
            with_trained=o.depths is None,
        )
        return [(s.n_recur, s.threshold) for s in settings]

    assert depths("tiny") == [(1, 0.0), (4, 0.0), (8, 0.0)]  # depth 1, the trained depth and twice it
    assert [d for d, _ in depths("small")] == [1, 2, 4, 8, 16, 32]
    assert depths("tiny", "kl") == [(4, 1e-2)] and len(depths("small", "kl")) == 3
    assert (study_limit("tiny"), study_limit("small"), study_limit("paper")) == (10, None, None)
    assert (study_n_prompts("tiny"), study_n_prompts("small"), study_n_prompts("tiny", 7)) == (4, 50, 7)
