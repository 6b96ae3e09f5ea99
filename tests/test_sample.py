"""Tests of benchctl.stages.sample.engine and `benchctl sample`: the prompt rule, the KV-cached ragged generation
against a naive full-sequence loop for every architecture, per-row seeding, stopping, and the pipeline on real tiny
checkpoints (trained for two steps through the real `train-all` once per module) — storage, settings, idempotence,
resume, reproducibility, recurrence overrides and the CLI."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import architectures
from architectures.generate import sample_next
from benchctl import stages
from benchctl.core import db as dbm
from benchctl.core.errors import CheckpointError, ConfigError, DataError
from benchctl.stages import RunSelection
from benchctl.stages.sample import engine as smp
from benchctl.stages.sample.options import DEFAULT_TOP_K, SAMPLER, SampleOptions, context_limit
from benchctl.stages.train import tables as train_tables
from tests.test_architectures import NO_RANDOM_STATE

# ---- the prompt rule -------------------------------------------------------------------------------------------------

LONG_TAIL = " ".join(["They played in the sun all day and laughed."] * 4)  # 36 words of continuation


def test_prompt_rule_takes_whole_sentences_until_enough_words():
    story = "Tom had a ball. It was red and big and he loved it so much every day! Then " + LONG_TAIL
    assert smp.story_opening(story) == "Tom had a ball. It was red and big and he loved it so much every day!"
    # quotes closing a sentence stay with it
    story = 'Lily said, "I want to play in the big green park with my best friend today." ' + LONG_TAIL
    assert smp.story_opening(story).endswith('today."')


def test_prompt_rule_skips_stories_without_a_continuation_or_with_a_run_on_opening():
    short = "Tom had a ball. It was red and big and he loved it so much every day! The end."
    assert smp.story_opening(short) is None
    run_on = " ".join(["and"] * 70) + ". " + LONG_TAIL
    assert smp.story_opening(run_on) is None
    assert smp.story_opening("no sentence end at all " * 20) is None


def test_prompt_set_is_deterministic_skips_duplicates_and_is_versioned():
    good = [f"Story {i} starts here with a dog named Max who loved to run. " + LONG_TAIL for i in range(5)]
    stories = [good[0], "Too short.", good[0], good[1], good[2], good[3], good[4]]
    ps = smp.build_prompt_set(stories, "fp", 4)
    assert [p.source_story for p in ps.prompts] == [0, 3, 4, 5]  # the short story and the repeat are skipped
    assert [p.idx for p in ps.prompts] == [0, 1, 2, 3]
    assert [p.id for p in ps.prompts] == [f"{ps.id}:{i}" for i in range(4)]
    assert smp.build_prompt_set(stories, "fp", 4) == ps
    assert smp.prompt_set_id("fp", 3) != ps.id and smp.prompt_set_id("other", 4) != ps.id
    assert [p.text for p in smp.build_prompt_set(stories, "fp", 3).prompts] == [p.text for p in ps.prompts[:3]]
    with pytest.raises(DataError, match="only 5 of 7 validation stories qualify"):
        smp.build_prompt_set(stories, "fp", 6)


def test_settings_are_validated_and_hashed():
    a = SampleOptions()
    assert a.to_dict()["top_k"] == DEFAULT_TOP_K and a.to_dict()["sampler"] == SAMPLER
    assert SampleOptions(seed=1).hash != a.hash
    assert SampleOptions(batch_size=8).hash != a.hash
    assert SampleOptions(top_k=0).top_k is None
    # which runs, how many prompts, where and in how many processes do not change what a sample is
    assert SampleOptions(n_prompts=3, device="cpu", jobs=2, select=RunSelection(archs=["control"])).hash == a.hash
    for bad in (
        {"temperature": -1.0},
        {"top_p": 1.5},
        {"max_new_tokens": 0},
        {"batch_size": 0},
        {"top_k": -3},
        {"n_prompts": 0},
        {"jobs": "0"},
        {"precision": "fp8"},
    ):
        with pytest.raises(ConfigError):
            SampleOptions(**bad)


def test_the_default_token_limit_is_what_the_context_leaves():
    a = SampleOptions()
    assert a.max_new_tokens is None and a.to_dict()["max_new_tokens"] is None
    # the forwards see the prompt and all new tokens but the last: at most the context
    assert [a.new_token_limit(n, 128) for n in (1, 40, 128, 129, 300)] == [128, 89, 1, 1, 1]
    assert context_limit(40, 128) == 89
    assert SampleOptions(max_new_tokens=256).new_token_limit(40, 128) == 256  # explicit: honoured (with a warning)
    assert SampleOptions(max_new_tokens=256).hash != a.hash
    # precision enters the settings only when set; compiling never changes what a sample is
    assert "precision" not in a.to_dict() and SampleOptions(precision="bfloat16").hash != a.hash
    assert SampleOptions(precision="auto", compile=True).hash == a.hash
    with pytest.raises(ConfigError, match="--n-recur must be >= 1"):
        SampleOptions(n_recur=0)


# ---- generation against a naive loop ---------------------------------------------------------------------------------


def _perturbed(tiny_model, arch: str, **overrides) -> architectures.BaseLM:
    """A tiny model with every parameter perturbed: LoRA B, FraiLT's iteration vectors etc. become non-zero, and
    greedy decoding stops repeating one token (as a freshly initialised model does), so a wrong cache shows."""
    model = tiny_model(arch, **overrides)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[smp.BOS_ID] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def _naive_greedy(model, prompt: list[int], n: int, stop=()) -> list[int]:
    """No cache: re-run the whole (windowed) sequence every step, take the argmax."""
    seq, out = list(prompt), []
    ctx = model.args.max_seq_len
    for _ in range(n):
        logits, _ = model(torch.tensor([seq[-ctx:]]))
        t = int(logits[0, -1].argmax())
        if t in stop:
            break
        out.append(t)
        seq.append(t)
    return out


@pytest.mark.parametrize("arch", architectures.names())
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_greedy_cached_ragged_batch_equals_naive_loop(arch, tiny_model):
    # three-part and huginn draw a fresh random s0 every forward; without it they are deterministic, as the
    # comparison needs
    model = _perturbed(tiny_model, arch, **NO_RANDOM_STATE.get(arch, {}))
    ctx = model.args.max_seq_len
    prompts = _prompts([3, 9, 5, 14], model.args.vocab_size)
    n = ctx + 8  # past the context: the window slides for the last steps
    outs = smp.generate_batch(model, prompts, max_new_tokens=n, temperature=0.0, stop_ids=())
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length"
        assert o.tokens == _naive_greedy(model, p, n)
    # a prompt longer than the context starts with the window already sliding
    long = _prompts([ctx + 3], model.args.vocab_size, seed=1)
    assert smp.generate_batch(model, long, max_new_tokens=4, temperature=0.0, stop_ids=())[0].tokens == _naive_greedy(
        model, long[0], 4
    )


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_sampling_draws_one_stream_per_row_and_matches_the_models_sampler(tiny_model):
    model = _perturbed(tiny_model, "frailt")
    prompts = _prompts([4, 4, 7, 2], model.args.vocab_size, seed=3)
    kw = dict(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, stop_ids=())

    def gens(idxs):
        return [torch.Generator().manual_seed(smp.row_seed(0, i)) for i in idxs]

    batch = smp.generate_batch(model, prompts, generators=gens(range(4)), **kw)
    for i, p in enumerate(prompts):  # alone, or with other companions, a row gives the same sample
        assert smp.generate_batch(model, [p], generators=gens([i]), **kw)[0] == batch[i]
    assert smp.generate_batch(model, prompts[2:], generators=gens([2, 3]), **kw) == batch[2:]
    # one row sampled token by token with the zoo's sampler and the same generator state draws the same tokens
    g, seq = gens([1])[0], torch.tensor([prompts[1]])
    with torch.no_grad():
        for _ in range(20):
            nxt = sample_next(model(seq)[0][:, -1, :], 0.9, 40, 0.95, g)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert seq[0, len(prompts[1]) :].tolist() == batch[1].tokens
    other = smp.generate_batch(model, prompts, generators=[torch.Generator().manual_seed(9) for _ in range(4)], **kw)
    assert other != batch


def test_rows_stop_at_the_stop_token_and_the_rest_continue(tiny_model):
    model = _perturbed(tiny_model, "control")
    prompts = _prompts([5, 6, 8], model.args.vocab_size, seed=5)
    free = smp.generate_batch(model, prompts, max_new_tokens=30, temperature=0.0, stop_ids=())
    stop = free[0].tokens[4]  # a token the first row emits at step j <= 4
    j = free[0].tokens.index(stop)
    outs = smp.generate_batch(model, prompts, max_new_tokens=30, temperature=0.0, stop_ids=(stop,))
    assert outs[0] == smp.Generation(free[0].tokens[:j], "eos")
    for p, o in zip(prompts, outs):  # every row: the naive loop with the same stop token
        expect = _naive_greedy(model, p, 30, stop=(stop,))
        assert o.tokens == expect
        assert o.finish_reason == ("eos" if len(expect) < 30 else "length")


def test_default_stop_tokens_are_bos_and_eos():
    import inspect

    assert inspect.signature(smp.generate_batch).parameters["stop_ids"].default == (1, 2)


@pytest.mark.cuda
def test_greedy_on_cuda_equals_naive_loop(tiny_model):
    model = _perturbed(tiny_model, "relaxed").cuda()
    prompts = _prompts([3, 6], model.args.vocab_size)
    outs = smp.generate_batch(model, prompts, max_new_tokens=12, temperature=0.0, stop_ids=())
    for p, o in zip(prompts, outs):
        seq = list(p)
        for t in o.tokens:
            logits, _ = model(torch.tensor([seq], device="cuda"))
            assert int(logits[0, -1].argmax()) == t
            seq.append(t)


# ---- the pipeline on real tiny checkpoints ---------------------------------------------------------------------------

TRAIN_SET = [
    "train.max_steps=2",
    "train.warmup_steps=1",
    "data.max_train_stories=300",
    "data.tokenizer_stories=300",
    "data.max_valid_stories=120",
    "eval.val_windows=4",
    "model.state_init_std=1.0",
    "model.max_seq_len=64",  # room for the first prompts and their completions (tiny's 32 is shorter than most)
]  # three-part's random s0 then changes its samples: seeding must be exact


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir) -> Path:
    """A results directory with finished tiny control and three-part runs (two optimizer steps each)."""
    from benchctl import cli

    root = tmp_path_factory.mktemp("sample_runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
        args = [
            "train-all",
            "--preset",
            "tiny",
            "--archs",
            "control,three-part",
            "--data",
            str(tinystories_dir),
            "--db",
            str(root / "results" / "results.db"),
            "--no-progress",
            "--yes",
        ]
        for s in TRAIN_SET:
            args += ["--set", s]
        with pytest.raises(SystemExit) as exc:
            cli.main(args)
        assert exc.value.code in (0, None)
    conn = sqlite3.connect(root / "results" / "results.db")
    conn.execute("pragma wal_checkpoint(truncate)")  # the copies below then hold every row in the main file
    conn.close()
    return root


@pytest.fixture
def results(trained, tmp_path, monkeypatch) -> Path:
    """A private copy of the trained results directory (db + checkpoints); returns the db path."""
    monkeypatch.setenv("BENCHCTL_CACHE", str(trained / "cache"))
    shutil.copytree(trained / "results", tmp_path / "results")
    return tmp_path / "results" / "results.db"


SMALL = dict(n_prompts=5, max_new_tokens=10, batch_size=2, progress=False)


def sample_all(db, db_path, *, progress=True, run_ids=None, archs=None, preset=None, **options):
    """`sample_all` with its options as keywords, the run selection among them as on the command line."""
    opts = SampleOptions(select=RunSelection(run_ids=run_ids, archs=archs, preset=preset), **options)
    return smp.sample_all(db, db_path, opts, progress=progress)


def _samples(db) -> list[dict]:
    return list(db.query("select * from samples order by run_id, prompt_id, settings_hash"))


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_samples_are_stored_with_every_setting_and_the_same_prompts_for_every_model(results):
    db = stages.connect(results)
    rng_before = torch.get_rng_state()
    s = sample_all(db, results, **SMALL)
    assert torch.equal(torch.get_rng_state(), rng_before)  # seeding happens inside fork_rng
    assert (s.generated, s.skipped) == (10, 0)
    prompts = list(db.query("select * from prompts order by idx"))
    assert len(prompts) == 5 and {p["prompt_set"] for p in prompts} == {s.prompt_sets[0]}
    assert all(p["rule"] == smp.RULE and p["text"] for p in prompts)
    rows = _samples(db)
    assert len(rows) == 10
    runs = {r["id"]: r for r in train_tables.runs(db)}
    by_run: dict[str, list[str]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r["prompt_id"])
        assert json.loads(r["settings_json"]) == s.settings.to_dict()
        assert r["settings_hash"] == s.settings_hash
        assert (r["temperature"], r["top_k"], r["top_p"], r["max_new_tokens"], r["seed"], r["batch_size"]) == (
            1.0,
            300,
            None,
            10,
            0,
            2,
        )
        assert r["n_recur"] == {"control": 1, "three-part": 7}[runs[r["run_id"]]["arch"]]
        assert r["device"] == "cpu" and r["prompt_set"] == s.prompt_sets[0]
        assert r["finish_reason"] in ("eos", "length") and 0 <= r["n_tokens"] <= 10
        assert (r["finish_reason"] == "length") == (r["n_tokens"] == 10)
        assert r["id"] == smp.sample_id(r["run_id"], r["prompt_id"], s.settings_hash)
    assert len(by_run) == 2
    assert [sorted(v) for v in by_run.values()] == [sorted(p["id"] for p in prompts)] * 2
    assert [r.arch for r in s.runs] == ["control", "three-part"]
    assert all(r.n_samples == 5 and r.mean_tokens is not None and r.tokens_per_s for r in s.runs)
    assert s.example["prompt"] == prompts[0]["text"]


def test_samples_fit_the_context_and_record_precision_and_decode_path(results):
    import io

    from rich.console import Console

    from benchctl.core.data import Tokenizer
    from benchctl.core.progress import Progress

    db = stages.connect(results)
    s = sample_all(db, results, n_prompts=3, batch_size=3, archs=["control"], progress=False)
    rows = _samples(db)
    assert len(rows) == 3
    run = train_tables.runs(db)[0]
    ctx = json.loads(run["config_json"])["model"]["max_seq_len"]
    texts = {p["id"]: p["text"] for p in db.query("select * from prompts")}
    tok = Tokenizer(next(results.parent.rglob("*.model")))
    for r in rows:
        n_prompt = len(tok.encode(texts[r["prompt_id"]], bos=True, eos=False))
        assert r["max_new_tokens"] == context_limit(n_prompt, ctx) and r["n_tokens"] <= r["max_new_tokens"]
        assert r["dtype"] == "float32" and r["dtype_reason"].startswith("auto: float32, no bench --decode comparison")
        assert r["decode"] == "fast eager"
    assert s.settings.to_dict()["sampler"] == "benchctl-sample-v2"
    # asked explicitly past the context: honoured, with one warning line per run
    out = io.StringIO()
    progress = Progress(enabled=False, console=Console(file=out, width=400))
    sample_all(db, results, n_prompts=3, batch_size=3, archs=["control"], max_new_tokens=ctx, progress=progress)
    assert f"warning: --max-new-tokens {ctx} runs past the {ctx}-token context" in out.getvalue()
    past = [r for r in _samples(db) if r["max_new_tokens"] == ctx]
    assert past and all(r["decode"].startswith("reference: ") and "context" in r["decode"] for r in past)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_rerun_adds_nothing_and_other_settings_add_rows(results):
    db = stages.connect(results)
    sample_all(db, results, **SMALL)
    before = _samples(db)
    again = sample_all(db, results, **SMALL)
    assert (again.generated, again.skipped) == (0, 10)
    assert _samples(db) == before
    assert db["prompts"].count == 5
    other = sample_all(db, results, **{**SMALL, "seed": 1})
    assert (other.generated, other.skipped) == (10, 0)
    assert db["samples"].count == 20 and db["prompts"].count == 5  # the prompt set is reused
    more = sample_all(db, results, **{**SMALL, "n_prompts": 6})
    assert more.prompt_sets != other.prompt_sets and more.generated == 12
    assert db["prompts"].count == 11


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_a_killed_run_resumes_with_identical_samples(results):
    db = stages.connect(results)
    s = sample_all(db, results, **SMALL)
    full = {r["id"]: r["completion"] for r in _samples(db)}
    three = next(r.run_id for r in s.runs if r.arch == "three-part")
    # as if killed after the first batch (prompts 0-1) of three-part: its later batches are missing
    with db.conn:
        db.execute(
            "delete from samples where run_id = ? and prompt_id not like '%:0' and prompt_id not like '%:1'", [three]
        )
    resumed = sample_all(db, results, **SMALL)
    assert (resumed.generated, resumed.skipped) == (3, 7)
    assert {r["id"]: r["completion"] for r in _samples(db)} == full
    # and from scratch, every sample (three-part's random initial states included) comes out the same
    with db.conn:
        db.execute("delete from samples")
    sample_all(db, results, **SMALL)
    assert {r["id"]: r["completion"] for r in _samples(db)} == full


@pytest.mark.slow  # two spawned processes importing torch
def test_two_jobs_store_the_same_samples_as_one(results, capsys):
    """`--jobs 2` samples each run in its own process: the same rows (three-part's random states included) and the
    same summary, and a bad --jobs fails before any work."""
    db = stages.connect(results)
    one = sample_all(db, results, **SMALL)
    serial = {r["id"]: (r["completion"], r["n_tokens"], r["dtype"]) for r in _samples(db)}
    with db.conn:
        db.execute("delete from samples")
    capsys.readouterr()
    two = sample_all(db, results, **{**SMALL, "jobs": 2})
    assert "sampling: 2 jobs at once, 1 thread(s) each" in capsys.readouterr().out
    assert {r["id"]: (r["completion"], r["n_tokens"], r["dtype"]) for r in _samples(db)} == serial
    assert (two.generated, two.skipped) == (one.generated, one.skipped) == (10, 0)
    assert [(r.run_id, r.n_samples, r.mean_tokens, r.generated) for r in two.runs] == [
        (r.run_id, r.n_samples, r.mean_tokens, r.generated) for r in one.runs
    ]
    assert all(r.tokens_per_s for r in two.runs) and two.example == one.example
    again = sample_all(db, results, **{**SMALL, "jobs": 2})  # nothing to do: no process is started
    assert (again.generated, again.skipped) == (0, 10)
    with pytest.raises(ConfigError, match="--jobs"):
        sample_all(db, results, **{**SMALL, "jobs": "0"})


def test_completion_continues_the_prompt_text(results, trained):
    from benchctl.core import checkpoint
    from benchctl.core.data import Tokenizer

    db = stages.connect(results)
    run = train_tables.runs(db)[0]
    tok = Tokenizer(checkpoint.run_dir(results, run["id"]) / checkpoint.TOKENIZER_NAME)
    head = "Once upon a time, there was a girl named Lily."
    p, full = tok.encode(head), tok.encode(head + " She ran to the park.")
    assert full[: len(p)] == p
    assert smp.decode_completion(tok, p, full[len(p) :]) == " She ran to the park."


def test_recurrence_override(results):
    db = stages.connect(results)
    with pytest.raises(ConfigError, match="--n-recur 3 cannot run on control"):
        sample_all(db, results, n_recur=3, **SMALL)
    assert db["samples"].count == 0  # checked before any work
    s = sample_all(db, results, n_recur=3, archs=["three-part"], **SMALL)
    assert s.generated == 5 and {r["n_recur"] for r in _samples(db)} == {3}
    assert json.loads(_samples(db)[0]["settings_json"])["n_recur"] == 3


def test_run_selection_errors(results, tmp_path):
    db = stages.connect(results)
    with pytest.raises(ConfigError, match="did you mean 'three-part'"):
        sample_all(db, results, archs=["thre-part"], **SMALL)
    with pytest.raises(ConfigError, match="unknown run id"):
        sample_all(db, results, run_ids=["nope"], **SMALL)
    with pytest.raises(CheckpointError, match="benchctl train-all"):
        sample_all(db, results, preset="paper", **SMALL)
    empty = tmp_path / "empty.db"
    with pytest.raises(CheckpointError, match="no finished runs.*benchctl train-all"):
        sample_all(stages.connect(empty), empty, **SMALL)


def test_progress_reports_on_the_given_reporter(results):
    import io

    from benchctl.core.progress import Progress

    out = io.StringIO()
    reporter = Progress(enabled=True, interactive=False, stream=out, interval=3600.0)
    s = sample_all(stages.connect(results), results, **{**SMALL, "archs": ["control"], "progress": reporter})
    lines = out.getvalue().splitlines()
    assert s.generated == 5 and "\r" not in out.getvalue()
    assert lines[0].startswith("sampling: 0/5") and lines[-1].startswith("control s0: 5/5 (100%) tok/s ")


def test_bad_device_is_a_config_error_before_any_work(tmp_path):
    empty = tmp_path / "empty.db"
    with pytest.raises(ConfigError, match="--device must be auto, cpu, cuda, cuda:N or mps; got 'gpu0'"):
        sample_all(stages.connect(empty), empty, device="gpu0", **SMALL)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device='cuda:0' but CUDA is not available"):
            sample_all(stages.connect(empty), empty, device="cuda:0", **SMALL)


def test_cli_sample_prints_a_summary_and_an_example(results):
    from benchctl.cli import app

    args = [
        "sample",
        "--db",
        str(results),
        "--n-prompts",
        "3",
        "--max-new-tokens",
        "6",
        "--top-k",
        "0",
        "--top-p",
        "0.9",
        "--archs",
        "control",
        "--no-progress",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "control" in out and "3 generated, 0 already stored" in out and "example (control" in out
    db = stages.connect(results)
    assert {(r["top_k"], r["top_p"]) for r in _samples(db)} == {(None, 0.9)}
    res = CliRunner().invoke(app, args)
    assert "0 generated, 3 already stored" in res.output


def test_cli_errors_are_one_line(results, tmp_path, capsys):
    from benchctl import cli

    for argv, code, text in (
        (["sample", "--db", str(results), "--n-recur", "2", "--no-progress"], ConfigError.exit_code, "--n-recur 2"),
        (["sample", "--db", str(tmp_path / "none.db")], dbm.DatabaseError.exit_code, "benchctl train-all"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == code and text in err and "Traceback" not in err
