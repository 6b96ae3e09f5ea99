"""Plans whose variants are conversions of another variant (`from`, `init`, `lora_init`): validation before anything
runs, and `study` training the parents, then each conversion from the same seed's parent, resumable and skipped once
done."""

from __future__ import annotations

import sqlite3

import pytest

from benchctl import plans, stages
from benchctl.cli import main
from benchctl.core.errors import ConfigError
from benchctl.study import StudyOptions, run_study
from tests.fixtures_db import layout_data_dir

PLAN = """name = "mini-retrofit"
description = "a 16-layer control converted into relaxed"

[[variant]]
name = "deep"
arch = "control"
set = ["model.n_layers=16"]

[[variant]]
name = "rx"
arch = "relaxed"
from = "deep"
init = "average"
lora_init = "svd"
steps = 3
"""

FAST = {"train.max_steps": 2, "train.eval_interval": 1, "train.warmup_steps": 1}


def write(tmp_path, text: str):
    p = tmp_path / "plan.toml"
    p.write_text(text)
    return p


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_builtin_retrofit_plan_converts_control_16_with_and_without_the_curriculum():
    assert "retrofit" in plans.builtin_names()
    plan = plans.load("retrofit")
    runs = plans.resolve(plan, "tiny", [0, 1])
    assert [(r.variant, r.cfg.seed) for r in runs] == [
        (v, s) for s in (0, 1) for v in ("control-16", "relaxed", "three-part")
    ]
    convs = {c.variant: c for c in plans.conversions(plan, "tiny", [0])}
    got = {name: (c.parent, c.cfg.arch, c.init, c.lora_init, c.cfg.train.recur_curriculum) for name, c in convs.items()}
    assert got == {
        "relaxed-avg-svd": ("control-16", "relaxed", "average", "svd", "none"),
        "relaxed-avg-svd-curr": ("control-16", "relaxed", "average", "svd", "linear"),
        "relaxed-step-zero": ("control-16", "relaxed", "stepwise", "zero", "none"),
        "relaxed-step-zero-curr": ("control-16", "relaxed", "stepwise", "zero", "linear"),
        "three-part-select": ("control-16", "three-part", "select", None, "none"),
        "three-part-select-curr": ("control-16", "three-part", "select", None, "linear"),
    }
    scratch = {r.variant: r.cfg for r in runs if r.cfg.seed == 0}
    for c in convs.values():
        assert c.parent_cfg == scratch["control-16"] and c.cfg.train.init_from is None  # set once the parent exists
        assert c.cfg.model.dim == c.parent_cfg.model.dim
        assert c.cfg.train.max_steps == scratch[c.cfg.arch].train.max_steps
    # --archs keeps a conversion's parent, which it cannot run without
    kept = plans.resolve(plan, "tiny", [0], archs=["three-part"])
    assert [r.variant for r in kept] == ["control-16", "three-part"]
    assert [c.variant for c in plans.conversions(plan, "tiny", [0], archs=["control"])] == []


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            ('from = "deep"', 'from = "dep"'),
            "variant 'rx': from names no variant of this plan: 'dep'; did you mean 'deep'?",
        ),
        (('from = "deep"', 'from = "rx"'), "variant 'rx': from names the variant itself"),
        (('init = "average"\n', ""), "variant 'rx': a conversion needs 'init'"),
        (('init = "average"', 'init = "middle"'), "variant 'rx': 'init' must be one of stepwise, average, select"),
        (('lora_init = "svd"', 'lora_init = "random"'), "variant 'rx': 'lora_init' must be one of svd, zero"),
        (('from = "deep"\n', ""), "variant 'rx': 'init' needs 'from'"),
        (('arch = "relaxed"', 'arch = "three-part"'), "variant 'rx': lora_init: three-part has no per-pass LoRA"),
        (
            (
                'arch = "relaxed"\nfrom = "deep"\ninit = "average"\nlora_init = "svd"',
                'arch = "three-part"\nfrom = "deep"\ninit = "average"',
            ),
            "from 'deep', init 'average': cannot convert control (n_layers=16) into three-part: "
            "ThreePart is a prelude / core / coda model: use select, not average",
        ),
        (
            ("model.n_layers=16", "model.n_layers=8"),
            "from 'deep', init 'average': cannot convert control (n_layers=8) into relaxed: average maps parent layer "
            "p*L + l to pass p of block l",
        ),
        (
            ('arch = "control"', 'arch = "frailt"'),
            "variant 'rx': from 'deep', init 'average': a retrofit converts a plain transformer (control), not frailt",
        ),
        (
            ("steps = 3", 'steps = 3\nset = ["model.dim=64"]'),
            "the parent's tok_embeddings.weight has shape (512, 32) but the target's is (512, 64)",
        ),
    ],
)
def test_a_bad_conversion_is_one_line_naming_the_file_and_key(tmp_path, edit, says):
    assert edit[0] in PLAN
    path = write(tmp_path, PLAN.replace(*edit))
    with pytest.raises(ConfigError) as e:
        plan = plans.load(path)
        plans.resolve(plan, "tiny", [0])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and says in msg, msg


