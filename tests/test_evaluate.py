"""Tests of the lm-eval integration (the benchctl.stages.eval.api package, benchctl/commands/eval.py).

- The adapter against direct computations from a tiny model's logits: loglikelihood of (context, continuation)
  pairs in one right-padded batch, left truncation past the context, continuations longer than the context, rolling
  log-likelihood over a text longer than the context (windows computed by hand), generation that stops at stop
  sequences, three-part's seeded (reproducible, RNG-neutral) forwards.
- The bundled task generators (deterministic, balanced groups, protagonist rule) and lm-eval finding every task;
  the word-order task: its swap rule, minimal pairs of the same tokens, exactly 1/2 for an order-blind unigram
  model scored by lm-eval, well above 1/2 for a briefly trained tiny model.
- `benchctl eval` end to end, offline, on tiny checkpoints trained once for the module (three-part and FraiLT, 3
  steps): rows and their fields in results.db, skip / --force, recurrence override and rejection, RNG states,
  an unavailable task reported while the others run, progress as plain lines when output is not a terminal.
"""

from __future__ import annotations

import io
import random
import re
from dataclasses import dataclass
from pathlib import Path

import lm_eval
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from benchctl import stages
from benchctl.cli import main
from benchctl.core import data as datamod
from benchctl.core.checkpoint import CKPT_NAME, run_dir
from benchctl.core.errors import ConfigError, EvalError
from benchctl.core.progress import Progress
from benchctl.stages import RunSelection
from benchctl.stages.eval import api as ev
from benchctl.stages.train import tables as train_tables


def evaluate_runs(db, db_path, *, progress=True, log=None, run_ids=None, archs=None, preset=None, **options):
    """`evaluate_runs` with its options as keywords, the run selection among them as on the command line."""
    opts = ev.EvalOptions(select=RunSelection(run_ids=run_ids, archs=archs, preset=preset), **options)
    return ev.evaluate_runs(db, db_path, opts, progress=progress, log=log)


def run_cli(argv: list[str]) -> None:
    """`benchctl argv`, which must succeed (Typer exits 0 through SystemExit)."""
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"benchctl {' '.join(argv)} exited with {e.code}"


def run_error(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


@dataclass
class Trained:
    db: Path
    runs: dict[str, str]  # arch -> run id
    prepared: datamod.Prepared

    def ckpt(self, arch: str) -> Path:
        return run_dir(self.db, self.runs[arch]) / CKPT_NAME


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir):
    root = tmp_path_factory.mktemp("eval")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BENCHCTL_CACHE", str(root / "cache"))
        mp.delenv("BENCHCTL_DB", raising=False)
        db = root / "results.db"
        run_cli(
            [
                "train-all",
                "--preset",
                "tiny",
                "--archs",
                "three-part,frailt",
                "--data",
                str(tinystories_dir),
                "--db",
                str(db),
                "--set",
                "train.max_steps=3",
                "--set",
                "train.warmup_steps=1",
                "--no-progress",
                "--yes",
            ]
        )
        rows = train_tables.runs(stages.connect(db), status="done")
        from benchctl.core.config import RunConfig

        cfg = RunConfig.from_json(rows[0]["config_json"])
        prepared = datamod.prepare(cfg.data, cfg.model.vocab_size, progress=False)
        yield Trained(db=db, runs={r["arch"]: r["id"] for r in rows}, prepared=prepared)


def lm_for(trained: Trained, arch: str, **kw) -> ev.BenchctlLM:
    """The adapter in fp32 unless `dtype` is given: these tests check request handling to 1e-4, which bf16's
    rounding (it depends on the batch's shape) would blur; the run's own precision rule is tested on its own."""
    kw.setdefault("dtype", "float32")
    return ev.BenchctlLM(checkpoint=trained.ckpt(arch), device="cpu", progress=False, **kw)


def ll_requests(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]


