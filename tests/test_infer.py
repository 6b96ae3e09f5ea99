"""`benchctl infer` (benchctl/stages/infer): its options (one-line errors naming the flag), the settings each
architecture gets, the stage end to end on tiny trained runs (rows for every setting, the control's reference row,
agreement against full depth, the latent view; a rerun measures nothing), its browse query, and the report section
"Inference cost" from a fixture database."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import numpy as np
import pandas as pd
import pytest
import sqlite_utils
import torch
from fixtures_db import build_fixture_db, train_tiny_runs

from benchctl.core.errors import ConfigError
from benchctl.stages.infer.latent import states, trace_latents
from benchctl.stages.infer.options import DEFAULT_KV, DEFAULT_THRESHOLDS, InferOptions, parse_kv
from benchctl.stages.infer.tables import browse_queries
from benchctl.stages.report import engine as report

# ---- options ---------------------------------------------------------------------------------------------------------


def test_options_parse_the_command_lines_lists():
    opts = InferOptions()
    assert (opts.thresholds, opts.kv, opts.drafts) == (DEFAULT_THRESHOLDS, DEFAULT_KV, (1, 2))
    assert DEFAULT_KV == ("full", "last", "budget:2", "first") and DEFAULT_THRESHOLDS == (0.0, 1e-3, 1e-2)
    opts = InferOptions(thresholds="1e-2,0", kv="last,budget:03,last", drafts="")
    assert (opts.thresholds, opts.kv, opts.drafts) == ((0.0, 1e-2), ("last", "budget:3"), ())
    assert parse_kv(["first"]) == ("first",)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"kv": "lastt"}, "--kv: unknown strategy 'lastt'; did you mean 'last'?"),
        ({"kv": "budget:0"}, "--kv: budget:K needs a whole number K >= 1"),
        ({"thresholds": "-1"}, "--thresholds"),
        ({"thresholds": "x"}, "--thresholds"),
        ({"drafts": "0"}, "--drafts"),
        ({"exit_rule": "kll"}, "--exit: unknown rule 'kll'; did you mean 'kl'?"),
        ({"spec_k": 0}, "--spec-k must be >= 1"),
        ({"batch": 2, "single": 3}, "--single (3) cannot exceed --batch (2)"),
        ({"latent_sequences": -1}, "--latent-sequences must be >= 0"),
        ({"repeats": 0}, "--repeats must be >= 1"),
    ],
)
def test_bad_options_name_their_flag(bad, says):
    with pytest.raises(ConfigError) as e:
        InferOptions(**bad)
    assert says in str(e.value)


# ---- latent view ---------------------------------------------------------------------------------------------------

RECURRENT = ["frailt", "three-part", "relaxed", "huginn", "trm"]


@pytest.mark.parametrize("arch", RECURRENT)
def test_latent_states_are_the_ones_the_forward_reads_out(arch, tiny_model):
    """The last traced state, through the coda, final norm and head, gives the model's own logits; the stored
    convergence is the relative change between consecutive traced states."""
    model = tiny_model(arch).eval()
    w = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(3))
    st = states(model, w[:1, :-1], seed=5)
    n = model.resolve_n_recur(None)
    assert st.shape[:2] == (n + 1, 12)  # the state is (T, d) or wider (trm carries two)
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    torch.manual_seed(5)
    with torch.no_grad():
        ref = model(w[:1, :-1])[0]
        got = model.output(model.norm(model.coda(st[-1][None], cos, sin, None)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    rows = trace_latents(model, w, n_tokens=3, seed=5)
    assert len(rows) == 2 and rows[0]["n_recur"] == n and rows[0]["tokens"] == 12
    conv = torch.tensor(json.loads(rows[0]["convergence_json"]))
    want = (st[1:] - st[:-1]).norm(dim=-1) / st[1:].norm(dim=-1)
    torch.testing.assert_close(conv, want, rtol=1e-4, atol=1e-5)
    assert json.loads(rows[0]["positions_json"]) == [0, 6, 11]
    xy = json.loads(rows[0]["pca_json"])
    assert len(xy) == 3 and all(len(traj) == n + 1 and len(traj[0]) == 2 for traj in xy)
    explained = json.loads(rows[0]["explained"])
    assert 0 < explained[1] <= explained[0] and sum(explained) <= 1 + 1e-9


# ---- browse and report -----------------------------------------------------------------------------------------------


def test_browse_query_follows_the_files_columns():
    assert browse_queries({"runs": ["id"]}) == {}
    q = browse_queries({"runs": ["id", "variant"], "inference_results": ["run_id", "setting", "tokens_json"]})
    sql = q["inference_results"]["sql"]
    assert "coalesce(r.variant, r.arch) as model" in sql and "i.setting" in sql and "tokens_json" not in sql


def _section(md: str, title: str) -> str:
    sec = md[md.index(f"\n## {title}\n") :]
    return sec[: sec.index("\n## ", 5)] if "\n## " in sec[5:] else sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_section_renders_on_a_fixture(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, infer=True)
    built = report.build(path)
    sec = _section(built.markdown, "Inference cost")
    for fig in ("infer_frontier.png", "infer_convergence.png", "infer_trajectories.png"):
        assert f"(figures/{fig})" in sec and fig in built.figures
    assert "**control** (reference)" in sec and "| full depth | 2 |" in sec
    assert "- frailt: `n=trained exit=0.001 rule=kl kv=last` is cheaper than full depth" in sec
    frailt = next(x for x in sec.splitlines() if x.startswith("- frailt:"))
    assert "shown below +0.01 nats by a one-sided t over 2 seeds (non-inferiority p = " in frailt
    assert "over the 2 cheaper settings of frailt" in frailt  # the family the setting was picked from
    assert "shown to be below +0.01 nats by a one-sided t-test (non-inferiority, α = 0.05)" in sec
    assert "- relaxed: no cheaper setting is shown to be no worse than full depth" in sec
    assert "- three-part: no setting spends fewer FLOPs per generated token or holds fewer KV bytes" in sec
    assert "- control" not in sec  # the reference gets no sentence
    assert "`benchctl infer`, one timed generation each." in sec  # rows that record no repeats
    fx = sqlite_utils.Database(path)
    if "repeats" not in fx["inference_results"].columns_dict:
        fx["inference_results"].add_column("repeats", int)
    fx.execute("update inference_results set repeats = 3")
    fx.conn.commit()
    assert "`benchctl infer`, each the median of 3 timed generations." in report.build(path).markdown
    # paired timings: the chosen setting's sentence gives its speed-up over full depth with a sign test
    chosen = "n=trained exit=0.001 rule=kl kv=last"
    if "speedups_json" not in fx["inference_results"].columns_dict:
        fx["inference_results"].add_column("speedups_json", str)
    fx.execute(
        "update inference_results set speedups_json = ? where setting = ?",
        [json.dumps({"single": [1.1, 1.2, 1.05], "batch": [1.0, 1.0, 1.0]}), chosen],
    )
    fx.conn.commit()
    sec = _section(report.build(path).markdown, "Inference cost")
    line = next(s for s in sec.splitlines() if s.startswith("- frailt:"))
    assert "decode at batch 1 ×1.10 full depth's tokens/s (median of 6 timings beside full depth, 1.05–1.20" in line
    assert "faster in 6 of 6, sign test p = 0.016" in line
    assert f"| {chosen} | 2 | " in sec and "| 1.10 |" in sec  # the table's × full b1 column
    one = report.build(build_fixture_db(tmp_path / "one.db", seeds=(0,), judge=False, evals=False, infer=True))
    one_sec = _section(one.markdown, "Inference cost")
    assert "- frailt: one seed, so nothing is tested: `n=trained exit=0.001 rule=kl kv=last`" in one_sec
    assert "needs two seeds or more" in one_sec and "is cheaper than full depth" not in one_sec
    empty = report.build(build_fixture_db(tmp_path / "none.db", seeds=(0,), judge=False, evals=False)).markdown
    assert "No inference rows" in _section(empty, "Inference cost")


# Paired speed-ups for every setting but full depth (three repeats each, around a per-setting level), and one
# contended row: frailt's seed 1 of one setting timed with the 2-core machine's load at 3.4.
_LEVEL = {
    "n=trained exit=0.001 rule=kl kv=last": 1.3,
    "n=trained exit=0.01 rule=kl kv=first": 1.8,
    "n=trained exit=0.01 rule=kl kv=last": 1.5,
    "speculative draft n=1 k=4": 0.9,
}
_BUSY = ("frailt", 1, "n=trained exit=0.01 rule=kl kv=first")


def _paired(arch: str, seed: int, setting: str) -> dict:
    extra: dict = {}
    if setting != "full depth":
        level = _LEVEL[setting] * (1 + 0.01 * seed)
        extra["speedups_json"] = json.dumps({"single": [level, level * 1.02, level * 0.99], "batch": [level] * 3})
        extra["repeats"] = 3
    if (arch, seed, setting) == _BUSY:
        extra["load_avg"] = 3.4
    return extra


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_frontier_draws_each_setting_against_full_depth_as_its_rows_say(tmp_path):
    """Every point of a model's panels is one of its settings, where the rows put it: the median of the stored
    paired speed-ups (full depth at 1), the KV bytes over full depth's, the loss change paired by seed; the labels
    are exactly the settings present and cover no other text; the contended row is flagged on the figure and in the
    table."""
    from figcheck import outside_figure, overlapping_labels
    from matplotlib.text import Annotation

    from benchctl.stages.infer.report import paired_speedups

    path = build_fixture_db(
        tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, infer=True, infer_extra=_paired
    )
    built = report.build(path)
    fig = built.figures["infer_frontier.png"]
    rows = list(
        sqlite_utils.Database(path).query(
            "select r.arch, r.seed, i.* from inference_results i join runs r on r.id = i.run_id where r.status = 'done'"
        )
    )
    panels = {}
    for ax in fig.axes:
        panels.setdefault(ax.get_title(), []).append(ax)
    assert sorted(panels) == ["frailt", "relaxed", "three-part"]  # the control has nothing to set against
    red = 0
    for arch, (speed_ax, kv_ax) in panels.items():
        mine = [r for r in rows if r["arch"] == arch]
        settings = {r["setting"] for r in mine}
        full = {r["seed"]: r for r in mine if r["setting"] == "full depth"}
        for ax, value in ((speed_ax, "speed"), (kv_ax, "kv")):
            shown = []
            for ann in (t for t in ax.texts if isinstance(t, Annotation)):
                x, y = ann.xy
                for name in ann.get_text().split("\n"):
                    shown.append(name)
                    h = [r for r in mine if r["setting"] == name]
                    change = np.mean([r["val_loss"] - full[r["seed"]]["val_loss"] for r in h])
                    assert x == pytest.approx(change, abs=1e-12), (arch, name)
                    if value == "kv":
                        want = np.mean([r["kv_bytes_per_1k"] for r in h]) / np.mean(
                            [r["kv_bytes_per_1k"] for r in full.values()]
                        )
                    else:
                        want = 1.0 if name == "full depth" else float(np.median(paired_speedups(pd.DataFrame(h))))
                    assert y == pytest.approx(want), (arch, name, value)
            assert sorted(shown) == sorted(settings), (arch, value)
            red += sum(line.get_markeredgecolor() == "#C00000" for line in ax.get_lines())
    assert red == 1  # the contended setting's speed-up; its KV bytes are a count, not a timing
    assert not overlapping_labels(fig) and not outside_figure(fig)
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("contended" in t for t in legend)
    sec = _section(built.markdown, "Inference cost")
    assert "| n=trained exit=0.01 rule=kl kv=first † | 2 |" in sec
    assert sum(" † |" in line for line in sec.splitlines()) == 1
    assert (
        "† frailt `n=trained exit=0.01 rule=kl kv=first` seed 1 was timed on a contended machine (mean load 3.4 on "
        "2 cores; training runs are flagged by the same rule): its tokens/s are not a cost measure here." in sec
    )
    assert "Hollow speed-ups with a red edge were timed on a contended machine (†)." in sec
    assert "control: full depth only, nothing to set against it." in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_rows_without_load_still_report_and_gain_the_columns_when_opened_to_write(tmp_path):
    """A database from before the load was recorded: the report shows neither the load columns nor a flag, and
    the next writing command adds the columns (empty for the old rows)."""
    from benchctl import stages

    path = build_fixture_db(tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, infer=True)
    conn = sqlite3.connect(path)
    for col in ("load_avg", "cores", "cpu_share"):
        conn.execute(f"alter table inference_results drop column {col}")
    conn.commit()
    conn.close()
    sec = _section(report.build(path).markdown, "Inference cost")
    assert "| agreement | acceptance |" in sec and "load avg" not in sec and "†" not in sec
    assert "(figures/infer_frontier.png)" in sec
    db = stages.connect(path)
    cols = db["inference_results"].columns_dict
    assert {"load_avg", "cores", "cpu_share"} <= set(cols)
    assert next(iter(db.query("select count(*) as n from inference_results where load_avg is not null")))["n"] == 0
    db.conn.close()


def _settings_frame(changes: dict[str, list[float]]):
    """inference rows of one frailt model: full depth and, per setting, a cheaper one (half the FLOPs, the same KV
    bytes) whose loss differs from full depth's by the given change at each seed."""
    import pandas as pd

    rows = []
    for i, (setting, deltas) in enumerate({FULL: None, **changes}.items()):
        for seed in range(3):
            rows.append(
                {
                    "model": "frailt",
                    "seed": seed,
                    "setting": setting,
                    "kind": "plain",
                    "warm_start": 0,
                    "exit_threshold": 0.0 if deltas is None else 10.0**-i,
                    "kv": "full",
                    "draft_n_recur": 0,
                    "flops_per_token": 4e6 if deltas is None else 4e6 / (1 + i),
                    "kv_bytes_per_1k": 16e6,
                    "val_loss": 3.3 + 0.05 * seed + (0.0 if deltas is None else deltas[seed]),
                }
            )
    return pd.DataFrame(rows)