def test_a_chain_of_conversions_is_refused(tmp_path):
    path = write(tmp_path, PLAN + '\n[[variant]]\nname = "rx2"\narch = "relaxed"\nfrom = "rx"\ninit = "stepwise"\n')
    with pytest.raises(ConfigError, match="variant 'rx2': from 'rx' is itself a conversion \\(from 'deep'\\)"):
        plans.load(path)


def test_study_with_a_bad_conversion_exits_before_writing_anything(tmp_path, capsys):
    path = write(tmp_path, PLAN.replace('init = "average"', 'init = "select"'))
    db = tmp_path / "r.db"
    data = layout_data_dir(tmp_path)  # passes the early --data check: the plan's error comes first
    with pytest.raises(SystemExit) as e:
        main(["study", "--plan", str(path), "--preset", "tiny", "--db", str(db), "--data", str(data)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "use stepwise or average" in err and str(path) in err and "Traceback" not in err
    assert not db.exists() and not (tmp_path / "reports").exists()


def _rows(db_path, sql):
    con = sqlite3.connect(db_path)
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute(sql)]
    con.close()
    return rows


@pytest.mark.slow  # three studies: training, a conversion, reports
def test_study_converts_the_parent_resumes_a_stopped_conversion_and_a_rerun_trains_nothing(
    tmp_path, tinystories_dir, monkeypatch
):
    from benchctl.stages.train import engine as train

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    opts = StudyOptions(
        preset="tiny",
        plan=str(write(tmp_path, PLAN)),
        seeds=[0],
        db_path=tmp_path / "r.db",
        out_dir=tmp_path / "reports",
        overrides={"data.source": str(tinystories_dir), **FAST},
        skip=tuple(stages.skippable()),
        progress=False,
        bench=False,
    )
    real = train.train_run

    def stopping(cfg, *args, **kw):  # the conversion stops after its first step, as if the study were killed there
        return real(cfg, *args, **kw, stop_after=1 if cfg.train.init_from else None)

    monkeypatch.setattr(train, "train_run", stopping)
    lines: list[str] = []
    run_study(opts, log=lines.append)
    ran = [s.name for s in stages.registered() if s.run is not None]
    assert (
        f"== {ran.index('retrofit') + 1}/{len(ran)} retrofit: plan mini-retrofit: 1 conversion(s) — rx × seeds [0]"
        in lines
    )
    stopped = {r["variant"]: r for r in _rows(opts.db_path, "select * from runs")}["rx"]
    assert stopped["status"] == "running" and stopped["step"] == 1
    monkeypatch.setattr(train, "train_run", real)
    lines = []
    report_path = run_study(opts, log=lines.append)
    runs = {r["variant"]: r for r in _rows(opts.db_path, "select * from runs")}
    assert set(runs) == {"deep", "rx"}
    deep, rx = runs["deep"], runs["rx"]
    assert f"resuming {rx['id']} from step 1/3" in " ".join(lines)  # from its checkpoint, not converted again
    assert deep["status"] == rx["status"] == "done" and deep["parent_run_id"] is None
    assert rx["parent_run_id"] == deep["id"] and rx["init_method"] == "average+svd"
    assert rx["initial_val_loss"] == stopped["initial_val_loss"]
    assert rx["step"] == 3  # the variant's own healing steps beat the command line's max_steps, as for any variant
    assert rx["parent_tokens"] == deep["tokens_seen"]
    assert f'"init_from": "{deep["id"]}:average+svd"' in rx["config_json"]
    assert {(r["variant"], r["run_id"]) for r in _rows(opts.db_path, "select * from plan_runs")} == {
        ("deep", deep["id"]),
        ("rx", rx["id"]),
    }
    assert "| rx | average+svd |" in report_path.read_text()  # the Retrofit section, under the variant's name
    # a rerun converts and trains nothing: both runs are found done
    again: list[str] = []
    run_study(opts, log=again.append)
    assert [ln for ln in again if ln.startswith("  already done: ")] == [
        f"  already done: {deep['id']}",
        f"  already done: {rx['id']}",
    ]
    assert {r["id"]: r["updated_at"] for r in _rows(opts.db_path, "select * from runs")} == {
        r["id"]: r["updated_at"] for r in runs.values()
    }


def test_a_conversion_whose_parent_failed_is_reported_not_run(tmp_path, tinystories_dir, monkeypatch):
    from benchctl.core.errors import BenchctlError

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    train = next(s for s in stages.registered() if s.name == "train")

    def no_parent(s: stages.StudyRun) -> None:
        from benchctl.stages import TrainAllResult

        s.trained = TrainAllResult(failed=[("deep-id", "diverged")])

    keep = tuple(s for s in stages.registered() if s.name != "train")
    fake = stages.Stage(name="train", order=train.order, run=no_parent, tables=train.tables)
    monkeypatch.setattr(stages, "registered", lambda: tuple(sorted(keep + (fake,), key=lambda s: s.order)))
    opts = StudyOptions(
        preset="tiny",
        plan=str(write(tmp_path, PLAN)),
        seeds=[0],
        db_path=tmp_path / "r.db",
        out_dir=tmp_path / "reports",
        overrides={"data.source": str(tinystories_dir), **FAST},
        skip=tuple(stages.skippable()),
        progress=False,
        bench=False,
    )
    with pytest.raises(
        BenchctlError,
        match="2 training run\\(s\\) failed: .*rx seed 0: its parent deep .* is not "
        "trained, so there is nothing to convert",
    ):
        run_study(opts, log=lambda _: None)
    assert _rows(opts.db_path, "select id from runs") == []


@pytest.mark.slow  # four tiny runs of a few steps each, then the report
def test_study_plan_retrofit_at_tiny_from_the_command_line(tmp_path, tinystories_dir, monkeypatch, capsys):
    """The built-in plan from the command line, kept to its three-part variants (--archs keeps the parent its
    conversions need); every conversion of the plan is resolved in the test above."""
    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "r.db"
    args = [
        "study",
        "--plan",
        "retrofit",
        "--preset",
        "tiny",
        "--seeds",
        "0",
        "--no-bench",
        "--skip",
        "sample,judge,eval,depth,infer",
        "--db",
        str(db),
        "--out",
        str(tmp_path / "reports"),
        "--data",
        str(tinystories_dir),
        "--no-progress",
        "--archs",
        "three-part",
        *[x for k, v in FAST.items() for x in ("--set", f"{k}={v}")],
    ]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0, capsys.readouterr().err
    runs = _rows(db, "select variant, status, init_method, parent_run_id from runs")
    assert all(r["status"] == "done" for r in runs) and len(runs) == 4
    parent = _rows(db, "select id from runs where variant = 'control-16'")[0]["id"]
    conv = {r["variant"]: r["init_method"] for r in runs if r["parent_run_id"] == parent}
    assert conv == {"three-part-select": "select", "three-part-select-curr": "select"}
    assert {r["variant"] for r in runs} == {"control-16", "three-part", *conv}
    assert len(_rows(db, "select * from plan_runs where plan = 'retrofit'")) == 4
    md = (tmp_path / "reports" / "report.md").read_text()
    section = md.split("## Retrofit", 1)[1].split("\n## ", 1)[0]
    assert "| three-part-select-curr | select |" in section and "| three-part-select | select |" in section


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_plans_show_lists_the_conversions_with_their_parent_and_init(capsys, monkeypatch):
    from benchctl import cli

    monkeypatch.setattr(cli.console, "_width", 240)  # a wide terminal: rich would shorten names to fit 80 columns
    with pytest.raises(SystemExit) as e:
        main(["plans", "show", "retrofit", "--preset", "tiny", "--seeds", "0"])
    out = " ".join(capsys.readouterr().out.split())  # the table may wrap a cell over lines
    assert e.value.code == 0
    for name in ("control-16", "relaxed-avg-svd", "three-part-select-curr"):
        assert name in out
    assert "from control-16 (average+svd)" in out and "from control-16 (select), train.recur_curriculum=linear" in out