def direct_ll(lm: ev.BenchctlLM, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | BOS + context) from one unbatched forward, pieces of <= L tokens, left-truncated."""
    ctx = lm.tok.encode(context, bos=True)
    cont = lm.tok.encode(context + continuation, bos=True)[len(ctx) :]
    L = lm.max_length
    total, greedy = 0.0, True
    for j in range(0, len(cont), L):
        seq = (ctx + cont[: j + L])[-(L + 1) :]
        piece = cont[j : j + L]
        with torch.no_grad():
            logits, _ = lm.model(torch.tensor([seq[:-1]]), n_recur=lm.n_recur)
        logp = F.log_softmax(logits[0].float(), dim=-1)[-len(piece) :]  # (m, V)
        target = torch.tensor(piece)
        total += float(logp.gather(-1, target[:, None]).sum())
        greedy = greedy and bool((logp.argmax(-1) == target).all())
    return total, greedy


STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play in the park with her red ball. "
    "One day, Lily saw a big dog near the tree. The dog was sad because it was lost. Lily gave the dog some "
    "water and helped it find its home. The dog's owner was very happy and thanked Lily with a big hug."
)


# ---- the adapter ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_loglikelihood_equals_direct_computation(trained):
    lm = lm_for(trained, "frailt", batch_size=3)  # FraiLT's forward is deterministic
    assert lm.max_length == 32 and lm.eot_token_id == lm.prefix_token_id == 1 and lm.n_recur == 4
    pairs = [
        ("Once upon a time", " there was a dog."),  # short
        ("Lily", " smiled."),
        ("The cat", " sat on the mat and looked at the big red ball"),
        (STORY[:300], " She was happy."),  # longer than the context: left-truncated
        ("Once", " " + STORY[5:260]),  # a continuation longer than the context: scored in pieces
    ]
    got = lm.loglikelihood(ll_requests(pairs))
    assert len(got) == len(pairs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        want, want_greedy = direct_ll(lm, ctx, cont)
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
    assert len(lm.tok.encode(pairs[4][0] + pairs[4][1])) > 2 * lm.max_length  # really exercised the pieces
    # batch size and request order do not change anything for a deterministic model
    other = lm_for(trained, "frailt", batch_size=1).loglikelihood(ll_requests(pairs[::-1]))[::-1]
    assert [x[0] for x in other] == pytest.approx([x[0] for x in got], abs=1e-4)


def test_the_adapter_casts_the_weights_once(trained):
    """float32 unless a dtype is given, then the weights are cast once (no autocast); at float32 the scores are the
    checkpoint's own forward, and in bf16 within bf16's rounding of them."""
    from benchctl.core.checkpoint import load_model

    lm = ev.BenchctlLM(checkpoint=trained.ckpt("frailt"), device="cpu", progress=False)
    assert (lm.dtype, lm.dtype_reason, next(lm.model.parameters()).dtype) == (
        "float32",
        "default: float32",
        torch.float32,
    )
    pairs = [("Once upon a time", " there was a dog."), ("Lily", " smiled.")]
    fp32 = [ll for ll, _ in lm.loglikelihood(ll_requests(pairs))]
    model, _cfg, _tok = load_model(trained.ckpt("frailt"), torch.device("cpu"))
    for (ctx, cont), ll in zip(pairs, fp32):
        c, w = lm.tok.encode(ctx, bos=True), lm.tok.encode(cont, bos=False)
        with torch.no_grad():
            logits, _ = model.eval()(torch.tensor([c + w[:-1]]), n_recur=lm.n_recur)
        want = F.log_softmax(logits[0, len(c) - 1 :], -1).gather(-1, torch.tensor(w)[:, None]).sum()
        assert ll == pytest.approx(float(want), abs=1e-5)
    bf = lm_for(trained, "frailt", dtype="bfloat16", dtype_reason="set: --precision bfloat16")
    assert next(bf.model.parameters()).dtype == torch.bfloat16 and bf.dtype_reason == "set: --precision bfloat16"
    got = [ll for ll, _ in bf.loglikelihood(ll_requests(pairs))]
    assert got == pytest.approx(fp32, rel=0.05) and got != fp32  # really ran in bf16
    with pytest.raises(ValueError, match="dtype must be"):
        lm_for(trained, "frailt", dtype="float8")


def test_empty_context_uses_bos(trained):
    lm = lm_for(trained, "frailt")
    ((ll, _),) = lm.loglikelihood(ll_requests([("", "Once upon a time")]))
    ids = lm.tok.encode("Once upon a time", bos=False)
    with torch.no_grad():
        logits, _ = lm.model(torch.tensor([[1] + ids[:-1]]))
    want = F.log_softmax(logits[0], -1).gather(-1, torch.tensor(ids)[:, None]).sum()
    assert ll == pytest.approx(float(want), abs=1e-4)


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(trained):
    lm = lm_for(trained, "frailt", batch_size=4)
    L = lm.max_length
    tokens = lm.tok.encode(STORY, bos=False)
    assert len(tokens) > 2 * L + 5  # several windows, the last one partial
    want = 0.0
    # window 1: BOS + t[:L-1] predicts t[:L]; then each window predicts the next L tokens (fewer at the end) from
    # the L tokens before them.
    spans = [(0, L)] + [(e, min(e + L, len(tokens))) for e in range(L, len(tokens), L)]
    for start, end in spans:
        inp = [1] + tokens[: L - 1] if start == 0 else tokens[end - L - 1 : end - 1]
        with torch.no_grad():
            logits, _ = lm.model(torch.tensor([inp]))
        logp = F.log_softmax(logits[0], -1)[-(end - start) :]
        want += float(logp.gather(-1, torch.tensor(tokens[start:end])[:, None]).sum())
    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(STORY,), idx=0)
    short = Instance(request_type="loglikelihood_rolling", doc={}, arguments=("Lily ran.",), idx=1)
    got = lm.loglikelihood_rolling([req, short])
    assert got[0] == pytest.approx(want, abs=1e-3)
    assert got[1] == pytest.approx(direct_ll(lm, "", "Lily ran.")[0], abs=1e-4)  # one window: BOS + text
    (alone,) = lm.loglikelihood_rolling([short])
    assert got[1] == pytest.approx(alone, abs=1e-4) and alone < 0


def _gen(lm, context: str, **kw) -> str:
    req = Instance(request_type="generate_until", doc={}, arguments=(context, {"do_sample": False, **kw}), idx=0)
    return lm.generate_until([req])[0]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_generate_until_stops_at_stop_sequences(trained, monkeypatch):
    lm = lm_for(trained, "frailt")
    calls = []
    decode = lm.model.decode  # generation's forward (the decode path calls it, not the module's forward)

    def counted(*args, **kwargs):
        calls.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(lm.model, "decode", counted)
    full = _gen(lm, "Once upon a time", until=[], max_gen_toks=24)
    n_full = len(calls)
    assert len(full) >= 12, f"the tiny model generated too little to test stops: {full!r}"
    assert len(lm.tok.encode(full, bos=False)) <= 24
    stop = full[6:9]
    calls.clear()
    cut = _gen(lm, "Once upon a time", until=[stop], max_gen_toks=24)
    monkeypatch.undo()
    assert cut == full[: full.find(stop)]
    assert len(calls) < n_full  # it stopped generating, not only cut the text afterwards
    # greedy generation is batch-independent: rows of different lengths are grouped by length
    contexts = ["Once upon a time", "Lily", "The dog was sad because", "Once upon a time"]
    reqs = [
        Instance(
            request_type="generate_until",
            doc={},
            idx=i,
            arguments=(c, {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}),
        )
        for i, c in enumerate(contexts)
    ]
    batched = lm.generate_until(reqs)
    assert batched == [_gen(lm, c, until=["\n"], max_gen_toks=10) for c in contexts]
    assert all("\n" not in s for s in batched)


def test_three_part_is_seeded_and_leaves_global_rng_alone(trained):
    lm = lm_for(trained, "three-part", batch_size=2)
    lm7 = lm_for(trained, "three-part", batch_size=2, seed=7)
    pairs = [("Once upon a time", " there was a cat."), ("Lily", " ran home."), ("The sun", " was hot.")]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = lm.loglikelihood(ll_requests(pairs))
    assert torch.equal(torch.get_rng_state(), before)  # the adapter never consumes the global RNG
    torch.manual_seed(99)
    b = lm.loglikelihood(ll_requests(pairs[::-1]))[::-1]
    assert a == b  # bit-identical whatever the global RNG state and the request order
    # the initial state really is random: another adapter seed gives other numbers
    torch.manual_seed(0)
    c = lm7.loglikelihood(ll_requests(pairs))
    assert [x[0] for x in c] != [x[0] for x in a]


def test_recurrence_is_validated_by_the_adapter(trained):
    assert lm_for(trained, "three-part", n_recur=14).n_recur == 14
    assert lm_for(trained, "frailt", n_recur="2").n_recur == 2
    assert lm_for(trained, "frailt", n_recur=9).n_recur == 9  # past R: the extrapolation rule applies
    with pytest.raises(ValueError, match="n_recur must be an integer >= 1"):
        lm_for(trained, "frailt", n_recur=0)


def test_registered_with_lm_eval(trained):
    from lm_eval.api.registry import get_model

    assert get_model("benchctl") is ev.BenchctlLM
    lm = ev.BenchctlLM.create_from_arg_string(
        f"checkpoint={trained.ckpt('frailt')},n_recur=3,batch_size=5", {"device": "cpu"}
    )
    assert (lm.n_recur, lm.batch_size, lm.device.type) == (3, 5, "cpu")


# ---- bundled tasks -------------------------------------------------------------------------------------------------


def test_find_protagonist_rule():
    story = "Once upon a time, there was a girl named Mia. Mia had a red kite."
    assert ev.find_protagonist(story) == ("Mia", story.index("Mia"))
    story = "There was a small daisy. Her name was Daisy. Daisy was happy. The sun was warm."
    assert ev.find_protagonist(story)[0] == "Daisy"
    # no introduction: the most frequent capitalised word seen mid-sentence
    story = "One day, the chick was lost. Sam heard it. All the animals cheered for Sam, the kind horse."
    assert ev.find_protagonist(story)[0] == "Sam"
    # sentence-initial capitals, roles and a name mentioned once are not protagonists
    assert ev.find_protagonist('The dog ran. The dog sat. Mom said, "Good dog." Then Mom smiled.') is None
    assert ev.find_protagonist("Once there was a boy named Tom. He was happy.") is None


def test_generators_are_deterministic_and_balanced(trained):
    stories = trained.prepared.valid_stories()
    for name, make in ev.GENERATORS.items():
        docs = make(stories, n_docs=40)
        assert docs == make(stories, n_docs=40)
        assert docs != make(stories, n_docs=40, seed=1), name
        assert 0 < len(docs) <= 40
    assert len(ev.GENERATORS["tinystories_order"](stories, n_docs=39)) == 40  # whole pairs
    for name in ("tinystories_ending", "tinystories_names"):
        docs = ev.GENERATORS[name](stories, n_docs=40)
        assert len(docs) % 4 == 0
        for g in range(0, len(docs), 4):
            group = docs[g : g + 4]
            assert all(d["choices"] == group[0]["choices"] for d in group)
            assert sorted(d["label"] for d in group) == [0, 1, 2, 3]  # each choice right exactly once
            assert len(set(group[0]["choices"])) == 4
            for d in group:
                story = stories[d["story_idx"]].strip()
                answer = d["choices"][d["label"]]
                assert story.startswith(d["context"]) and story[len(d["context"]) :].startswith(answer)
        if name == "tinystories_names":
            for d in docs:
                assert d["name"] == d["choices"][d["label"]] and re.search(rf"\b{d['name']}\b", d["context"])
                for wrong in d["choices"]:
                    if wrong != d["name"]:
                        assert not re.search(rf"\b{wrong}\b", stories[d["story_idx"]])


def test_order_pairs_rule():
    s = "The dog was happy and ran to the park."
    assert ev.order_pairs(s) == [2, 4, 6]  # was after dog, and after happy, to after ran (the after to: closed)
    assert ev.swap_words(s, 2) == "The was dog happy and ran to the park."
    assert ev.swap_words(s, 6) == "The dog was happy and to ran the park."
    for rejected in (
        'Lily said, "We can play with the ball."',  # dialogue
        "Was the dog happy and ready to play?",  # not declarative: an inverted auxiliary can be grammatical
        "She had 3 cats and a big dog.",  # digits
        "He ran to it.",  # too short
        "They played together and had fun.",  # movable adverb before "and"; "had" after a closed word
        "The dog barked loudly and ran home.",  # -ly adverb
        "She picked up the toys.",  # particle: "picked the up toys" vs "picked up the toys"
        "The dog, Max, was happy.",  # punctuation attached to the word before "was"
    ):
        assert ev.order_pairs(rejected) == [], rejected


def test_order_docs_are_minimal_pairs_of_the_same_tokens(trained):
    stories = trained.prepared.valid_stories()
    docs = ev.make_order_docs(stories)
    assert len(docs) == ev.DEFAULT_DOCS and len({d["story_idx"] for d in docs}) == len(docs)
    tok = trained.prepared.tokenizer()
    for j, d in enumerate(docs):
        original, swapped = d["choices"][d["label"]], d["choices"][1 - d["label"]]
        assert (original, swapped) == (d["sentence"], d["swapped"]) and original != swapped
        assert original in stories[d["story_idx"]]
        a, b = original.split(" "), swapped.split(" ")
        i = d["position"]
        assert [k for k in range(len(a)) if a[k] != b[k]] == [i - 1, i]  # two adjacent words exchanged, nothing else
        assert a[i] in ev.SWAP_WORDS and a[i - 1] not in ev.NOT_CONTENT and (b[i - 1], b[i]) == (a[i], a[i - 1])
        # the same tokens in another order: SentencePiece pieces never cross a space
        assert sorted(tok.encode(original, bos=False)) == sorted(tok.encode(swapped, bos=False))
        if j % 2:
            assert {d["label"], docs[j - 1]["label"]} == {0, 1}  # the original is first in one doc of each pair


class OrderBlindLM(LM):
    """A unigram model of the training split: log p(text) is the sum of its tokens' smoothed unigram log-probabilities,
    added in sorted order, so two orderings of the same tokens get bit-identical log-likelihoods."""

    def __init__(self, prepared: datamod.Prepared):
        super().__init__()
        self.tok = prepared.tokenizer()
        counts = np.bincount(np.asarray(prepared.train_tokens()), minlength=self.tok.vocab_size).astype(float)
        self.logp = np.log((counts + 1) / (counts.sum() + len(counts)))

    def loglikelihood(self, requests):
        out = []
        for req in requests:
            context, continuation = req.args
            skip = len(self.tok.encode(context, bos=False)) if context else 0
            ids = self.tok.encode(context + continuation, bos=False)[skip:]
            out.append((float(sum(sorted(self.logp[i] for i in ids))), False))
        return out

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        raise NotImplementedError


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_an_order_blind_model_scores_exactly_one_half(trained):
    """Through lm-eval's own multiple_choice scoring: every document is a tie, lm-eval picks the first choice, and
    the original is first in exactly one document of each pair."""
    from lm_eval.tasks import TaskManager

    from benchctl.core.checkpoint import rng_state, set_rng_state
    from benchctl.stages.eval.engine import _quiet

    bundled = ev.build_bundled_tasks(trained.prepared, ["tinystories_order"])
    tm = TaskManager(include_path=str(bundled.dir), include_defaults=False)
    saved = rng_state()
    try:
        with _quiet():
            res = lm_eval.simple_evaluate(
                model=OrderBlindLM(trained.prepared),
                tasks=["tinystories_order"],
                task_manager=tm,
                log_samples=True,
                bootstrap_iters=0,
            )
    finally:
        set_rng_state(saved)
    assert res["results"]["tinystories_order"]["acc,none"] == 0.5
    samples = sorted(res["samples"]["tinystories_order"], key=lambda x: x["doc_id"])
    assert len(samples) == bundled.n_docs["tinystories_order"] == ev.DEFAULT_DOCS
    for x in samples:
        (ll_a, _), (ll_b, _) = x["resps"][0][0], x["resps"][1][0]
        assert ll_a == ll_b  # order-blind: a tie on every document
    assert all(a["acc"] + b["acc"] == 1.0 for a, b in zip(samples[::2], samples[1::2]))


@pytest.mark.slow
def test_a_trained_model_beats_chance_on_order(trained, tinystories_dir, tmp_path):
    """The task is passable at CPU scale: the tiny control trained for 250 steps (about a minute on two shared
    cores) already prefers the original word order far more often than 1/2 (0.82 at 300 steps on TinyStories; 80
    steps are not enough, 0.56). The module's prepared data cache is reused."""
    from scipy import stats as sps

    db = tmp_path / "order.db"
    run_cli(
        [
            "train",
            "--arch",
            "control",
            "--preset",
            "tiny",
            "--data",
            str(tinystories_dir),
            "--db",
            str(db),
            "--set",
            "train.max_steps=250",
            "--no-progress",
            "--yes",
        ]
    )
    s = evaluate_runs(
        stages.connect(db), db, tasks=["tinystories_order"], threads=1, progress=False, log=lambda _: None
    )
    (row,) = s.rows
    n = row["n_samples"]
    correct = round(row["value"] * n)
    assert n == ev.DEFAULT_DOCS and row["value"] > 0.6
    assert sps.binomtest(correct, n, 0.5, alternative="greater").pvalue < 1e-3