FULL = "full depth"
_FRAILT = type("Ctx", (), {"arch_of": {"frailt": "frailt"}})()


def test_no_worse_is_corrected_for_the_choice_among_settings():
    """Three cheaper settings, each non-inferior within 0.01 nats at p < 0.05 on its own: picking the cheapest of them
    without a correction would call it no worse; Holm over the three does not."""
    from scipy import stats as sps

    from benchctl.stages.infer import report as infer_report

    changes = {"a": [0.002, 0.006, 0.0035], "b": [0.001, 0.006, 0.003], "c": [0.0, 0.007, 0.003]}
    raw = {k: sps.ttest_1samp(v, 0.01, alternative="less").pvalue for k, v in changes.items()}
    assert all(p < 0.05 for p in raw.values()) and min(raw.values()) * 3 > 0.05
    line = infer_report.verdict(_FRAILT, "frailt", _settings_frame(changes))
    assert line.startswith("- frailt: no cheaper setting is shown to be no worse than full depth")
    assert "Holm-adjusted over the 3 cheaper settings of frailt" in line
    # one setting alone, the same numbers: the family is that one setting and the test passes
    line = infer_report.verdict(_FRAILT, "frailt", _settings_frame({"a": changes["a"]}))
    assert line.startswith("- frailt: `a` is cheaper than full depth")
    assert f"non-inferiority p = {raw['a']:.3f}, Holm-adjusted p = {raw['a']:.3f} over the 1 cheaper setting of" in line


