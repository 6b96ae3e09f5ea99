"""Test-time recurrence: the iteration hooks, extrapolation rules, the adaptive exit (threshold 0 is the full-depth
forward exactly, with and without a KV cache), `benchctl depth` (idempotent, resumable, one-line errors), depth
samples, and the report section."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures_db import build_fixture_db, train_tiny_runs

import architectures
from architectures.base import ExitRule
from architectures.blocks import KVCache
from architectures.generate import generate
from benchctl import stages
from benchctl.core.errors import ConfigError
from benchctl.stages import RunSelection
from benchctl.stages.depth import engine as dp
from benchctl.stages.depth.options import DEFAULT_DEPTHS, DepthOptions, check_exit_rule, parse_depths, parse_thresholds
from benchctl.stages.report import engine as report
from benchctl.stages.sample import engine as smp
from benchctl.stages.sample.options import SampleOptions
from benchctl.stages.train import tables as train_tables

RECURRENT = ["frailt", "three-part", "relaxed", "huginn", "trm"]


def tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(seed))


def seeded(fn, seed: int = 5):
    torch.manual_seed(seed)  # three-part's s0 comes from the global RNG
    with torch.no_grad():
        return fn()


def trained_like(model: architectures.BaseLM) -> architectures.BaseLM:
    """Give the zero-initialised depth-specific parameters values, so the rules differ observably."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("iter_emb") or name.endswith(".B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


# ---- iteration hooks and exit ----------------------------------------------------------------------------------------


def test_iterable_architectures(tiny_model):
    assert [a for a in architectures.names() if architectures.get(a).iterable()] == RECURRENT
    with pytest.raises(architectures.RecurrenceError, match="fixed depth"):
        tiny_model("control").iterate(tokens(1, 4))


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("rule", ["kl", "latent"])
def test_threshold_zero_is_the_full_depth_forward_exactly(arch, rule, tiny_model):
    model = trained_like(tiny_model(arch))
    x, y = tokens(2, 12), tokens(2, 12, seed=1)
    for n in (None, 6):  # the trained depth (the schedule) and past it (the extrapolation rule)
        ref_logits, ref_loss = seeded(lambda: model(x, y, n_recur=n))
        out = seeded(lambda: model.iterate(x, y, n_recur=n, exit=ExitRule(rule, 0.0)))
        assert torch.equal(out.logits, ref_logits) and torch.equal(out.loss, ref_loss)
        assert (out.depths == (n or model.args.n_recur)).all()
        _, fast = seeded(lambda: model(x, y, n_recur=n, return_logits=False))
        fast_exit = seeded(lambda: model.iterate(x, y, n_recur=n, exit=ExitRule(rule, 0.0), return_logits=False))
        assert torch.equal(fast_exit.loss, fast)


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_exit_checks_that_never_fire_keep_the_cached_forward_exact(arch, tiny_model):
    """With a KV cache (prefill then one token at a time), an exit check that runs but never fires (a tiny positive
    threshold: the coda probes run and write the cache) gives the full-depth logits exactly."""
    model = trained_like(tiny_model(arch))
    x = tokens(2, 9)

    def decode(fn):
        cache, outs = KVCache(model.args.max_seq_len), []
        torch.manual_seed(7)
        with torch.no_grad():
            outs.append(fn(x[:, :5], cache))
            for i in range(5, 9):
                outs.append(fn(x[:, i : i + 1], cache))
        return torch.cat(outs, dim=1)

    ref = decode(lambda t, c: model(t, n_recur=5, cache=c)[0])
    for rule in ("kl", "latent"):
        got = decode(lambda t, c: model.iterate(t, n_recur=5, cache=c, exit=ExitRule(rule, 1e-30)).logits)
        assert torch.equal(got, ref)
        zero = decode(lambda t, c: model.iterate(t, n_recur=5, cache=c, exit=ExitRule(rule, 0.0)).logits)
        assert torch.equal(zero, ref)


@pytest.mark.parametrize("arch", RECURRENT)
def test_exited_tokens_are_frozen(arch, tiny_model):
    """A threshold every token passes at once freezes every state after iteration 1: the depth-1 forward."""
    model = trained_like(tiny_model(arch))
    x = tokens(2, 10)
    out = seeded(lambda: model.iterate(x, n_recur=6, exit=ExitRule("latent", 1e9)))
    assert (out.depths == 1).all()
    assert torch.equal(out.logits, seeded(lambda: model(x, n_recur=1)[0]))