def test_bundled_tasks_are_written_and_found(trained):
    from lm_eval.tasks import TaskManager

    a = ev.build_bundled_tasks(trained.prepared, n_docs=24)
    b = ev.build_bundled_tasks(trained.prepared, n_docs=24)
    assert a == b and set(a.versions) == set(ev.BUNDLED_TASKS)
    assert all(re.fullmatch(r"1\+[0-9a-f]{12}", v) for v in a.versions.values())
    assert a.dir.is_relative_to(trained.prepared.dir)
    tm = TaskManager(include_path=str(a.dir), include_defaults=False)
    assert set(ev.BUNDLED_TASKS) <= set(tm.all_tasks)
    import yaml

    cfg = yaml.safe_load((a.dir / "tinystories_names.yaml").read_text())
    path = Path(cfg["dataset_kwargs"]["data_files"]["test"])
    assert path.is_absolute() and path.exists()
    assert cfg["metadata"]["version"] == ev.TASK_VERSIONS["tinystories_names"]
    assert cfg["metadata"]["docs_sha256"].startswith(a.versions["tinystories_names"].split("+")[1])
    assert cfg["metadata"]["chance"] == 0.25  # the template's stated chance level survives the rendering
    order = yaml.safe_load((a.dir / "tinystories_order.yaml").read_text())
    assert order["metadata"]["chance"] == 0.5 and order["metadata"]["n_docs"] == a.n_docs["tinystories_order"] == 24