def test_no_worse_needs_the_change_below_the_margin_not_a_ci_containing_zero():
    from benchctl.stages.infer import report as infer_report

    wide = {"a": [-0.03, 0.04, 0.002]}  # mean +0.004: its CI contains 0 and reaches far above the margin
    line = infer_report.verdict(_FRAILT, "frailt", _settings_frame(wide))
    assert line.startswith("- frailt: no cheaper setting is shown to be no worse")
    better = {"a": [-0.02, -0.025, -0.018]}  # clearly lower loss: no worse by any margin
    assert "`a` is cheaper than full depth" in infer_report.verdict(_FRAILT, "frailt", _settings_frame(better))


# ---- the stage end to end --------------------------------------------------------------------------------------------

SMALL = dict(
    batch=3,
    single=1,
    prompt_tokens=6,
    new_tokens=5,
    windows=4,
    thresholds="0,1e-2",
    kv="full,last",
    drafts="1",
    latent_sequences=1,
    latent_tokens=3,
    repeats=2,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tinystories_dir):
    return train_tiny_runs(tmp_path_factory.mktemp("infer"), tinystories_dir)


@pytest.fixture
def results(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHCTL_CACHE", str(trained / "cache"))
    shutil.copytree(trained / "results", tmp_path / "results")
    return tmp_path / "results" / "results.db"


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_infer_measures_every_setting_once_and_resumes(results):
    from benchctl import stages
    from benchctl.stages.infer import engine

    db = stages.connect(results)
    s = engine.infer_all(db, results, InferOptions(**SMALL), progress=False)
    rows = list(db.query("select i.*, r.arch from inference_results i join runs r on r.id = i.run_id"))
    assert len(rows) == len(s.rows) == 6 and not s.unsupported
    control = [r for r in rows if r["arch"] == "control"]
    frailt = {r["setting"]: r for r in rows if r["arch"] == "frailt"}
    assert [r["setting"] for r in control] == ["full depth"] and control[0]["agreement"] == 1.0
    assert len(frailt) == 5  # full depth, threshold 0 under last, 1e-2 under full and last, one draft
    full = frailt["full depth"]
    assert (full["prompts"], full["single"], full["prompt_tokens"], full["new_tokens"], full["windows"]) == (
        3,
        1,
        6,
        5,
        4,
    )
    assert len(json.loads(full["tokens_json"])) == 3 and full["kv_bytes_per_1k"] > 0 and full["flops_per_token"] > 0
    for r in rows:
        assert r["tokens_per_s_1"] > 0 and r["tokens_per_s_batch"] > 0 and r["val_loss"] > 0
        assert r["repeats"] == 2  # each speed the median of two timed generations, with their range
        assert r["tokens_per_s_1_min"] <= r["tokens_per_s_1"] <= r["tokens_per_s_1_max"]
        assert r["tokens_per_s_batch_min"] <= r["tokens_per_s_batch"] <= r["tokens_per_s_batch_max"]
        assert 0 <= r["agreement"] <= 1
        assert r["cores"] == os.cpu_count() and r["load_avg"] is not None and 0 < r["cpu_share"] < 1.5
        if r["setting"] == "full depth":  # the reference is not timed against itself
            assert r["speedup_1"] is None and r["speedups_json"] is None
        else:  # every other setting is timed beside full depth in each repeat
            ratios = json.loads(r["speedups_json"])
            assert len(ratios["single"]) == len(ratios["batch"]) == 2
            assert r["speedup_1_min"] <= r["speedup_1"] <= r["speedup_1_max"] and r["speedup_batch"] > 0
    assert all(1 <= r["mean_depth"] <= r["n_recur"] for r in frailt.values() if r["kind"] == "plain")
    assert all(1 <= r["mean_exit_depth"] <= r["mean_depth"] for r in frailt.values() if r["kind"] == "plain")
    spec = [r for r in frailt.values() if r["kind"] == "speculative"]
    assert len(spec) == 1 and spec[0]["draft_n_recur"] == 1 and spec[0]["agreement"] == 1.0  # greedy is exact
    assert spec[0]["val_loss"] == full["val_loss"] and spec[0]["proposed"] >= spec[0]["accepted"] >= 0
    zero = next(r for r in frailt.values() if r["kind"] == "plain" and r["exit_threshold"] == 0 and r["kv"] == "last")
    assert zero["agreement"] == 1.0 and zero["val_loss"] == full["val_loss"]  # nothing exits at threshold 0
    lat = list(db.query("select l.*, r.arch from inference_latents l join runs r on r.id = l.run_id"))
    assert [(r["arch"], r["sequence"]) for r in lat] == [("frailt", 0)] and s.latents == 1
    assert len(json.loads(lat[0]["convergence_json"])) == lat[0]["n_recur"]
    again = engine.infer_all(db, results, InferOptions(**SMALL), progress=False)
    assert (len(again.rows), again.skipped, again.latents) == (0, 6, 0)
    # resumable: a lost row is measured again, its agreement against the stored full-depth tokens
    db.conn.execute("delete from inference_results where setting = ?", [spec[0]["setting"]])
    db.conn.commit()
    resumed = engine.infer_all(db, results, InferOptions(**SMALL), progress=False)
    assert [r["setting"] for r in resumed.rows] == [spec[0]["setting"]] and resumed.rows[0]["agreement"] == 1.0


def test_paired_timing_alternates_and_keeps_each_repeats_ratio(monkeypatch):
    """The setting and full depth take turns going first, and the stored speed-up is the ratio of their decode
    rates repeat by repeat (here the setting decodes in half full depth's time)."""
    from types import SimpleNamespace

    from architectures import inference as inf
    from benchctl.stages.infer import engine

    calls = []

    def fake_generate(model, m, prompts, new, seed):
        calls.append((m.label, len(prompts)))
        seconds = 1.0 if m.label == engine.FULL else 0.5
        return SimpleNamespace(
            new_tokens=new * len(prompts),
            decode_seconds=seconds * len(prompts),
            prefill_seconds=0.1,
            tokens=[[1]] * len(prompts),
            kv_bytes=0,
            flops_per_token=1.0,
            mean_depth=1.0,
            mean_exit_depth=1.0,
        )

    monkeypatch.setattr(engine, "_generate", fake_generate)
    monkeypatch.setattr(engine, "teacher_forced", lambda *a: {"val_loss": 1.0})
    monkeypatch.setattr(inf, "kv_bytes_per_token", lambda *a: 0.0)
    cfg = SimpleNamespace(eval=SimpleNamespace(val_seed=0, val_batch_size=2), model=SimpleNamespace(n_recur=2))
    sizes = {"single": 2, "new_tokens": 4, "windows": 2}
    setting = engine.Measured(inf.InferenceSetting(exit_threshold=0.01, exit_rule="kl", kv="last"))
    full = engine.Measured(inf.InferenceSetting())
    row = engine.measure(None, setting, [[1, 2]] * 3, sizes, torch.zeros(2, 3), cfg, torch.device("cpu"), None, 3, full)
    timed = [label for label, n in calls[2:] if n == 3]  # the batched generations after the two warm-ups
    assert timed == [setting.label, engine.FULL, engine.FULL, setting.label, setting.label, engine.FULL]
    assert json.loads(row["speedups_json"]) == {"single": [2.0, 2.0, 2.0], "batch": [2.0, 2.0, 2.0]}
    assert row["speedup_1"] == row["speedup_batch"] == 2.0 and row["tokens_per_s_1"] == 8.0
    # what the timings ran under, stored with them: the machine's load and cores, the process's share of the CPU
    assert row["cores"] == os.cpu_count() and row["load_avg"] == pytest.approx(os.getloadavg()[0], abs=2.0)
    assert row["cpu_share"] is not None and row["cpu_share"] >= 0
    calls.clear()
    alone = engine.measure(None, setting, [[1, 2]] * 3, sizes, torch.zeros(2, 3), cfg, torch.device("cpu"), None, 2)
    assert {label for label, _ in calls} == {setting.label} and alone["speedup_1"] is None
    assert alone["speedups_json"] is None


def test_cli_prints_the_rows_and_errors_are_one_line(results, capsys):
    from benchctl import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["infer", "--db", str(results), "--no-progress", "--kv", "lastt"])
    err = capsys.readouterr().err
    assert exc.value.code == ConfigError.exit_code and "--kv: unknown strategy 'lastt'" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    argv = ["infer", "--db", str(results), "--no-progress", "--archs", "control", "--batch", "2", "--single", "1"]
    for too_long, says in ((["--prompt-tokens", "1000"], "at most half of it"), (["--new-tokens", "1000"], "at most")):
        with pytest.raises(SystemExit) as exc:  # more than the context holds: refused, never measured shorter
            cli.main([*argv, *too_long])
        err = capsys.readouterr().err
        assert exc.value.code == ConfigError.exit_code and too_long[0] in err and says in err, err
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--new-tokens", "3", "--windows", "2"])
    out = capsys.readouterr().out
    assert exc.value.code in (0, None) and "1 measured, 0 already stored, 0 run(s) traced" in out
    assert f"sqlite-utils {results} " in " ".join(out.split()) and "{path}" not in out  # the database, named
    from benchctl import stages

    rows = list(stages.connect(results).query("select setting, prompts, new_tokens, windows from inference_results"))
    assert rows == [{"setting": "full depth", "prompts": 2, "new_tokens": 3, "windows": 2}]


