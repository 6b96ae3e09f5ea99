"""Study plans: loading and validation, iso-FLOP steps, variant names in results.db (and their migration), the
relaxed LoRA rank rule, and the report sections for models of different sizes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import architectures
from benchctl import plans, report, stages
from benchctl.cli import main
from benchctl.core import accounting, stats
from benchctl.core.config import make_config, run_id
from benchctl.core.errors import ConfigError
from benchctl.stages.report import engine as report_engine
from benchctl.stages.train import tables as train_tables
from tests.fixtures_db import (
    CONTROLS_VARIANTS,
    DEPTH_VARIANTS,
    FINGERPRINT,
    build_plan_fixture_db,
    layout_data_dir,
)

GOOD = """name = "mine"
description = "two models"
seeds = [0, 1]

[[variant]]
name = "small"
arch = "control"

[[variant]]
name = "looped"
arch = "frailt"
set = ["model.n_recur=2"]
"""


def write(tmp_path, text: str):
    p = tmp_path / "plan.toml"
    p.write_text(text)
    return p


def test_builtin_plans_and_their_variants():
    assert plans.builtin_names() == ["study", "controls", "depth", "isoflop", "retrofit", "survey"]
    by = {p.name: p for p in plans.builtin()}
    assert [v.name for v in by["study"].variants] == ["control", "frailt", "three-part", "relaxed"]
    assert [v.name for v in by["controls"].variants] == [
        "control",
        "frailt",
        "three-part",
        "relaxed",
        "control-2x",
        "control-16",
        "control-iso-flops",
    ]
    assert [v.name for v in by["survey"].variants] == [v.name for v in by["controls"].variants] + [
        "ut-act",
        "mor-expert",
        "mor-token",
        "shared-cycle",
        "huginn",
        "trm",
    ]
    assert len(by["depth"].variants) == 12
    conversions = [v.name for v in by["retrofit"].variants if v.parent == "control-16"]
    assert len(conversions) == 6 and {"relaxed", "three-part"} <= {v.name for v in by["retrofit"].variants}
    assert all(p.description and len(p.sha256) == 64 for p in by.values())


def test_a_plan_file_resolves_with_its_seeds_and_sets(tmp_path):
    plan = plans.load(write(tmp_path, GOOD))
    runs = plans.resolve(plan, "tiny", list(plan.seeds))
    assert [(r.variant, r.cfg.arch, r.cfg.seed, r.cfg.model.n_recur) for r in runs] == [
        ("small", "control", 0, 1),
        ("looped", "frailt", 0, 2),
        ("small", "control", 1, 1),
        ("looped", "frailt", 1, 2),
    ]
    assert [r.variant for r in plans.resolve(plan, "tiny", [0], archs=["frailt"])] == ["looped"]


@pytest.mark.parametrize(
    "edit, says",
    [
        (('arch = "frailt"', 'archh = "frailt"'), "variant 'looped': unknown key 'archh'; did you mean 'arch'?"),
        (
            ("model.n_recur=2", "model.dimm=64"),
            "variant 'looped': unknown config key 'model.dimm'; did you mean 'model.dim'?",
        ),
        (('arch = "frailt"', 'arch = "frail"'), "variant 'looped': arch: unknown architecture 'frail'"),
        (('name = "looped"', 'name = "small"'), "variant name 'small' is used twice"),
        (("seeds = [0, 1]", "seedz = [0, 1]"), "unknown key 'seedz'; did you mean 'seeds'?"),
        (("model.n_recur=2", "model.n_recur=0"), "variant 'looped': model.n_recur: must be >= 1"),
        (
            ('set = ["model.n_recur=2"]', 'match_train_flops = "big"'),
            "variant 'looped': match_train_flops names no variant of this plan: 'big'",
        ),
        (('set = ["model.n_recur=2"]', 'steps = 10\nmatch_train_flops = "small"'), "both set the training length"),
        (('set = ["model.n_recur=2"]', "steps = 2"), "variant 'looped': steps: train.warmup_steps"),
    ],
)
def test_a_bad_plan_is_one_line_naming_the_file_and_key(tmp_path, edit, says):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError) as e:
        plan = plans.load(path)
        plans.resolve(plan, "tiny", list(plan.seeds or [0]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and says in msg, msg


@pytest.mark.parametrize(
    "edit",
    [
        ("archh", 'arch = "frailt"', 'archh = "frailt"'),
        ("model.dimm", "model.n_recur=2", "model.dimm=64"),
        ("unknown architecture", 'arch = "frailt"', 'arch = "nope"'),
    ],
)
def test_study_with_a_bad_plan_exits_before_writing_anything(tmp_path, capsys, edit):
    says, old, new = edit
    path = write(tmp_path, GOOD.replace(old, new))
    db = tmp_path / "r.db"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "study",
                "--plan",
                str(path),
                "--preset",
                "tiny",
                "--db",
                str(db),
                "--data",
                str(layout_data_dir(tmp_path)),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and says in err and str(path) in err
    assert len(err.splitlines()) <= 2  # one line (the console may wrap a long one)
    assert not db.exists() and not (tmp_path / "reports").exists()


def test_unknown_plan_name_suggests_a_builtin():
    with pytest.raises(ConfigError, match="unknown plan 'control'; did you mean 'controls'"):
        plans.load("control")


@pytest.fixture(scope="module")
def controls_tiny():
    return {r.variant: r.cfg for r in plans.resolve(plans.load("controls"), "tiny", [0])}


def test_iso_flop_steps_match_the_named_variants_training_flops(controls_tiny):
    runs = controls_tiny
    frailt, iso = runs["frailt"], runs["control-iso-flops"]
    fpt_frailt = accounting.describe(frailt)["flops_per_token"]
    fpt_ctrl = accounting.describe(iso)["flops_per_token"]
    target = fpt_frailt * frailt.train.max_steps * frailt.tokens_per_step
    assert iso.train.max_steps == round(target / (fpt_ctrl * iso.tokens_per_step)) == 101
    assert abs(plans.train_flops(iso) / target - 1) < 0.01
    assert iso.train.warmup_steps == frailt.train.warmup_steps  # warm-up unchanged
    assert runs["control-2x"].model.n_layers == 8 and runs["control-16"].model.n_layers == 16
    assert accounting.describe(runs["control-16"])["flops_per_token"] == fpt_frailt  # 16 block applications each


@pytest.mark.parametrize("preset", ["tiny", "small", "paper"])
def test_survey_designs_have_about_the_controls_unique_parameters(preset):
    runs = {r.variant: r.cfg for r in plans.resolve(plans.load("survey"), preset, [0])}
    ctrl = accounting.describe(runs["control"])["total_params"]
    for name in ("ut-act", "mor-expert", "mor-token", "shared-cycle", "huginn", "trm"):
        assert abs(accounting.describe(runs[name])["total_params"] / ctrl - 1) <= 0.10, (preset, name)
    assert runs["mor-token"].model.arch_args.mor_routing == "token"
    assert runs["mor-expert"].model.arch_args.mor_routing == "expert"
    controls = {r.variant: r.cfg for r in plans.resolve(plans.load("controls"), preset, [0])}
    assert all(run_id(cfg, "fp") == run_id(runs[name], "fp") for name, cfg in controls.items())


def test_a_variant_is_a_label_not_part_of_the_run_id(controls_tiny):
    study = {r.variant: r.cfg for r in plans.resolve(plans.load("study"), "tiny", [0])}
    controls = controls_tiny
    depth = {r.variant: r.cfg for r in plans.resolve(plans.load("depth"), "tiny", [0])}
    assert run_id(study["control"], "fp") == run_id(controls["control"], "fp") == run_id(make_config("tiny"), "fp")
    assert run_id(depth["frailt-r4"], "fp") == run_id(study["frailt"], "fp")
    assert run_id(depth["three-part-r7"], "fp") == run_id(study["three-part"], "fp")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_relaxed_lora_rank_rule():
    paper = make_config("paper", "relaxed")
    assert paper.model.arch_args.lora_rank == 16 and accounting.describe(paper)["total_params"] == 5_462_272
    small = make_config("small", "relaxed")
    assert small.model.arch_args.lora_rank == 7
    ctrl = accounting.describe(make_config("small", "control"))["total_params"]
    lora = accounting.describe(small)["lora"]
    assert abs(lora / ctrl - 0.297) < 0.01  # the paper's share, not rank 16's +68%
    assert make_config("small", "relaxed", overrides={"model.lora_rank": "auto"}).model.arch_args.lora_rank == 7
    assert make_config("small", "relaxed", overrides={"model.lora_rank": "3"}).model.arch_args.lora_rank == 3
    assert make_config("tiny", "relaxed").model.arch_args.lora_rank == 4  # the tiny preset sets its own


def test_old_database_gets_variant_column_named_after_the_arch(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "create table runs (id text primary key, arch text not null, preset text not null, "
        "seed integer not null, status text not null default 'pending', config_json text not null)"
    )
    conn.execute("insert into runs values ('r1', 'frailt', 'tiny', 0, 'done', '{}')")
    conn.execute("create table meta (key text primary key, value text)")  # every benchctl wrote its version
    conn.execute("insert into meta values ('schema_version', '1')")
    conn.commit()
    conn.close()
    db = stages.connect(path)
    assert [dict(r) for r in db.query("select id, variant from runs")] == [{"id": "r1", "variant": "frailt"}]
    assert "plan_runs" in db.table_names()


def test_a_run_keeps_its_first_variant_name_and_plans_keep_theirs(tmp_path):
    db = stages.connect(tmp_path / "r.db")
    train_tables.start_run(
        db,
        {
            "id": "r1",
            "arch": "frailt",
            "preset": "tiny",
            "seed": 0,
            "status": "running",
            "config_json": "{}",
            "variant": "frailt",
        },
        new=True,
        resume_step=0,
    )
    train_tables.start_run(
        db,
        {
            "id": "r1",
            "arch": "frailt",
            "preset": "tiny",
            "seed": 0,
            "status": "running",
            "config_json": "{}",
            "variant": "frailt-r4",
        },
        new=False,
        resume_step=0,
    )
    row = {"preset": "tiny", "seed": 0, "run_id": "r1", "plan_path": "p", "plan_sha256": "h"}
    train_tables.record_plan_runs(
        db, [{**row, "plan": "study", "variant": "frailt"}, {**row, "plan": "depth", "variant": "frailt-r4"}]
    )
    assert train_tables.get_run(db, "r1")["variant"] == "frailt"
    assert {(r["plan"], r["variant"]) for r in train_tables.plan_runs(db)} == {
        ("study", "frailt"),
        ("depth", "frailt-r4"),
    }
    train_tables.start_run(
        db,
        {"id": "r2", "arch": "control", "preset": "tiny", "seed": 0, "status": "running", "config_json": "{}"},
        new=True,
        resume_step=0,
    )
    assert train_tables.get_run(db, "r2")["variant"] == "control"  # trained without a plan: its arch name


@pytest.fixture(scope="module")
def plan_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "results.db"
    build_plan_fixture_db(path, "controls", CONTROLS_VARIANTS, seeds=(0, 1))
    build_plan_fixture_db(path, "depth", DEPTH_VARIANTS, seeds=(0, 1))
    return path


@pytest.fixture(scope="module")
def rendered(plan_db):
    return report_engine.build(plan_db, plan="controls")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_names_models_by_the_plans_variants(plan_db, rendered):
    md = rendered.markdown
    for name in ("control-2x", "control-16", "control-iso-flops", "frailt-r1", "three-part-r14"):
        assert f"| {name} |" in md
    assert "control [" not in md and "| frailt-r4 |" not in md  # frailt-r4 is the controls plan's frailt
    data = report.read(plan_db, stages.tables())
    depth = report.build_context(data.runs, "tiny", data.plan_runs, "depth").models
    assert "frailt-r4" in depth and "frailt" not in depth and "three-part-r7" in depth
    stored = report.build_context(data.runs, "tiny").models  # no plan: the names stored with the runs
    assert "frailt" in stored and "frailt-r4" not in stored and "control-iso-flops" in stored


def test_report_sections_for_models_of_different_sizes(rendered):
    md = rendered.markdown
    order = [
        "## Loss",
        "## Loss against compute",
        "## Loss against parameters",
        "## Loss against training depth",
        "## Comparisons",
        "## Fair comparisons",
        "## Provenance",
        "## Plans",
    ]
    pos = [md.index(f"\n{s}\n") for s in order]
    assert pos == sorted(pos)
    assert {"loss_vs_compute.png", "loss_vs_params.png", "loss_vs_depth.png"} <= set(rendered.figures)
    assert "analytic count" in md and "3x forward" in md
    fair = md[md.index("\n## Fair comparisons\n") : md.index("\n## Benchmark\n")]
    for line in (
        "| frailt | control | unique parameters |",
        "| frailt | control-16 | FLOPs per token |",
        "| frailt | control-iso-flops | training FLOPs |",
    ):
        assert line in fair
    assert "Holm-adjusted" in fair
    # the adjusted p names its family, and the paragraph says the same pairs are adjusted again in Comparisons
    n = sum(1 for line in fair.splitlines() if line.startswith("| ") and "×" in line)
    assert f"| p (Holm over these {n}) |" in fair
    assert "Holm-adjusted p = " in fair and f"over the {n} fair comparisons of this table" in fair
    assert "Comparisons adjusts the same pairs again over every pair of models" in fair
    assert "| p (sign-flip) |" in fair
    depth = md[md.index("\n## Loss against training depth\n") : md.index("\n## Comparisons\n")]
    assert "| frailt | frailt-r1 | 2 | 4 | 1 |" in depth and "| three-part | three-part-r14 | 2 | 30 | 14 |" in depth


def test_no_significant_difference_is_said_when_holm_p_is_large():
    from benchctl.stages.report.fair import sentence

    r = {
        "a": "frailt",
        "b": "control",
        "matched": "unique parameters",
        "params_ratio": 1.0,
        "fpt_ratio": 3.4,
        "train_flops_ratio": 3.4,
        "diff": -0.1,
        "lo": -0.19,
        "hi": -0.01,
        "p": 0.03,
        "p_holm": 0.09,
        "family": "the 9 fair comparisons of this table",
        "test": stats.compare_seeds({0: 1.30, 1: 1.42, 2: 1.51}, {0: 1.42, 1: 1.49, 2: 1.63}),
    }
    assert sentence(r).startswith("No significant difference in final validation loss between frailt and control")
    assert "Holm-adjusted p = 0.090 over the 9 fair comparisons of this table" in sentence(r)
    low = sentence({**r, "p_holm": 0.01})
    assert low.startswith("frailt's final validation loss is lower than control's")
    # three seeds: the significance is the t-test's alone, and the sentence says what it assumes
    assert "significant only under the t-test's assumption of normal differences: exact sign-flip p = 0.25" in low


def test_plans_command_lists_the_builtins(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plans"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(name in out for name in ("controls", "depth", "study", "retrofit"))


def test_a_fixture_run_reached_again_keeps_its_name(plan_db):
    db = stages.connect(plan_db)
    frailt = run_id(make_config("tiny", "frailt", 0), FINGERPRINT)
    assert train_tables.get_run(db, frailt)["variant"] == "frailt"
    assert {r["variant"] for r in train_tables.plan_runs(db, "depth") if r["run_id"] == frailt} == {"frailt-r4"}


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_study_with_a_plan_names_its_runs_and_records_the_plan(tmp_path, tinystories_dir, monkeypatch):
    """Real training (two steps each): a plan variant's name lands in runs.variant and plan_runs, and a run the
    plan reaches again under another name keeps its first name."""
    from benchctl.study import StudyOptions, run_study

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    path = write(
        tmp_path,
        'name = "two"\ndescription = "d"\n[[variant]]\nname = "base"\narch = "control"\n'
        '[[variant]]\nname = "same-again"\narch = "control"\nset = ["model.n_layers=4"]\n',
    )
    opts = StudyOptions(
        preset="tiny",
        plan=str(path),
        seeds=[0],
        db_path=tmp_path / "r.db",
        out_dir=tmp_path / "reports",
        overrides={
            "data.source": str(tinystories_dir),
            "train.max_steps": 2,
            "train.eval_interval": 1,
            "train.warmup_steps": 1,
        },
        skip=("sample", "judge", "eval"),
        progress=False,
        bench=False,
    )
    report_path = run_study(opts, log=lambda _: None)
    db = stages.connect(tmp_path / "r.db")
    assert [r["variant"] for r in train_tables.runs(db)] == ["base"]
    assert {(r["plan"], r["variant"]) for r in train_tables.plan_runs(db)} == {("two", "base"), ("two", "same-again")}
    assert {r["plan_sha256"] for r in train_tables.plan_runs(db)} == {plans.load(path).sha256}
    md = report_path.read_text()
    assert "| two |" in md and "| base |" in md and "| same-again |" not in md  # one run, its first name


def test_train_all_with_a_bad_plan_writes_nothing(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("model.n_recur=2", "model.dimm=64"))
    db = tmp_path / "r.db"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train-all",
                "--plan",
                str(path),
                "--preset",
                "tiny",
                "--db",
                str(db),
                "--data",
                str(layout_data_dir(tmp_path)),
            ]
        )
    assert e.value.code == 2 and "unknown config key 'model.dimm'" in capsys.readouterr().err
    assert not db.exists()


def test_report_names_a_builtin_plan_file_by_its_place_in_the_package(rendered):
    section = rendered.markdown[rendered.markdown.index("\n## Plans\n") :]
    assert "built in: `benchctl/plans/controls.toml`" in section
    assert str(Path(plans.__file__).parent) not in section  # no local install directory


def test_the_plans_table_says_how_many_seeds_and_which(rendered, tmp_path):
    """A bare "0" in the seeds column read as zero seeds: the column gives the count and the seeds."""
    section = rendered.markdown[rendered.markdown.index("\n## Plans\n") :]
    rows = [line for line in section.splitlines() if line.startswith("| controls |") or line.startswith("| depth |")]
    assert len(rows) == 2 and all("| 2 seeds (0, 1) |" in row for row in rows)
    one = build_plan_fixture_db(tmp_path / "one.db", "controls", CONTROLS_VARIANTS[:2], seeds=(0,))
    section = report_engine.build(one, plan="controls").markdown.split("\n## Plans\n", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| controls |"))
    assert row.endswith("| 2 | 1 seed (0) | 2 |")


def test_plans_show_says_a_match_against_an_adaptive_variant_is_its_upper_bound(tmp_path, capsys):
    """Training FLOPs matched to ut-act or mor are their analytic count, every token at full depth: `plans show`
    says so for those variants, and only for them."""
    text = (
        GOOD + '\n[[variant]]\nname = "halting"\narch = "ut-act"\n\n[[variant]]\nname = "iso-ut"\narch = "control"\n'
        'match_train_flops = "halting"\n\n[[variant]]\nname = "iso-looped"\narch = "control"\n'
        'set = ["model.dim=48"]\nmatch_train_flops = "looped"\n'
    )
    with pytest.raises(SystemExit) as e:
        main(["plans", "show", str(write(tmp_path, text)), "--preset", "tiny"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "steps: halting's training FLOPs (analytic upper bound)" in out
    assert "steps: looped's training FLOPs (analytic" not in out
    assert "iso-ut matches halting's analytic training FLOPs, an upper bound: halting (ut-act)" in out
    assert "iso-looped matches" not in out
    builtin = ("control", "frailt", "three-part", "relaxed", "ut-act", "mor", "shared-cycle", "huginn", "trm")
    assert [a for a in builtin if architectures.get(a).adaptive_compute] == ["ut-act", "mor"]