# ---- benchctl eval -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_eval_end_to_end_stores_rows(trained):
    run_cli(["eval", "--db", str(trained.db), "--limit", "8", "--batch-size", "16", "--threads", "1", "--no-progress"])
    db = stages.connect(trained.db)
    rows = list(db.query("select * from eval_results where limit_n = 8"))
    by = {(r["run_id"], r["task"], r["metric"]): r for r in rows}
    for arch, rid in trained.runs.items():
        n = 7 if arch == "three-part" else 4
        for task, metrics in (
            ("tinystories_ppl", ("word_perplexity", "byte_perplexity", "bits_per_byte")),
            ("tinystories_ending", ("acc", "acc_norm")),
            ("tinystories_names", ("acc", "acc_norm")),
            ("tinystories_order", ("acc",)),
        ):
            for metric in metrics:
                r = by[(rid, task, metric)]
                assert r["n_recur"] == n and r["limit_n"] == 8 and r["n_samples"] == 8
                assert r["batch_size"] == 16 and r["lm_eval_version"] == lm_eval.__version__
                # no decode benchmark in this database: float32, and the row says why
                assert r["dtype"] == "float32" and r["dtype_reason"].startswith("auto: float32, no bench --decode")
                assert re.fullmatch(r"1\+[0-9a-f]{12}", r["task_version"]) and r["created_at"]
                assert np.isfinite(r["value"])
                if metric.startswith("acc"):
                    assert 0 <= r["value"] <= 1 and r["stderr"] is not None and r["stderr"] > 0
                else:
                    assert r["stderr"] is None  # lm-eval's "N/A"
        bpb = by[(rid, "tinystories_ppl", "bits_per_byte")]["value"]
        assert by[(rid, "tinystories_ppl", "byte_perplexity")]["value"] == pytest.approx(2**bpb, rel=1e-6)
    assert len(rows) == 2 * 8

    # a rerun skips everything; --force recomputes the same numbers (deterministic, three-part included)
    summary = evaluate_runs(db, trained.db, limit=8, batch_size=16, progress=False, log=lambda _: None)
    assert summary.evaluated == [] and len(summary.skipped) == 8
    assert len(summary.rows) == 16
    forced = evaluate_runs(db, trained.db, limit=8, batch_size=16, force=True, progress=False, log=lambda _: None)
    assert len(forced.evaluated) == 8
    again = {
        (r["run_id"], r["task"], r["metric"]): r["value"]
        for r in db.query("select * from eval_results where limit_n = 8")
    }
    assert again == pytest.approx({k: r["value"] for k, r in by.items()})
    headers = {task: tuple(h) for task, h, _ in ev.summary_tables(forced)}
    assert (
        headers["tinystories_ending"] == headers["tinystories_names"] == ("model", "seed", "n_recur", "acc", "acc_norm")
    )
    assert headers["tinystories_order"] == ("model", "seed", "n_recur", "acc")