@pytest.mark.parametrize("arch", RECURRENT)
def test_mean_depth_is_within_one_and_the_maximum(arch, tiny_model):
    model = trained_like(tiny_model(arch))
    x = tokens(3, 16)
    for rule, thr in (("kl", 1e-3), ("kl", 1e-2), ("latent", 0.05), ("latent", 0.3)):
        d = seeded(lambda: model.iterate(x, n_recur=8, exit=ExitRule(rule, thr))).depths
        assert d.min() >= 1 and d.max() <= 8 and d.dtype == torch.long


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_generation_with_exit_threshold_zero_matches_full_depth(arch, tiny_model):
    model = trained_like(tiny_model(arch))
    prompts = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13]]
    kw = dict(max_new_tokens=6, temperature=0, n_recur=5)
    ref = seeded(lambda: generate(model, prompts, **kw))
    got = seeded(lambda: generate(model, prompts, exit=ExitRule("kl", 0.0), **kw))
    assert [g.tokens for g in got] == [g.tokens for g in ref]
    assert [g.mean_depth for g in got] == [5.0, 5.0] and ref[0].mean_depth is None
    some = seeded(lambda: generate(model, prompts, exit=ExitRule("latent", 0.2), **kw))
    assert all(1.0 <= g.mean_depth <= 5.0 for g in some)


# ---- extrapolation rules ---------------------------------------------------------------------------------------------


def _manual_frailt(model, x, n, vector_of):
    h = model.tok_embeddings(x)
    cos, sin = model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]]
    for t in range(n):
        k = vector_of(t)
        if k is not None:
            h = h + model.iter_emb[k]
        for layer in model.layers:
            h = layer(h, cos, sin)
    return model.output(model.norm(h))


def test_frailt_extrapolation_rules(tiny_model):
    model = trained_like(tiny_model("frailt"))
    x = tokens(1, 8)
    with torch.no_grad():
        for rule, vector_of in (
            ("last", lambda t: min(t, 3)),
            ("cycle", lambda t: t % 4),
            ("none", lambda t: t if t < 4 else None),
        ):
            got = model(x, n_recur=6, extrapolate=rule)[0]
            torch.testing.assert_close(got, _manual_frailt(model, x, 6, vector_of), rtol=0, atol=0)
        assert torch.equal(model(x, n_recur=6)[0], model(x, n_recur=6, extrapolate="last")[0])  # the default
        assert not torch.equal(model(x, n_recur=6, extrapolate="last")[0], model(x, n_recur=6, extrapolate="none")[0])


def test_relaxed_extrapolation_rules(tiny_model):
    model = trained_like(tiny_model("relaxed"))
    x = tokens(1, 8)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]

    def manual(lora_of):
        h = model.tok_embeddings(x)
        for t in range(7):
            for li, layer in enumerate(model.layers):
                k = lora_of(t)
                h = layer(h, cos, sin, lora=None if k is None else model.lora[k][li])
        return model.output(model.norm(h))

    with torch.no_grad():
        for rule, lora_of in (
            ("cycle", lambda t: t % 4),
            ("last", lambda t: min(t, 3)),
            ("none", lambda t: t if t < 4 else None),
        ):
            torch.testing.assert_close(model(x, n_recur=7, extrapolate=rule)[0], manual(lora_of), rtol=0, atol=0)
        assert torch.equal(model(x, n_recur=7)[0], model(x, n_recur=7, extrapolate="cycle")[0])  # the default


def test_extrapolation_is_not_part_of_the_run_id():
    from benchctl.core.config import RunConfig, make_config

    cfg = make_config("tiny", "frailt")
    assert "extrapolate" not in RunConfig.to_json(cfg)


# ---- benchctl depth --------------------------------------------------------------------------------------------------


