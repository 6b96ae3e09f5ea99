"""Training and scoring runs on a reasoning task (`tasks/`): the task in the run config and the run id, the problem
stream, the answer-only loss, the accuracy stage and its table, `benchctl tasks`, and the one-line errors for bad
input (unknown task, unknown knob, a level out of range, a context too short, a story-only stage asked of a task run).

The generators themselves are tested in tests/test_tasks.py. One tiny run on `addition` is trained once for the
module (a few seconds) and shared by the tests that need a finished task run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import architectures
import tasks
from benchctl import stages
from benchctl.cli import main
from benchctl.core import taskdata
from benchctl.core.config import RunConfig, identity_diff, make_config, run_id
from benchctl.core.errors import CheckpointError, ConfigError
from benchctl.stages.accuracy.options import default_depths
from benchctl.stages.train.engine import train_run


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stderr, stdout) of `benchctl ARGV`."""
    code: int | str | None = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return (0 if code is None else int(code)), out.err, out.out


# ---- the config ----------------------------------------------------------------------------------------------------


def test_stories_is_the_default_and_changes_no_run_id():
    cfg = make_config("small", "control")
    assert cfg.task.name == "stories" and cfg.task.loss == "all" and cfg.task.args is None
    # the id of a stories run hashes no task key: the same as before tasks existed (pinned from the committed study)
    flat_keys = json.loads(cfg.to_json())
    assert flat_keys["task"] == {"name": "stories", "loss": "all"}
    legacy = json.loads(cfg.to_json())
    del legacy["task"]  # a config stored before tasks existed
    old = RunConfig.from_json(json.dumps(legacy))
    assert old == cfg and run_id(old, "fp") == run_id(cfg, "fp")
    assert "stories" not in run_id(cfg, "fp")