def test_the_study_stage_measures_the_finished_runs_once(results):
    from benchctl import stages
    from benchctl.stages.infer.stage import STAGE
    from benchctl.stages.train import tables as train_tables

    db = stages.connect(results)
    control = [r["id"] for r in train_tables.runs(db) if r["arch"] == "control"]
    lines: list[str] = []
    study = stages.StudyRun(
        opts=stages.StudyOptions(preset="tiny", db_path=results, progress=False),
        cfgs=[],
        archs=["control"],
        log=lines.append,
        trained=stages.TrainAllResult(skipped=control),
        heading="9/11 infer",
    )
    STAGE.run(study)
    STAGE.run(study)
    assert lines == [
        "== 9/11 infer: inference cost per setting, and the latent view",
        "   1 row(s) measured, 0 already stored, 0 run(s) traced",
        "== 9/11 infer: inference cost per setting, and the latent view",
        "   0 row(s) measured, 1 already stored, 0 run(s) traced",
    ]
    skipping = stages.StudyRun(
        opts=stages.StudyOptions(preset="tiny", db_path=results, skip=("infer",)),
        cfgs=[],
        archs=["control"],
        log=lines.append,
        trained=stages.TrainAllResult(skipped=control),
    )
    STAGE.run(skipping)
    assert lines[-1] == "== : skipped" and len(lines) == 5