@pytest.mark.slow  # two spawned processes importing torch and lm-eval
def test_two_jobs_store_the_same_results_as_one(trained):
    """`eval --jobs 2` evaluates each run in its own process and stores the same numbers as one process."""
    db = stages.connect(trained.db)
    quiet = dict(limit=6, batch_size=16, threads=1, progress=False, log=lambda _: None)
    one = evaluate_runs(db, trained.db, **quiet)
    serial = {(r["run_id"], r["task"], r["metric"]): r["value"] for r in one.rows}
    said: list[str] = []
    two = evaluate_runs(db, trained.db, force=True, jobs=2, **{**quiet, "log": said.append})
    assert "evaluation: 2 jobs at once, 1 thread(s) each" in said
    assert sorted(two.evaluated) == sorted((rid, t) for rid in trained.runs.values() for t in ev.BUNDLED_TASKS)
    assert {(r["run_id"], r["task"], r["metric"]): r["value"] for r in two.rows} == serial
    assert two.tasks == one.tasks and len(two.rows) == len(one.rows) == 2 * 8
    assert evaluate_runs(db, trained.db, jobs=2, **quiet).evaluated == []  # a rerun skips in every process


def test_lm_eval_environment_info_is_quick_and_quiet(trained, tmp_path, monkeypatch, capfd):
    """simple_evaluate's env info would run torch's collect_env (1-6 s per run here) and `git describe` in the cwd."""
    import lm_eval.evaluator
    import torch.utils.collect_env

    calls = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: calls.append(1) or "slow")
    monkeypatch.chdir(tmp_path)  # not a git checkout: git describe would print "fatal: not a git repository"
    originals = (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash)
    db = stages.connect(trained.db)
    summary = evaluate_runs(
        db,
        trained.db,
        tasks=["tinystories_ppl"],
        limit=4,
        batch_size=16,
        force=True,
        archs=["frailt"],
        progress=False,
        log=lambda _: None,
    )
    assert summary.evaluated and not calls
    assert "fatal" not in capfd.readouterr().err
    assert (lm_eval.evaluator.add_env_info, lm_eval.evaluator.get_git_commit_hash) == originals  # restored