def test_a_task_run_takes_the_tasks_vocabulary_context_and_length():
    cfg = make_config("small", "frailt", overrides={"task.name": "addition"})
    task = tasks.build("addition")
    assert cfg.task.loss == "answer"
    assert cfg.model.vocab_size == task.tokenizer().vocab_size
    assert cfg.model.max_seq_len == task.max_len() - 1  # inputs: the longest encoded problem less its last token
    for key, value in task.train_overrides("small").items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value  # the same for every architecture
    assert RunConfig.from_json(cfg.to_json()) == cfg
    rid = run_id(cfg, "fp")
    assert rid.startswith("frailt-addition-small-s0-")
    other = make_config("small", "frailt", overrides={"task.name": "addition", "task.max_digits": 8})
    assert run_id(other, "fp") != rid and "task.max_digits: 10 != 8" in identity_diff(cfg, other)
    loss_all = make_config("small", "frailt", overrides={"task.name": "addition", "task.loss": "all"})
    assert run_id(loss_all, "fp") != rid


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"task.name": "adition"}, "unknown task 'adition'; did you mean 'addition'? available: stories, "),
        ({"task.name": "addition", "task.max_digit": 3}, "did you mean 'task.max_digits'?"),
        ({"task.max_digits": 3}, "config key 'task.max_digits' is a knob of task 'addition', not of 'stories'"),
        ({"task.name": "addition", "task.max_digits": 0}, "task.max_digits"),
        ({"task.name": "addition", "model.max_seq_len": 32}, "needs a context of at least 64 tokens"),
        ({"task.loss": "answer"}, "task.loss: stories learns every token"),
    ],
)
def test_bad_task_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        make_config("tiny", "control", overrides=overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_bad_task_input_with_exit_2(capsys, tmp_path):
    db = str(tmp_path / "r.db")
    code, err, _ = run_cli(capsys, ["train", "--arch", "control", "--preset", "tiny", "--task", "parit", "--db", db])
    assert code == 2 and "unknown task 'parit'; did you mean 'parity'?" in err and "maze" in err
    code, err, _ = run_cli(
        capsys, ["train", "-a", "control", "-p", "tiny", "--task", "sum", "--set", "task.max_operand=3", "--db", db]
    )
    assert code == 2 and "task.max_operands" in err
    code, err, _ = run_cli(
        capsys,
        ["train", "-a", "control", "-p", "tiny", "--task", "maze", "--set", "model.max_seq_len=100", "--db", db],
    )
    assert code == 2 and "needs a context of at least" in err
    assert not Path(db).exists()  # refused before anything was written


# ---- the problem stream ----------------------------------------------------------------------------------------------


def test_the_training_stream_is_reproducible_resumable_and_split_across_ranks():
    task = tasks.build("sum")
    a = taskdata.TaskSampler(task, 40, 8, seed=3, loss="answer")
    batches = [a.next_batch() for _ in range(3)]
    b = taskdata.TaskSampler(task, 40, 8, seed=3, loss="answer")
    b.next_batch()
    state = b.state_dict()
    c = taskdata.TaskSampler(task, 40, 8, seed=3, loss="answer")
    c.load_state_dict(state)
    for want, got in zip(batches[1:], [c.next_batch(), c.next_batch()]):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    # two ranks each keep their rows of the same global batch
    r0 = taskdata.TaskSampler(task, 40, 8, seed=3, loss="answer", rank=0, world_size=2).next_batch()
    r1 = taskdata.TaskSampler(task, 40, 8, seed=3, loss="answer", rank=1, world_size=2).next_batch()
    assert torch.equal(batches[0][0][0::2], r0[0]) and torch.equal(batches[0][0][1::2], r1[0])
    # fresh problems, never an epoch: no prompt repeats over the first batches, and none is a held-out one
    x = torch.cat([bt[0] for bt in batches])
    assert len({tuple(r.tolist()) for r in x}) == len(x)
    with pytest.raises(CheckpointError, match="problem stream"):
        taskdata.TaskSampler(task, 40, 16, seed=3, loss="answer").load_state_dict(state)


def test_answer_only_loss_is_the_cross_entropy_of_the_answer_tokens():
    cfg = make_config("tiny", "control", overrides={"task.name": "addition"})
    task = taskdata.build_task(cfg.task)
    torch.manual_seed(0)
    model = architectures.build("control", cfg.model).eval()
    x, y = taskdata.TaskSampler(task, cfg.model.max_seq_len, 4, seed=0, loss="answer").next_batch()
    with torch.no_grad():
        logits, loss = model(x, y)
        _, loss_all = model(x, taskdata.TaskSampler(task, cfg.model.max_seq_len, 4, seed=0, loss="all").next_batch()[1])
    tok = task.tokenizer()
    want, n = 0.0, 0
    for b in range(len(x)):
        p = task.problem("train", "id", 0, b)
        ids, start = tok.encode(p)
        for t in range(start - 1, len(ids) - 1):  # logits at t predict ids[t+1]: the answer tokens and the end
            want -= float(F.log_softmax(logits[b, t].float(), -1)[ids[t + 1]])
            n += 1
    assert n == int((y != -1).sum())
    assert math.isclose(float(loss), want / n, rel_tol=1e-5)
    assert not math.isclose(float(loss_all), float(loss), rel_tol=1e-3)


def test_the_data_fingerprint_follows_the_generator_version(monkeypatch):
    """A task whose generator changes what a coordinate gives raises its version: its runs get new ids."""
    task = tasks.build("addition")
    before = taskdata.fingerprint(task)
    assert taskdata.fingerprint(tasks.build("addition")) == before
    monkeypatch.setattr(type(task), "version", task.version + 1)
    assert taskdata.fingerprint(task) != before


def test_validation_problems_are_held_out_and_fixed():
    task = tasks.build("addition")
    v = taskdata.val_problems(task, 64, 16, seed=1337)
    assert v.shape == (16, 2, 64) and torch.equal(v, taskdata.val_problems(task, 64, 16, seed=1337))
    prompts = {task.problem("valid", "id", 1337, i).prompt for i in range(16)}
    assert all(task.split_of(tasks.Problem(p, "", {})) == "valid" for p in prompts)


# ---- a finished run ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A tiny control trained on addition (answer-only loss), in its own results.db."""
    root = tmp_path_factory.mktemp("taskrun")
    db_path = root / "results.db"
    cfg = make_config("tiny", "control", overrides={"task.name": "addition", "train.max_steps": 12})
    db = stages.connect(db_path)
    prepared = taskdata.prepare_task(cfg.task)
    result = train_run(cfg, prepared, db, db_path, progress=False, log=lambda *_: None)
    return db_path, result.run_id, cfg


@pytest.fixture(scope="module")
def looped_run(task_run):
    """A tiny frailt (a looped model: several test-time depths) beside the control, in the same results.db."""
    db_path, _, _ = task_run
    cfg = make_config("tiny", "frailt", overrides={"task.name": "addition", "train.max_steps": 6})
    db = stages.connect(db_path)
    result = train_run(cfg, taskdata.prepare_task(cfg.task), db, db_path, progress=False, log=lambda *_: None)
    return db_path, result.run_id, cfg


def test_a_task_run_trains_and_stores_its_tokenizer(task_run):
    db_path, rid, cfg = task_run
    row = stages.connect(db_path)["runs"].get(rid)
    assert row["status"] == "done" and row["data_source"] == "task:addition"
    assert row["data_train_tokens"] is None  # a stream of fresh problems has no epochs
    tok = db_path.parent / "runs" / rid / "tokenizer.json"
    assert tasks.CharTokenizer.from_json(tok.read_text()) == tasks.build("addition").tokenizer()
    assert math.isfinite(row["final_val_loss"])


def test_accuracy_scores_every_level_and_reruns_skip(task_run, capsys):
    db_path, rid, cfg = task_run
    argv = ["accuracy", "--db", str(db_path), "--problems", "20", "--no-progress"]
    code, err, out = run_cli(capsys, argv)
    assert code == 0, err
    rows = list(stages.connect(db_path).query("select * from accuracy_results where run_id = ? order by level", [rid]))
    assert {r["level"] for r in rows} == {lv.name for lv in tasks.build("addition").levels()}
    for r in rows:
        assert r["run_id"] == rid and r["problems"] == 20 and r["n_recur"] == 1 == r["trained_n_recur"]
        assert r["correct"] == round(r["accuracy"] * 20) and 0 <= r["position_accuracy"] <= 1
        assert sum(n for n, _ in json.loads(r["by_difficulty"]).values()) == 20
        assert r["decode_path"].startswith("fast")
        assert math.isfinite(r["answer_loss"])
    id_row = next(r for r in rows if r["level"] == "id")
    assert id_row["in_distribution"] == 1
    code, _, out = run_cli(capsys, [*argv, "--runs", rid])
    assert code == 0 and "0 measured, 3 already stored" in out
    code, err, _ = run_cli(capsys, [*argv, "--levels", "d99"])
    assert code == 2 and "task addition has no level d99; its levels: id, d15, d20" in err


def test_accuracy_matches_the_tasks_scorer_on_the_decoded_answers(task_run):
    """The stored count is what scoring the greedy answers gives (recomputed here from the model, problem by problem,
    with the reference decode path)."""
    from architectures.generate import generate
    from benchctl.core import checkpoint
    from benchctl.stages.accuracy import engine

    db_path, rid, cfg = task_run
    model, cfg, _ = checkpoint.load_model(checkpoint.run_dir(db_path, rid) / checkpoint.CKPT_NAME)
    task = taskdata.build_task(cfg.task)
    level = task.level("id")
    row = engine.measure(model, cfg, task, level, 1, 10, 0, torch.device("cpu"))
    tok = task.tokenizer()
    right = 0
    for p in task.problems("test", "id", 0, 10):
        out = generate(
            model,
            [[tok.bos_id, *tok.encode_text(p.prompt)]],
            max_new_tokens=task.max_prompt_answer(level)[1] + 1,
            temperature=0.0,
            stop_ids=[tok.eos_id],
            fast=False,
        )
        right += int(tok.decode(out[0].tokens) == p.answer)
    assert row["correct"] == right


@pytest.mark.slow  # accuracy at every depth, then a whole report with its figures
def test_the_report_shows_accuracy_per_level_and_against_depth(looped_run, tmp_path, capsys):
    from benchctl.stages.report import engine as report_engine

    db_path, rid, cfg = looped_run
    code, err, _ = run_cli(capsys, ["accuracy", "--db", str(db_path), "--problems", "10", "--no-progress"])
    assert code == 0, err
    rows = list(stages.connect(db_path).query("select * from accuracy_results where run_id = ?", [rid]))
    assert sorted({r["n_recur"] for r in rows}) == default_depths(4, None)  # frailt trained at 4 passes
    out = report_engine.write_report(db_path, tmp_path / "rep")
    md = out.read_text()
    section = md.split("## Reasoning tasks", 1)[1].split("\n## ", 1)[0]
    assert "### addition" in section and "| frailt | 1 |" in section and "| frailt | 16 |" in section
    # the table's cells are the stored accuracies (one seed: the value itself)
    at = {r["level"]: r for r in rows if r["n_recur"] == 4}
    assert f"{100 * at['d15']['accuracy']:.1f} (1 seed)" in section
    assert (out.parent / "figures" / "task_accuracy_depth.png").is_file()


def test_story_only_stages_refuse_task_runs_with_exit_2(task_run, capsys):
    db_path, rid, _ = task_run
    for argv in (
        ["depth", "--runs", rid],
        ["sample", "--runs", rid],
        ["infer", "--runs", rid],
        ["eval", "--runs", rid],
    ):
        code, err, _ = run_cli(capsys, [*argv, "--db", str(db_path)])
        assert code == 2, (argv, err)
        assert "only means something for TinyStories runs" in err and rid in err, err


def test_accuracy_refuses_a_stories_run(tmp_path, capsys):
    db_path = tmp_path / "r.db"
    db = stages.connect(db_path)
    cfg = make_config("tiny", "control")
    db["runs"].insert(
        {
            "id": "control-tiny-s0-x",
            "arch": "control",
            "preset": "tiny",
            "seed": 0,
            "status": "done",
            "config_json": cfg.to_json(),
        }
    )
    code, err, _ = run_cli(capsys, ["accuracy", "--db", str(db_path), "--runs", "control-tiny-s0-x"])
    assert code == 2 and "scores reasoning-task runs" in err


def test_default_depths_run_from_one_to_four_times_the_trained_depth():
    assert default_depths(1, 1) == [1]
    assert default_depths(4, None) == [1, 2, 4, 8, 12, 16]
    assert default_depths(7, None) == [1, 2, 4, 7, 8, 14, 16, 21, 28]
    assert default_depths(4, 4) == [1, 2, 4]


# ---- benchctl tasks ------------------------------------------------------------------------------------------------


def test_tasks_lists_every_task_with_its_levels(capsys):
    code, err, out = run_cli(capsys, ["tasks"])
    assert code == 0, err
    for name in ["stories", *tasks.names()]:
        assert name in out


def test_tasks_show_prints_problems_of_a_level(capsys):
    code, err, out = run_cli(capsys, ["tasks", "show", "addition", "--level", "d15", "-n", "2"])
    assert code == 0, err
    p = tasks.build("addition").problem("test", "d15", 0, 0)
    assert p.prompt in out and p.answer in out
    code, err, _ = run_cli(capsys, ["tasks", "show", "addition", "--level", "d99"])
    assert code == 2 and "no level 'd99'" in err


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_tasks_export_writes_exactly_the_scored_problems(tmp_path, capsys, suffix):
    out = tmp_path / f"p{suffix}"
    argv = ["tasks", "export", "sum", "-o", str(out), "--level", "n12", "-n", "30", "--set", "task.max_operands=6"]
    code, err, _ = run_cli(capsys, argv)
    assert code == 0, err
    df = (
        pd.read_json(out, lines=True, dtype={"prompt": str, "answer": str})
        if suffix == ".jsonl"
        else pd.read_parquet(out)
    )
    task = tasks.get("sum")(tasks.get("sum").args_cls(max_operands=6))
    want = task.problems("test", "n12", 0, 30)
    assert list(df["prompt"]) == [p.prompt for p in want] and list(df["answer"].astype(str)) == [p.answer for p in want]
    assert list(df["index"]) == list(range(30)) and set(df["difficulty_operands"]) == {12}
    assert json.loads(df["knobs"][0])["max_operands"] == 6
    code, err, _ = run_cli(capsys, argv)
    assert code == 2 and "exists" in err  # never replaced without --force
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no partial file left behind