def test_option_parsing():
    assert parse_depths("8,1,2,2") == [1, 2, 8] and parse_depths(None) == list(DEFAULT_DEPTHS)
    assert parse_thresholds("1e-3,1e-2") == [1e-2, 1e-3]
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(ConfigError, match="--depths"):
            parse_depths(bad)
    with pytest.raises(ConfigError, match="did you mean 'kl'"):
        check_exit_rule("kll")
    with pytest.raises(ConfigError, match="--thresholds"):
        parse_thresholds("-1")
    opts = DepthOptions(depths="8,1", thresholds="1e-3,1e-2")  # the command line's lists, held parsed
    assert (opts.depths, opts.thresholds) == ((1, 8), (1e-2, 1e-3)) and DepthOptions().depths is None
    for bad, says in (
        ({"max_depth": 0}, "--max-depth"),
        ({"windows": 0}, "--windows"),
        ({"extrapolate": "bogus"}, "--extrapolate: unknown rule 'bogus'"),
    ):
        with pytest.raises(ConfigError, match=says):
            DepthOptions(**bad)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir):
    return train_tiny_runs(tmp_path_factory.mktemp("depth"), tinystories_dir)


@pytest.fixture
def results(trained, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BENCHCTL_CACHE", str(trained / "cache"))
    shutil.copytree(trained / "results", tmp_path / "results")
    return tmp_path / "results" / "results.db"


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_depth_rows_are_idempotent_and_resumable(results):
    db = stages.connect(results)
    s = dp.depth_all(db, results, DepthOptions(depths="1,4,8", windows=8), progress=False)
    rows = list(db.query("select d.*, r.arch from depth_results d join runs r on r.id = d.run_id"))
    assert len(s.rows) == len(rows) == 4  # control: one row at its depth; frailt: 1, 4, 8
    frailt = {r["n_recur"]: r for r in rows if r["arch"] == "frailt"}
    assert set(frailt) == {1, 4, 8} and {r["extrapolate"] for r in frailt.values()} == {"last"}
    assert all(r["windows"] == 8 and r["tokens"] == 8 * 32 and r["exit_rule"] == "" for r in rows)
    assert frailt[8]["flops_per_token"] > frailt[4]["flops_per_token"]
    assert json.loads(frailt[4]["depth_hist"]) == {"4": 256}
    again = dp.depth_all(db, results, DepthOptions(depths="1,4,8", windows=8), progress=False)
    assert (len(again.rows), again.skipped) == (0, 4)
    # resumable: a row lost (a killed call) is measured again, the others are kept
    db.conn.execute("delete from depth_results where n_recur = 8")
    db.conn.commit()
    resumed = dp.depth_all(db, results, DepthOptions(depths="1,4,8", windows=8), progress=False)
    assert len(resumed.rows) == 1 and resumed.rows[0]["val_loss"] == pytest.approx(frailt[8]["val_loss"], abs=0)
    ex = dp.depth_all(db, results, DepthOptions(exit_rule="kl", thresholds="1e-2,1e-3", windows=8), progress=False)
    assert {(r["exit_rule"], r["threshold"], r["n_recur"]) for r in ex.rows if r["arch"] == "frailt"} == {
        ("kl", 1e-2, 4),
        ("kl", 1e-3, 4),
    }
    assert all(1 <= r["mean_depth"] <= r["n_recur"] for r in ex.rows)
    assert (
        dp.estimate_seconds(db, results, [r["id"] for r in train_tables.runs(db)]) > 0
    )  # what the paper preset prints


def test_trained_depth_row_is_the_final_validation_loss(results):
    db = stages.connect(results)
    dp.depth_all(db, results, DepthOptions(depths="4", select=RunSelection(archs=["frailt"])), progress=False)
    row = next(
        iter(
            db.query(
                "select d.val_loss, r.final_val_loss from depth_results d join runs r on r.id = "
                "d.run_id where r.arch = 'frailt'"
            )
        )
    )
    assert row["val_loss"] == pytest.approx(row["final_val_loss"], rel=1e-6)


def test_cli_errors_are_one_line(results, capsys):
    from benchctl import cli

    for argv, text in (
        (["--depths", "1,x"], "--depths"),
        (["--exit", "foo"], "--exit: unknown rule 'foo'"),
        (["--extrapolate", "bogus"], "--extrapolate: unknown rule 'bogus'"),
        (["--extrapolate", "cycle", "--archs", "frailt,control", "--depths", "1,0"], "--depths"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["depth", "--db", str(results), "--no-progress", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == ConfigError.exit_code and text in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_depth_samples_are_tagged(results):
    db = stages.connect(results)
    small = dict(n_prompts=3, max_new_tokens=6, batch_size=3)

    def sample(archs=("frailt",), **options):
        return smp.sample_all(
            db, results, SampleOptions(select=RunSelection(archs=archs), **small, **options), progress=False
        )

    plain = sample()
    deep = sample(n_recur=8)
    exiting = sample(exit_rule="kl", exit_threshold=1e-3)
    assert len({plain.settings_hash, deep.settings_hash, exiting.settings_hash}) == 3
    assert "extrapolate" not in plain.settings.to_dict()  # default samples keep their settings hash
    rows = {r["settings_hash"]: r for r in db.query("select * from samples")}
    assert rows[deep.settings_hash]["n_recur"] == 8 and rows[deep.settings_hash]["extrapolate"] == "last"
    ex = rows[exiting.settings_hash]
    assert ex["exit_rule"] == "kl" and ex["exit_threshold"] == 1e-3 and 1 <= ex["mean_depth"] <= 4
    assert rows[plain.settings_hash]["mean_depth"] is None and rows[plain.settings_hash]["extrapolate"] is None
    mean = next(
        iter(db.query("select avg(mean_depth) as d from samples where settings_hash = ?", [exiting.settings_hash]))
    )["d"]
    assert exiting.runs[0].mean_depth == pytest.approx(mean)
    with pytest.raises(Exception, match="fixed depth"):
        sample(archs=["control"], exit_rule="kl")


# ---- report ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_section_renders_on_a_fixture(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, depth=True)
    built = report.build(path)
    md = built.markdown
    sec = md[md.index("\n## Test-time recurrence\n") :]
    sec = sec[: sec.index("\n## ", 5)] if "\n## " in sec[5:] else sec
    for fig in ("depth_loss.png", "depth_frontier.png", "depth_exit_hist.png"):
        assert f"(figures/{fig})" in sec
    assert "- frailt improves past its trained depth" in sec and "- relaxed degrades past its trained depth" in sec
    assert "- three-part saturates past its trained depth" in sec
    assert "saturates = the change is shown to lie within ±0.01 nats by two one-sided t-tests" in sec
    assert "95% CI" in sec and "skips exited tokens" in sec
    empty = report.build(build_fixture_db(tmp_path / "none.db", seeds=(0,), judge=False, evals=False)).markdown
    assert "No test-time depth rows" in empty


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_frontier_labels_every_exit_threshold_once_and_none_overlaps(tmp_path):
    """frailt and relaxed exit at the same mean depths with the same losses here, so each threshold's points of the
    two lines coincide: one label says the threshold there, and no label is printed over another text."""
    from figcheck import labels, outside_figure, overlapping_labels

    built = report.build(build_fixture_db(tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, depth=True))
    fig = built.figures["depth_frontier.png"]
    shown = labels(fig)
    assert sorted(shown) == sorted(["0.0001", "0.001", "0.01"] * 2)  # two spots per threshold: shared, three-part
    assert not overlapping_labels(fig) and not outside_figure(fig)


def _depth_df(changes: list[float], at_trained: float = 3.2, trained: int = 4):
    """depth_results rows of one frailt line over len(changes) seeds: the trained depth and twice it."""
    import pandas as pd

    rows = []
    for seed, change in enumerate(changes):
        for d, v in ((trained, at_trained), (2 * trained, at_trained + change)):
            rows.append({"model": "frailt", "line": "frailt", "seed": seed, "n_recur": d, "val_loss": v})
    return pd.DataFrame(rows).assign(trained=trained, exit_rule="", extrapolate="", mean_depth=lambda f: f["n_recur"])


_FRAILT = type("Ctx", (), {"arch_of": {"frailt": "frailt"}})()


def test_a_wide_ci_containing_zero_is_not_called_saturation():
    from benchctl.stages.depth import report as depth_report

    (line,) = depth_report.verdicts(_FRAILT, _depth_df([-0.04, 0.05, 0.0]))  # mean +0.003, CI about ±0.11
    assert "saturates" not in line.split(":")[0]
    assert line.startswith("- frailt is not shown to improve, degrade or saturate past its trained depth")
    assert "contains 0, which is no evidence of saturation" in line and "is not inside ±0.01 nats" in line


def test_a_tight_ci_within_the_margin_is_saturation_with_the_margin_in_the_sentence():
    from benchctl.stages.depth import report as depth_report

    (line,) = depth_report.verdicts(_FRAILT, _depth_df([0.001, -0.0005, 0.0012, 0.0003]))
    assert line.startswith("- frailt saturates past its trained depth")
    assert "within ±0.01 nats by two one-sided t-tests, 90% CI [" in line
    # a consistent change smaller than the margin: saturation, and the sentence says the change is real
    (line,) = depth_report.verdicts(_FRAILT, _depth_df([0.002, 0.0021, 0.0019]))
    assert line.startswith("- frailt saturates") and "the change is real but smaller than the margin" in line
    # improvement by more than the margin is still an improvement
    (line,) = depth_report.verdicts(_FRAILT, _depth_df([-0.05, -0.06, -0.055]))
    assert line.startswith("- frailt improves past its trained depth")


def test_one_seed_is_never_called_saturation():
    from benchctl.stages.depth import report as depth_report

    (line,) = depth_report.verdicts(_FRAILT, _depth_df([0.0]))
    assert line.startswith("- frailt has one seed, so nothing is tested past its trained depth")
    assert "change +0.0000 for this one trained model, within ±0.01 nats" in line and "two seeds or more" in line
    (line,) = depth_report.verdicts(_FRAILT, _depth_df([-0.05]))
    assert "outside ±0.01 nats; one seed has no CI, so whether the architecture improves needs" in line


# ---- architectures without the iteration hooks -------------------------------------------------------------------


def test_depth_sweeps_what_a_forward_without_hooks_accepts(tiny_model):
    """ut-act and mor have no iteration hooks (no exit), but their forward runs any depth up to their trained one
    (the most steps halting or routing gives a token): the sweep measures those; the control, one depth, one row."""
    import pandas as pd

    from benchctl.stages.depth import report as depth_report

    def sweep(arch, exit_rule=None):
        cls = architectures.get(arch)
        model = tiny_model(arch)
        return dp.settings_for(
            cls,
            model.args.n_recur,
            depths=DEFAULT_DEPTHS,
            exit_rule=exit_rule,
            thresholds=(1e-3,),
            max_depth=None,
            extrapolate=None,
            with_trained=True,
            limit=cls.max_n_recur(model.args),
        )

    assert [s.n_recur for s in sweep("ut-act")] == [1, 2, 4]
    assert [s.n_recur for s in sweep("mor")] == [1, 2, 3]
    assert [s.n_recur for s in sweep("control")] == [1]
    assert sweep("mor", "kl") == [] and sweep("ut-act", "kl") == []
    windows = tokens(4, 17)
    for arch in ("ut-act", "mor"):
        model = tiny_model(arch)
        with torch.no_grad():  # the trained-depth forward, as the run evaluates it
            want = float(model(windows[:, :-1], windows[:, 1:])[1])
        losses = {
            s.n_recur: dp.measure(model, windows, 2, torch.device("cpu"), None, 0, s)["val_loss"] for s in sweep(arch)
        }
        assert losses[model.args.n_recur] == pytest.approx(want, rel=1e-6)
        # one step is another model (at initialisation ut-act's tokens all halt at step 2, so 2 and 4 agree)
        assert losses[1] != losses[model.args.n_recur], losses

    # the report draws them as curves and says they stop at their trained depth
    df = pd.DataFrame(
        [
            {"model": m, "line": m, "seed": 0, "n_recur": d, "val_loss": v, "trained": t, "exit_rule": ""}
            for m, t, pts in (("mor", 3, {1: 5.0, 2: 4.5, 3: 4.25}), ("control", 1, {1: 4.0}))
            for d, v in pts.items()
        ]
    ).assign(extrapolate="", mean_depth=lambda f: f["n_recur"].astype(float))
    ctx = type("Ctx", (), {"arch_of": {"mor": "mor", "control": "control"}})()
    assert depth_report.verdicts(ctx, df) == [
        "- mor runs at most its trained depth 3, so nothing is measured past it: loss 4.2500 at depth 3 and 5.0000 at "
        "depth 1."
    ]
    assert depth_report._swept(ctx, df[df["model"] == "mor"]) and not depth_report._swept(
        ctx, df[df["model"] == "control"]
    )