def test_recurrence_override_and_rng_restored(trained):
    db = stages.connect(trained.db)
    rid = trained.runs["three-part"]
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    threads = torch.get_num_threads()
    out = {}
    for r in (7, 14):
        s = evaluate_runs(
            db,
            trained.db,
            tasks=["tinystories_ppl"],
            run_ids=[rid],
            n_recur=r,
            limit=6,
            threads=threads + 1,
            progress=False,
            log=lambda _: None,
        )
        assert torch.get_num_threads() == threads  # restored
        (row,) = [x for x in s.rows if x["metric"] == "bits_per_byte"]
        assert row["n_recur"] == r
        out[r] = row["value"]
    assert out[7] != out[14]
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert after[0] == before[0] and np.array_equal(after[1], before[1]) and torch.equal(after[2], before[2])


def test_invalid_recurrence_fails_cleanly(trained, capsys):
    code, err = run_error(
        capsys, ["eval", "--db", str(trained.db), "--runs", trained.runs["frailt"], "--n-recur", "0", "--no-progress"]
    )
    # every architecture here runs any depth >= 1 (FraiLT past R by its extrapolation rule): 0 is the one bad value
    assert code == 2 and "--n-recur must be >= 1" in err and "Traceback" not in err


def test_selection_errors(trained, capsys):
    code, err = run_error(capsys, ["eval", "--db", str(trained.db), "--tasks", "tinystories_ppll"])
    assert code == ConfigError.exit_code == 2 and "did you mean 'tinystories_ppl'" in err
    code, err = run_error(capsys, ["eval", "--db", str(trained.db), "--runs", "nope"])
    assert code == ConfigError.exit_code and "nope" in err
    code, err = run_error(capsys, ["eval", "--db", str(trained.db), "--archs", "control"])
    assert code == EvalError.exit_code and "no finished runs" in err


def test_user_tasks_and_a_task_without_data(trained, tmp_path, monkeypatch):
    """--include-path tasks run like bundled ones; a task whose dataset lives on the hub (here a YAML of our own, so
    no 20 s index of lm-eval's ~15,000 tasks) is reported while the rest runs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # behave as offline even on a machine with internet
    import json

    data = tmp_path / "local.jsonl"
    data.write_text(
        "".join(
            json.dumps({"q": f"Lily had {n} red balls.", "choices": [" Yes", " No"], "label": n % 2}) + "\n"
            for n in range(5)
        )
    )
    (tmp_path / "local.yaml").write_text(
        "task: benchctl_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\ndoc_to_text: q\n"
        "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\nmetadata:\n  version: 2.0\n"
    )
    (tmp_path / "hub_only.yaml").write_text(
        "task: benchctl_hub_only\ndataset_path: benchctl-tests/no-such-dataset\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: q\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n"
    )
    db = stages.connect(trained.db)
    logs: list[str] = []
    rid = trained.runs["frailt"]
    s = evaluate_runs(
        db,
        trained.db,
        tasks=["tinystories_ending", "benchctl_hub_only", "benchctl_local"],
        run_ids=[rid],
        limit=4,
        include_paths=[tmp_path],
        force=True,
        progress=False,
        log=logs.append,
    )
    assert list(s.unavailable) == ["benchctl_hub_only"]
    assert any("benchctl_hub_only" in line and "unreachable" in line for line in logs)
    assert s.evaluated == [(rid, "tinystories_ending"), (rid, "benchctl_local")]
    local = {r["metric"]: r for r in s.rows if r["task"] == "benchctl_local"}
    assert set(local) == {"acc"} and local["acc"]["task_version"] == "2.0" and local["acc"]["n_samples"] == 4
    assert {r["task"] for r in s.rows} == {"tinystories_ending", "benchctl_local"}
    with pytest.raises(EvalError, match="none of the requested tasks"):
        evaluate_runs(
            db,
            trained.db,
            tasks=["benchctl_hub_only"],
            run_ids=[rid],
            include_paths=[tmp_path],
            progress=False,
            log=lambda _: None,
        )


def test_progress_off_a_terminal_is_a_few_plain_lines(trained):
    """In a log, the adapter's bars and lm-eval's own tqdm bars are whole lines, never carriage-return redraws."""
    out = io.StringIO()
    reporter = Progress(enabled=True, interactive=False, stream=out, interval=3600.0)
    db = stages.connect(trained.db)
    s = evaluate_runs(
        db, trained.db, tasks=["tinystories_ppl"], archs=["frailt"], limit=4, force=True, progress=reporter
    )
    text = out.getvalue()
    assert s.evaluated and "\r" not in text
    lines = text.splitlines()
    assert any(line.startswith("loglikelihood: ") and "(100%)" in line for line in lines)
    assert any("done in" in line for line in lines)  # messages go to the reporter's log by default
    assert len(lines) < 30
    quiet = io.StringIO()
    evaluate_runs(
        db,
        trained.db,
        tasks=["tinystories_ppl"],
        archs=["frailt"],
        limit=4,
        force=True,
        progress=Progress(enabled=False, stream=quiet),
    )
    assert quiet.getvalue() == ""
