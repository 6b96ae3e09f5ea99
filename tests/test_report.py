"""`benchctl report`: the report's numbers against independent computations from a fixture results.db, valid and
deterministic figures, robustness (empty, partial, failed, single seed, several presets, config variants), the CLI."""

from __future__ import annotations

import hashlib
import math
import re
import sqlite3
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures_db import (
    CONTROLS_VARIANTS,
    JUDGE_MODEL,
    PROMPT_HASH,
    STUDY_ARCHS,
    build_fixture_db,
    build_plan_fixture_db,
)
from scipy import stats as sps
from typer.testing import CliRunner

from benchctl import report, stages
from benchctl.cli import app, main
from benchctl.core import paper
from benchctl.core import stats as bstats
from benchctl.core.config import make_config
from benchctl.core.errors import ConfigError, DatabaseError, ForeignDatabaseError
from benchctl.stages.report import engine as report_engine

SECTIONS = (
    "Runs",
    "Models",
    "Training cost",
    "Loss",
    "Judge",
    "Judge reliability",
    "lm-eval",
    "Test-time recurrence",
    "Comparisons",
    "Benchmark",
    "Provenance",
)


# ---------------------------------------------------------------------------------------------------------------------
# helpers: read the markdown back


def section(md: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", md, flags=re.S | re.M)
    assert m, f"section {title!r} missing"
    return m.group(1)


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text` as a list of {header: cell} rows (escaped pipes kept inside cells)."""
    out, cur = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if cur is None:
                heads = []
                for c in cells:  # a repeated header (e.g. two "× control" columns) gets a suffix
                    heads.append(c if c not in heads else f"{c} ({heads.count(c) + 1})")
                cur = {"headers": heads, "rows": []}
            elif set(line) <= set("|-: "):
                continue
            else:
                cur["rows"].append(dict(zip(cur["headers"], cells)))
        elif cur is not None:
            out.append(cur["rows"])
            cur = None
    if cur is not None:
        out.append(cur["rows"])
    return out


def by_model(rows: list[dict[str, str]], key: str = "model") -> dict[str, dict[str, str]]:
    return {r[key]: r for r in rows}


def q(path: Path, sql: str, params=()) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def t_ci(values) -> tuple[float, float, float]:
    x = np.asarray(values, float)
    m, h = x.mean(), sps.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return m, m - h, m + h


def fnum(x: float, d: int = 3) -> str:
    s = f"{x:,.{d}f}"
    return s[1:] if s.startswith("-") and float(s.replace(",", "")) == 0 else s


def fpv(p: float) -> str:
    return bstats.fmt_p(p).replace("p = ", "").replace("p ", "")


# ---------------------------------------------------------------------------------------------------------------------
# the full fixture: built and reported once for this module


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    path = build_fixture_db(d / "results.db", judge_repeats=2, bench=True, depth=True, infer=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out = report_engine.write_report(path, d / "reports")
    return {"db": path, "out": out, "md": out.read_text(), "digest": digest, "dir": d}


def done_values(db: Path, column: str, arch: str, preset: str = "tiny") -> list[float]:
    return [
        r[0]
        for r in q(
            db,
            f"select {column} from runs where status = 'done' and arch = ? and preset = ? order by seed",
            (arch, preset),
        )
    ]


@pytest.mark.registry  # the report renders every registered stage's sections
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_section_present_in_order(full):
    md = full["md"]
    pos = [md.index(f"\n## {s}\n") for s in SECTIONS]
    assert pos == sorted(pos)
    assert md.startswith("# benchctl report: preset `tiny`\n")
    assert "Runs of preset `tiny`: 12 done, 1 running, 1 failed." in md


@pytest.mark.registry  # the report renders every registered stage's sections
def test_no_missing_value_reaches_the_text_as_a_word(full):
    """A missing value is '-' or a sentence, never pandas' or Python's name for it: with pandas' string dtype a text
    column's None comes back as NaN, and `is None` or truthiness then lets 'nan' into a cell."""
    leaks = [line for line in full["md"].splitlines() if re.search(r"\b(nan|None|<NA>)\b", line)]
    assert not leaks, leaks


def test_report_only_reads_the_database(full):
    assert hashlib.sha256(full["db"].read_bytes()).hexdigest() == full["digest"]


def test_loss_table_matches_independent_computation(full):
    db, md = full["db"], full["md"]
    rows = by_model(tables(section(md, "Loss"))[0])
    assert list(rows) == list(STUDY_ARCHS)  # fixed architecture order
    for arch in STUDY_ARCHS:
        for col, name in (("final_val_loss", "final val loss"), ("initial_val_loss", "initial val loss")):
            m, lo, hi = t_ci(done_values(db, col, arch))
            r = rows[arch]
            assert r[name] == fnum(m)
            ci_col = list(r)[list(r).index(name) + 1]
            assert r[ci_col] == f"{fnum(lo)} to {fnum(hi)}"
        assert r["seeds"] == "3"  # the failed run and the running one are not seeds
        assert r["tokens/run"] == "15.4 k"  # 30 steps x 512 tokens
    assert "ln 512 = 6.238" in section(md, "Loss")
    assert "study initial" not in section(md, "Loss")  # the study's values sit beside ours only for `paper`


def test_loss_section_states_what_the_intervals_cover_read_from_the_configs(full, tmp_path):
    md, sec = full["md"], section(full["md"], "Loss")
    cfg = make_config("tiny", "control")
    n, t, seed = cfg.eval.val_windows, cfg.model.max_seq_len, cfg.eval.val_seed
    assert "The 95% CIs in this report cover the variation between training seeds only." in sec
    assert (
        f"Every model is scored on one fixed validation sample: {n:,} windows × {t:,} tokens ({n * t:,} predicted "
        f"tokens) of the validation split, eval.val_seed {seed}, drawn once" in sec
    )
    assert "cover that variation only: every run is scored on one fixed validation sample (see Loss)" in md
    # a model evaluated on another sample is named with it
    p = build_fixture_db(
        tmp_path / "v.db", archs=("control",), judge=False, evals=False, failed_run=False, running_run=False
    )
    build_fixture_db(
        p,
        archs=("frailt",),
        judge=False,
        evals=False,
        failed_run=False,
        running_run=False,
        overrides={"eval.val_seed": 7},
    )
    sec = section(report_engine.build(p).markdown, "Loss")
    assert "the models are scored on fixed validation samples that differ" in sec.lower()
    assert (
        f"frailt: {n:,} windows × {t:,} tokens ({n * t:,} predicted tokens) of the validation split, eval.val_seed 7"
        in sec
    )


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_epochs_per_run_from_the_recorded_split_or_a_run_on_the_same_data(tmp_path):
    kw = dict(archs=("control", "frailt"), judge=False, evals=False, failed_run=False, running_run=False)
    old = section(report_engine.build(build_fixture_db(tmp_path / "old.db", **kw)).markdown, "Loss")
    assert {r["epochs"] for r in tables(old)[0]} == {"-"}  # runs from before the split's size was stored
    assert "'-': the split's size is not recorded for these runs, nor for any run on the same data" in old
    tokens = 30 * make_config("tiny", "control").tokens_per_step  # every fixture run trains 30 steps
    split = 10_000
    rec = build_fixture_db(tmp_path / "rec.db", run_extra=lambda a, s: {"data_train_tokens": split}, **kw)
    rows = by_model(tables(section(report_engine.build(rec).markdown, "Loss"))[0])
    assert rows["control"]["epochs"] == rows["frailt"]["epochs"] == f"{tokens / split:.2f}"
    # one run recorded it: the others, on the same prepared data (the same fingerprint), take its size
    one = build_fixture_db(
        tmp_path / "one.db",
        run_extra=lambda a, s: {"data_train_tokens": split} if (a, s) == ("control", 0) else {},
        **kw,
    )
    sec = section(report_engine.build(one).markdown, "Loss")
    assert by_model(tables(sec)[0])["frailt"]["epochs"] == f"{tokens / split:.2f}"
    assert "taken from a run on the same prepared data (same data fingerprint)" in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_warm_up_share_is_shown_only_where_the_models_differ(full, tmp_path):
    assert "warm-up" not in tables(section(full["md"], "Loss"))[0][0]  # one recipe: nothing to flag
    p = build_plan_fixture_db(tmp_path / "c.db", "controls", CONTROLS_VARIANTS, seeds=(0, 1))
    sec = section(report_engine.build(p, plan="controls").markdown, "Loss")
    rows = by_model(tables(sec)[0])
    cfg = make_config("tiny", "control")
    assert rows["control"]["warm-up"] == f"{cfg.train.warmup_steps} of {cfg.train.max_steps} (16.7%)"
    assert rows["control-iso-flops"]["warm-up"] == f"{cfg.train.warmup_steps} of 101 (5%)"
    assert "it differs between the models here, so their learning-rate schedules differ" in sec
    # the same share rounded to whole steps (a plan scaling warm-up with the steps) is no difference
    from benchctl.stages.train import conditions

    same = pd.DataFrame({"warmup": [318 / 1589, 636 / 3179, 0.2]})
    assert not conditions.warmups_differ(same) and conditions.warmups_differ(same.assign(warmup=[0.2, 0.2, 0.08]))


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_runs_from_a_dirty_tree_are_flagged(full, tmp_path):
    assert "uncommitted changes" not in section(full["md"], "Loss")
    dirty = {("frailt", 1): "abc1234-dirty", ("control", 0): "abc1234-dirty", ("control", 2): "def5678"}
    p = build_fixture_db(
        tmp_path / "d.db",
        judge=False,
        evals=False,
        run_extra=lambda a, s: {"git_commit": dirty[(a, s)]} if (a, s) in dirty else {},
    )
    sec = section(report_engine.build(p).markdown, "Loss")
    rows = by_model(tables(sec)[0])
    assert rows["frailt"]["uncommitted changes"] == "seed 1" and rows["control"]["uncommitted changes"] == "seed 0"
    assert rows["relaxed"]["uncommitted changes"] == "-"
    assert "Trained from a checkout with uncommitted changes" in sec and ": control seed 0; frailt seed 1." in sec
    # control's seeds came from two commits (abc1234, with or without changes, and def5678)
    assert "Seeds of one model trained from different commits: control (2 commits)" in sec


def test_runs_section_lists_failed_and_running(full):
    sec = section(full["md"], "Runs")
    status = by_model(tables(sec)[0])
    assert status["frailt"]["running"] == "1" and status["relaxed"]["failed"] == "1"
    assert status["relaxed"]["seeds done"] == "0, 1, 2"
    bad = tables(sec)[1]
    assert {(r["model"], r["status"]) for r in bad} == {("relaxed", "failed"), ("frailt", "running")}
    failed = next(r for r in bad if r["status"] == "failed")
    assert failed["error"] == "RuntimeError: loss is NaN at step 15 | check train.lr"  # pipe escaped, then read back


def test_training_cost_matches_independent_computation(full):
    db, sec = full["db"], section(full["md"], "Training cost")
    rows = by_model(tables(sec)[0])
    ctrl_t = np.mean(done_values(db, "train_seconds", "control"))
    ctrl_m = np.mean(done_values(db, "step_mem_bytes", "control"))
    for arch in STUDY_ARCHS:
        t = done_values(db, "train_seconds", arch)
        r = rows[arch]
        assert r["training time (s)"] == fnum(np.mean(t), 2)
        assert r["range over seeds"] == f"{fnum(min(t), 2)} to {fnum(max(t), 2)}"
        m = np.mean(t)
        mem = np.mean(done_values(db, "step_mem_bytes", arch))
        rss = np.mean(done_values(db, "peak_rss_bytes", arch))
        assert r["step memory (MiB)"] == fnum(mem / 2**20, 2)
        assert r["process peak RSS (MiB)"] == fnum(rss / 2**20, 2)
        assert r["× control"] == fnum(m / ctrl_t, 2)
        assert r["× control (2)"] == fnum(mem / ctrl_m, 2)  # memory's ratio is the step's, never the process's
    assert "Intel(R) Xeon(R) CPU @ 2.20GHz (cpu)" in sec
    assert "Process peak RSS is a fact about the training process, not the model's cost" in sec


def test_models_section(full):
    sec = section(full["md"], "Models")
    acc = by_model(tables(sec)[0])
    assert acc["control"]["unique total"] == "69,920" and acc["relaxed"]["LoRA"] == "40,960"
    assert acc["three-part"]["depth"] == "16" and acc["control"]["depth"] == "4"
    study = by_model(tables(sec)[1])
    for arch, total in paper.TOTAL_PARAMS.items():
        assert study[arch]["study"] == f"{total:,}" and study[arch]["match"] == "yes"
    flags = tables(sec)[2]
    assert [f["study row"] for f in flags] == [f["what"] for f in paper.FLAGS]


# The components the study's architectures report, in model order.
_KNOWN_COMPONENTS = ("embedding", "blocks", "depth_encoding", "adapter", "recurrent_norm", "lora", "final_norm")


def test_models_table_shows_every_component_any_model_reports(tmp_path, monkeypatch):
    """A fifth architecture's own component gets a column (placed in its model's order), models without it show
    0, and each row's components add up to its total."""
    from benchctl.core import accounting
    from benchctl.report import frames

    real = accounting.describe

    def describe(cfg):
        row = dict(real(cfg))
        comps = list(row.get("components") or [c for c in _KNOWN_COMPONENTS if row.get(c)])
        row = {k: v for k, v in row.items() if k not in _KNOWN_COMPONENTS or k in comps}
        if cfg.arch == "frailt":
            comps.insert(comps.index("final_norm"), "exit_gate")
            row["exit_gate"] = 1_234
            row["total_params"] += 1_234
        row["components"] = comps
        return row

    monkeypatch.setattr(accounting, "describe", describe)
    frames._describe.cache_clear()
    try:
        p = build_fixture_db(
            tmp_path / "r.db",
            archs=("control", "frailt"),
            seeds=(0,),
            judge=False,
            evals=False,
            failed_run=False,
            running_run=False,
        )
        acc = tables(section(report_engine.build(p).markdown, "Models"))[0]
    finally:
        frames._describe.cache_clear()
    comp_cols = list(acc[0])[1 : list(acc[0]).index("unique total")]
    assert comp_cols == ["embedding", "blocks", "depth enc.", "exit_gate", "final norm"]
    rows = by_model(acc)
    assert rows["frailt"]["exit_gate"] == "1,234" and rows["control"]["exit_gate"] == "0"
    for r in rows.values():
        assert sum(int(r[c].replace(",", "")) for c in comp_cols) == int(r["unique total"].replace(",", ""))


def test_component_order_merges_each_models_order():
    from benchctl.report.frames import component_order

    assert component_order(
        [
            ["embedding", "blocks", "final_norm"],
            ["embedding", "blocks", "depth_encoding", "lora", "final_norm"],
            ["gate", "embedding", "blocks", "adapter", "final_norm"],
        ]
    ) == ["gate", "embedding", "blocks", "depth_encoding", "lora", "adapter", "final_norm"]
    assert component_order([]) == []


def _judge_truth(db: Path):
    """Per model: per-sample averages over ok repeats (independently, in SQL) grouped by seed, failures, and the
    judge average per (seed, prompt)."""
    rows = q(
        db,
        """
        select r.arch, r.seed, s.id, s.prompt_id, avg(g.grammar), avg(g.creativity), avg(g.consistency),
               avg(g.plot), avg(g.average)
        from judge_grades g join samples s on s.id = g.sample_id join runs r on r.id = s.run_id
        where r.status = 'done' and g.status = 'ok' group by r.arch, r.seed, s.id, s.prompt_id""",
    )
    failed = dict(
        q(
            db,
            """
        select r.arch, count(*) from judge_grades g join samples s on s.id = g.sample_id
        join runs r on r.id = s.run_id where r.status = 'done' and g.status != 'ok' group by r.arch""",
        )
    )
    per_seed, per_seed_prompt = {}, {}
    for arch, seed, _sid, pid, *vals in rows:
        per_seed.setdefault(arch, {}).setdefault(seed, []).append(vals)
        per_seed_prompt.setdefault(arch, {})[(seed, pid)] = vals[-1]
    return per_seed, failed, per_seed_prompt


def test_judge_table_matches_independent_computation(full):
    db, sec = full["db"], section(full["md"], "Judge")
    per_seed, failed, _ = _judge_truth(db)
    rows = by_model(tables(sec)[0])
    assert sum(failed.values()) == 3
    for arch in STUDY_ARCHS:
        seeds = per_seed[arch]
        r = rows[arch]
        assert r["graded"] == str(sum(len(v) for v in seeds.values())) and r["samples"] == "36"
        assert r["failed"] == str(failed.get(arch, 0))
        for j, c in enumerate(("grammar", "creativity", "consistency", "plot", "average")):
            m, lo, hi = t_ci([np.mean([v[j] for v in seeds[sd]]) for sd in sorted(seeds)])  # over seeds
            assert r[c] == f"{m:.2f} ± {(hi - lo) / 2:.2f}"
    assert f"`{JUDGE_MODEL}`" in sec and f"`{PROMPT_HASH}`" in sec
    assert "t-interval over the 3 seeds' means" in sec
    study = by_model(tables(sec)[1])
    assert study["three-part"]["average"] == "3.07"  # the study's grades beside ours


def _holm(ps):
    """Holm by hand: sorted p_(i) * (m - i), running max."""
    order = np.argsort(ps, kind="stable")
    adj, run = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = run
    return adj


def test_comparisons_match_scipy(full):
    db, sec = full["db"], section(full["md"], "Comparisons")
    rows = tables(sec)[0]
    loss = {(r["a"], r["b"]): r for r in rows if r["quantity"] == "final validation loss"}
    judge = {(r["a"], r["b"]): r for r in rows if r["quantity"] == "judge average"}
    expected_pairs = [
        ("frailt", "control"),
        ("three-part", "control"),
        ("relaxed", "control"),
        ("frailt", "three-part"),
        ("frailt", "relaxed"),
        ("three-part", "relaxed"),
    ]
    assert list(loss) == expected_pairs and list(judge) == expected_pairs
    ps = []
    for a, b in expected_pairs:  # every model has seeds 0, 1, 2: paired by seed
        xa, xb = done_values(db, "final_val_loss", a), done_values(db, "final_val_loss", b)
        ref = sps.ttest_rel(xa, xb)
        lo, hi = ref.confidence_interval(0.95)
        r = loss[(a, b)]
        assert r["test"] == "paired t over shared seeds" and r["n (a, b)"] == "3 shared"
        assert r["a − b"] == fnum(np.mean(xa) - np.mean(xb))
        assert r["95% CI"] == f"{fnum(lo)} to {fnum(hi)}"
        assert r["p"] == fpv(ref.pvalue) and r["p (Wilcoxon)"] == "-"  # fewer than 6 pairs
        # up to 5 pairs the exact sign-flip p stands beside the t p: scipy's exact paired permutation test
        exact = sps.permutation_test(
            (np.array(xa), np.array(xb)), lambda u, v: np.mean(u - v), permutation_type="samples", n_resamples=np.inf
        )
        assert r["p (sign-flip)"] == fpv(exact.pvalue)
        ps.append(ref.pvalue)
    assert [loss[p]["p (Holm, per quantity)"] for p in expected_pairs] == [fpv(x) for x in _holm(ps)]
    # judge: per seed, the mean paired difference over shared prompts; then a t over the seeds
    _, _, psp = _judge_truth(db)
    jps = []
    for a, b in expected_pairs:
        shared = sorted(set(psp[a]) & set(psp[b]))
        seeds = sorted({s for s, _ in shared})
        ma = [np.mean([psp[a][k] for k in shared if k[0] == s]) for s in seeds]
        mb = [np.mean([psp[b][k] for k in shared if k[0] == s]) for s in seeds]
        ref = sps.ttest_rel(ma, mb)
        r = judge[(a, b)]
        assert r["test"] == "t over per-seed means" and r["n (a, b)"] == "3 shared (12 prompts)"
        assert r["a − b"] == fnum(np.mean(ma) - np.mean(mb), 2) and r["p"] == fpv(ref.pvalue)
        lo, hi = ref.confidence_interval(0.95)
        assert r["95% CI"] == f"{fnum(lo, 2)} to {fnum(hi, 2)}"
        jps.append(ref.pvalue)
    assert [judge[p]["p (Holm, per quantity)"] for p in expected_pairs] == [fpv(x) for x in _holm(jps)]
    # one verdict sentence per comparison, decided on the Holm-adjusted p and naming its family
    verdicts = [ln[2:] for ln in sec.splitlines() if ln.startswith("- ")]
    assert len(verdicts) == 12
    for r, v in zip(rows, verdicts):
        assert v.startswith(f"{r['a']}'s") or v.startswith(f"{r['a']} vs")
        significant = r["p (Holm, per quantity)"] == "< 0.001" or float(r["p (Holm, per quantity)"]) < 0.05
        assert ("not distinguishable" in v) != significant
        assert f"over the 6 pairwise comparisons of {r['quantity']}" in v
        # 3 seeds: every sentence gives the exact sign-flip p, and a significant one says it rests on normality
        assert "exact sign-flip p = " in v
        assert ("significant only under the t-test's assumption of normal differences" in v) == significant
    # the table's adjusted p names its families below it
    assert "(the 6 pairwise comparisons of final validation loss; the 6 pairwise comparisons of judge average)" in sec
    assert f"judge `{JUDGE_MODEL}`, protocol `json`, prompt `{PROMPT_HASH}`" in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_raw_significance_that_holm_removes_is_not_called_a_difference(tmp_path):
    """A fixture where one pair has raw p < 0.05 but Holm p > 0.05: its verdict never says lower/higher."""
    p = build_fixture_db(tmp_path / "r.db", judge=False, evals=False, failed_run=False, running_run=False)
    conn = sqlite3.connect(p)
    # seeds share a data stream: frailt and relaxed differ by a small, consistent gap (raw p = 0.026) over a large
    # seed-to-seed spread; no other pair differs, so Holm multiplies that p by 6
    gaps = {
        "frailt": (0.0, 0.0, 0.0),
        "relaxed": (0.010, 0.018, 0.014),
        "control": (0.05, -0.03, 0.01),
        "three-part": (-0.02, 0.04, 0.03),
    }
    for arch, gap in gaps.items():
        for seed, base in enumerate((1.30, 1.40, 1.50)):
            conn.execute(
                "update runs set final_val_loss = ? where arch = ? and seed = ? and status = 'done'",
                (base + gap[seed], arch, seed),
            )
    conn.commit()
    conn.close()
    cmp = section(report_engine.build(p).markdown, "Comparisons")
    row = next(r for r in tables(cmp)[0] if (r["a"], r["b"]) == ("frailt", "relaxed"))
    assert float(row["p"]) < 0.05 < float(row["p (Holm, per quantity)"])
    v = next(ln for ln in cmp.splitlines() if ln.startswith("- frailt's and relaxed's final validation loss"))
    assert "not distinguishable once adjusted for multiple comparisons" in v
    assert "lower" not in v and "higher" not in v
    assert "Holm-adjusted" in v and "over the 6 pairwise comparisons of final validation loss" in v


def test_judge_reliability_repeats_failures_and_trust(full):
    db, sec = full["db"], section(full["md"], "Judge reliability")
    rep = {r["criterion"]: r for r in tables(sec.split("### Agreement between repeats")[1])[0]}
    for c in ("grammar", "average"):
        units = {}
        for sid, v in q(db, f"select sample_id, {c} from judge_grades where status = 'ok' order by sample_id, repeat"):
            units.setdefault(sid, []).append(v)
        alpha = bstats.krippendorff_alpha(list(units.values()))
        assert rep[c]["alpha [95% CI]"].startswith(fnum(alpha, 2) + " [")
        assert rep[c]["samples"] == str(sum(len(v) >= 2 for v in units.values()))
    counts = {
        a: (f, t)
        for a, f, t in q(
            db,
            """
        select r.arch, sum(g.status != 'ok'), count(*) from judge_grades g join samples s on s.id = g.sample_id
        join runs r on r.id = s.run_id where r.status = 'done' group by r.arch""",
        )
    }
    table = [[f, t - f] for f, t in (counts[a] for a in STUDY_ARCHS)]
    p = sps.chi2_contingency(table).pvalue
    assert f"chi-square test that the rates are equal: {bstats.fmt_p(p)}." in sec
    assert f"control {counts['control'][0]}/{counts['control'][1]}" in sec
    trust = sec.split("### How far to trust the judge")[1]
    assert "Repeated grades of the same sample agree with alpha = " in trust and "No second judge" in trust
    assert "Length bias is not measured" in trust  # the fixture's completions all have 40 tokens


def test_judge_reliability_length_bias_and_a_second_protocol(tmp_path):
    p = build_fixture_db(
        tmp_path / "r.db",
        archs=("control", "three-part"),
        seeds=(0, 1),
        evals=False,
        failed_run=False,
        running_run=False,
    )
    conn = sqlite3.connect(p)
    conn.execute("update samples set n_tokens = 20 + (abs(random()) % 80)")
    # the same samples graded under the assess protocol (its own prompt version): a second set, never pooled
    conn.execute("""insert into judge_grades (sample_id, judge_model, prompt_hash, repeat, status, grammar, creativity,
                    consistency, plot, average, protocol, assessment)
                    select sample_id, judge_model, 'assesshash01', repeat, status, grammar, creativity,
                    consistency, min(10, plot + 1), (grammar + creativity + consistency + min(10, plot + 1)) / 4.0,
                    'assess', 'A short assessment.' from judge_grades where status = 'ok' and sample_id in
                    (select id from samples where prompt_id in ('pset01:0', 'pset01:1', 'pset01:2'))""")
    conn.commit()
    conn.close()
    md = report_engine.build(p).markdown
    sec = section(md, "Judge reliability")
    rows = by_model(tables(sec.split("### Length bias")[1])[0])
    for arch in ("control", "three-part"):
        x = q(
            p,
            """select s.n_tokens, avg(g.average) from judge_grades g join samples s on s.id = g.sample_id
                    join runs r on r.id = s.run_id where r.arch = ? and g.status = 'ok' and g.judge_model = ?
                    and g.prompt_hash = ? group by s.id order by s.id""",
            (arch, JUDGE_MODEL, PROMPT_HASH),
        )
        rho = sps.spearmanr([v[0] for v in x], [v[1] for v in x]).statistic
        assert rows[arch]["Spearman rho"] == fnum(rho, 2) and rows[arch]["samples"] == str(len(x))
    assert re.search(r"after adjusting for length: .* \((changed|unchanged)\)", sec)
    cross = tables(sec.split("### Agreement with other judges and protocols")[1])[0]
    assert len(cross) == 1 and cross[0]["other grade set"] == f"{JUDGE_MODEL} / assess / assesshash01"
    assert 0 < float(cross[0]["mean shift (average)"]) <= 0.25  # plot + 1, capped at 10, over four criteria
    judge = section(md, "Judge")
    assert "· assess · prompt assesshash01" in judge and "· json · prompt" in judge
    cmp = section(md, "Comparisons")
    assert f"judge `{JUDGE_MODEL}`, protocol `json`" in cmp and "not mixed with: " in cmp and "`assess`" in cmp


def test_lm_eval_table(full):
    db, sec = full["db"], section(full["md"], "lm-eval")
    rows = by_model(tables(sec)[0])
    for arch in STUDY_ARCHS:
        vals = [
            r[0]
            for r in q(
                db,
                "select e.value from eval_results e join runs r on r.id = e.run_id where "
                "r.status = 'done' and r.arch = ? and e.task = 'tinystories_ending' and "
                "e.metric = 'acc'",
                (arch,),
            )
        ]
        assert rows[arch]["tinystories_ending acc"] == f"{np.mean(vals):.4f} ± 0.0200 ✓"  # ✓: above chance
        assert rows[arch]["seeds"] == "3"
        assert " ± " not in rows[arch]["tinystories_ppl bits_per_byte"]  # NULL stderr is shown as nothing
    assert rows["three-part"]["n_recur"] == "7"


def test_benchmark_and_provenance(full):
    md = full["md"]
    bench = tables(section(md, "Benchmark"))[0]
    assert [(r["arch"], r["impl"]) for r in bench][:2] == [("control", "benchctl"), ("control", "reference")]
    assert "1.50× the eager reference" in section(md, "Benchmark")
    # cost ratio and ceiling, recomputed from the bench rows themselves
    db = sqlite3.connect(full["db"])
    by = {
        (a, i): (t, f, s, k)
        for a, i, t, f, s, k in db.execute(
            "select arch, impl, tokens_per_s, flops_per_token, step_seconds, kernel_seconds from bench"
        )
    }
    c_tps, c_flops, _, c_kernel = by[("control", "benchctl")]
    for r in bench:
        if r["impl"] == "reference":
            assert r["cost ratio"] == "-"
            continue
        tps, flops, _, _ = by[(r["arch"], "benchctl")]
        assert r["cost ratio"] == f"{(c_tps / tps) / (flops / c_flops):.2f}"
    assert bench[0]["cost ratio"] == "1.00"
    ceiling = by[("control", "reference")][2] / c_kernel
    assert f"at most {ceiling:.2f}× the reference" in section(md, "Benchmark")
    prov = {r["what"]: r["value"] for r in tables(section(md, "Provenance"))[0]}
    assert prov["git commit"] == "abc1234 (14 runs)"
    assert prov["data fingerprint"].startswith("fp0123456789abcdef")
    assert prov["first run created"] == "2025-06-02T00:00:00+00:00"


def _expected_figures() -> list[str]:
    """Every figure a report can hold, but the retrofit one, drawn only when retrofitted runs exist (the fixture has
    none; tests/test_retrofit_cli.py covers it), loss against training depth, which needs models of one
    architecture that differ only in depth (tests/test_plans.py covers it), and the adaptive architectures' metrics,
    which need runs that report them (tests/test_adaptive.py covers it), the IsoFLOP curves, which need an IsoFLOP
    plan's runs (tests/test_isoflop.py covers it), and accuracy against depth, which needs reasoning-task runs
    (tests/test_task_runs.py covers it)."""
    absent = (
        "retrofit_loss_flops.png",
        "loss_vs_depth.png",
        "adaptive_metrics.png",
        "isoflop.png",
        "task_accuracy_depth.png",
    )
    return [n for n in report_engine.figure_names() if n not in absent]


def test_figures_are_valid_pngs(full):
    import matplotlib.image as mpimg

    figdir = full["out"].parent / "figures"
    names = sorted(p.name for p in figdir.glob("*.png"))
    assert names == sorted(_expected_figures())
    for name in names:
        data = (figdir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 20_000, name
        img = mpimg.imread(figdir / name)
        h, w = img.shape[:2]
        assert 600 <= w <= 2400 and 450 <= h <= 1400, (name, w, h)
        assert img[..., :3].std() > 0.05  # not a blank canvas
        assert f"](figures/{name})" in full["md"]


@pytest.fixture(scope="module")
def cli_written(full):
    """`benchctl report` run once on the fixture's database, into a folder of its own: a second rendering of the same
    database, which the tests below compare with the first and start from (a whole report with its figures is slow
    to draw, so it is drawn once)."""
    out = full["dir"] / "cli"
    res = CliRunner().invoke(app, ["report", "--db", str(full["db"]), "--out", str(out)])
    return {"res": res, "dir": out}


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_same_database_same_bytes(full, cli_written):
    again = cli_written["dir"]
    assert (again / "report.md").read_bytes() == full["out"].read_bytes()
    for name in _expected_figures():
        assert (again / "figures" / name).read_bytes() == (full["out"].parent / "figures" / name).read_bytes()


# ---------------------------------------------------------------------------------------------------------------------
# robustness


def _one_line_sections(md: str, names) -> None:
    for name in names:
        body = [ln for ln in section(md, name).splitlines() if ln.strip()]
        assert len(body) == 1, (name, body)
        assert "`benchctl " in body[0], (name, body)


@pytest.mark.registry  # the report renders every registered stage's sections
def test_empty_database(tmp_path):
    p = tmp_path / "empty.db"
    stages.connect(p).conn.close()
    out = report_engine.write_report(p, tmp_path / "r")
    md = out.read_text()
    assert md.startswith("# benchctl report\n")
    assert "no runs yet" in md
    _one_line_sections(
        md, ["Runs", "Training cost", "Loss", "Judge", "lm-eval", "Comparisons", "Benchmark", "Provenance"]
    )
    assert "No runs for this preset" in section(md, "Models")
    assert not list((tmp_path / "r" / "figures").glob("*.png"))


@pytest.mark.registry  # the report renders every registered stage's sections
def test_database_without_tables(tmp_path):
    p = tmp_path / "bare.db"
    sqlite3.connect(p).execute("vacuum").connection.close()  # an SQLite file with nothing in it yet
    md = report_engine.write_report(p, tmp_path / "r").read_text()
    assert "no runs yet" in md
    sqlite3.connect(p).execute("create table unrelated (x)").connection.close()  # now another program's
    with pytest.raises(ForeignDatabaseError):
        report_engine.write_report(p, tmp_path / "r")


@pytest.mark.registry  # the report renders every registered stage's sections
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_partial_database_runs_only(tmp_path):
    p = build_fixture_db(tmp_path / "r.db", judge=False, evals=False, seeds=(0, 1))
    md = report_engine.write_report(p, tmp_path / "r").read_text()
    _one_line_sections(md, ["Judge", "lm-eval", "Benchmark"])
    assert "`benchctl judge" in section(md, "Judge") and "`benchctl eval`" in section(md, "lm-eval")
    cmp = section(md, "Comparisons")
    assert "final validation loss" in cmp and "judge average" not in tables(cmp)[0][0].values()
    assert "Judge comparisons need grades" in cmp
    names = sorted(x.name for x in (tmp_path / "r" / "figures").glob("*.png"))
    # the four models differ in parameters and FLOPs per token, so loss against compute and parameters is drawn
    assert names == [
        "final_val_loss.png",
        "loss_vs_compute.png",
        "loss_vs_params.png",
        "peak_memory.png",
        "training_time.png",
        "val_loss_curves.png",
    ]


@pytest.mark.registry  # the report renders every registered stage's sections
def test_no_finished_runs(tmp_path):
    p = tmp_path / "r.db"
    db = stages.connect(p)
    from benchctl.core.config import make_config

    for arch, status in (("control", "running"), ("frailt", "failed")):
        cfg = make_config("tiny", arch, 0)
        db["runs"].insert(
            {
                "id": f"{arch}-x",
                "arch": arch,
                "preset": "tiny",
                "seed": 0,
                "status": status,
                "config_json": cfg.to_json(),
                "error": "killed" if status == "failed" else None,
            }
        )
    db.conn.commit()
    db.conn.close()
    md = report_engine.write_report(p, tmp_path / "r").read_text()
    assert "Runs of preset `tiny`: 1 running, 1 failed." in md
    _one_line_sections(md, ["Training cost", "Loss", "Judge", "lm-eval", "Comparisons"])
    assert "| frailt-x | frailt | 0 | failed |" in section(md, "Runs")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_single_seed(tmp_path):
    p = build_fixture_db(tmp_path / "r.db", seeds=(0,), failed_run=False, running_run=False)
    md = report_engine.write_report(p, tmp_path / "r").read_text()
    loss = by_model(tables(section(md, "Loss"))[0])
    for arch in STUDY_ARCHS:
        assert loss[arch]["seeds"] == "1"
        assert list(loss[arch].values()).count("no CI (1 seed)") == 2
        assert loss[arch]["final val loss"] == fnum(done_values(p, "final_val_loss", arch)[0])
    assert "A model with one seed has no confidence interval" in section(md, "Loss")
    cmp = section(md, "Comparisons")
    loss_verdicts = [ln for ln in cmp.splitlines() if ln.startswith("- ") and "validation loss" in ln]
    assert len(loss_verdicts) == 6
    assert all(v.endswith("cannot be tested: one seed per model.") for v in loss_verdicts)
    assert all(r["p"] == "-" and r["95% CI"] == "-" for r in tables(cmp)[0] if r["quantity"] != "judge average")
    # the judge comparison still pairs prompts: 12 prompts x 1 seed, a verdict about the trained models only
    assert any(r["n (a, b)"] == "12 shared" and r["test"] == "paired t over prompts (one seed)" for r in tables(cmp)[0])
    assert "about these two trained models only" in cmp


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_preset_choice_and_other_presets(tmp_path):
    p = build_fixture_db(tmp_path / "r.db", seeds=(0, 1), judge=False, evals=False, failed_run=False, running_run=False)
    build_fixture_db(
        p,
        preset="small",
        archs=("control", "frailt"),
        seeds=(0,),
        judge=False,
        evals=False,
        failed_run=False,
        running_run=False,
        curves=False,
    )
    md = report_engine.build(p).markdown
    assert md.startswith("# benchctl report: preset `tiny`")
    assert "Other presets in the database: `small` (2 done of 2)" in md
    small = report_engine.build(p, "small")
    assert small.preset == "small" and small.other_presets == [("tiny", 8, 8)]
    assert list(by_model(tables(section(small.markdown, "Loss"))[0])) == ["control", "frailt"]
    with pytest.raises(ConfigError, match="did you mean 'tiny'"):
        report_engine.build(p, "tiyn")
    # a known preset without runs is a valid report that says so
    assert "No runs for this preset" in section(report_engine.build(p, "paper").markdown, "Runs")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_config_variants_are_separate_models(tmp_path):
    p = build_fixture_db(
        tmp_path / "r.db",
        archs=("control", "three-part"),
        seeds=(0, 1, 2),
        judge=False,
        evals=False,
        failed_run=False,
        running_run=False,
    )
    build_fixture_db(
        p,
        archs=("control",),
        seeds=(0, 1),
        overrides={"train.max_steps": 20},
        judge=False,
        evals=False,
        failed_run=False,
        running_run=False,
    )
    rendered = report_engine.build(p)
    loss = by_model(tables(section(rendered.markdown, "Loss"))[0])
    assert list(loss) == ["control", "control [train.max_steps=20]", "three-part"]
    assert loss["control"]["seeds"] == "3" and loss["control [train.max_steps=20]"]["seeds"] == "2"
    assert loss["control [train.max_steps=20]"]["tokens/run"] == "10.2 k"
    assert "- control [train.max_steps=20]: `train.max_steps=20`" in section(rendered.markdown, "Runs")
    assert (
        len(set(report.build_context(report.load(sqlite3.connect(p), stages.tables()).runs, None).colours.values()))
        == 3
    )


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_paper_preset_shows_the_study_beside_ours(tmp_path):
    p = build_fixture_db(
        tmp_path / "r.db",
        preset="paper",
        seeds=(0, 1),
        judge=False,
        evals=False,
        failed_run=False,
        running_run=False,
        device="cuda",
    )
    md = report_engine.build(p).markdown
    models = by_model(tables(section(md, "Models"))[0])
    for arch, total in paper.TOTAL_PARAMS.items():
        assert models[arch]["study total"] == f"{total:,}" and models[arch]["match"] == "yes"
    loss = by_model(tables(section(md, "Loss"))[0])
    for arch in STUDY_ARCHS:
        assert loss[arch]["study initial"] == f"{paper.INITIAL_LOSS[arch]:.3f}"
        assert loss[arch]["study final"].startswith(f"{paper.FINAL_LOSS[arch]:.3f}")
    assert loss["control"]["study final"] == "1.429 (Table 5: 1.492)"
    assert loss["control"]["tokens/run"] == "204.80 M"
    cost = by_model(tables(section(md, "Training cost"))[0])
    gpu = np.mean(done_values(p, "peak_gpu_mem_bytes", "relaxed", "paper")) / 2**30
    assert cost["relaxed"]["peak GPU memory (torch allocated) (GiB)"] == fnum(gpu, 2)
    assert "NVIDIA GeForce RTX 3070 Laptop GPU (cuda)" in section(md, "Training cost")


# ---------------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_report(full, cli_written):
    res, out = cli_written["res"], cli_written["dir"]
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "report.md" in res.output and "preset: tiny" in res.output
    assert (out / "report.md").read_bytes() == full["out"].read_bytes()
    assert len(list((out / "figures").glob("*.png"))) == len(_expected_figures())


def test_cli_stale_figures_are_removed(cli_written, tmp_path):
    import shutil

    assert cli_written["res"].exit_code == 0
    out = tmp_path / "rep"  # a copy of the command's folder, figures and all: the module's stays as it was
    shutil.copytree(cli_written["dir"], out)
    assert list((out / "figures").glob("*.png"))
    empty = tmp_path / "empty.db"
    stages.connect(empty).conn.close()
    assert CliRunner().invoke(app, ["report", "--db", str(empty), "--out", str(out)]).exit_code == 0
    assert not list((out / "figures").glob("*.png"))


def test_cli_missing_database(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope.db"
    res = CliRunner().invoke(app, ["report", "--db", str(missing), "--out", str(tmp_path / "r")])
    assert isinstance(res.exception, DatabaseError) and str(missing) in str(res.exception)
    assert not missing.exists()  # reading never creates a database
    monkeypatch.setenv("BENCHCTL_DB", str(missing))
    with pytest.raises(SystemExit) as e:
        main(["report", "--out", str(tmp_path / "r")])
    assert e.value.code == DatabaseError.exit_code
    err = capsys.readouterr().err
    assert "no results database" in err and "Traceback" not in err


def test_cli_bad_format_and_corrupt_file(tmp_path):
    res = CliRunner().invoke(app, ["report", "--format", "html", "--db", str(tmp_path / "x.db")])
    assert isinstance(res.exception, ConfigError)
    bad = tmp_path / "bad.db"
    bad.write_text("this is not sqlite " * 100)
    with pytest.raises(DatabaseError, match="not a readable SQLite database"):
        report_engine.write_report(bad, tmp_path / "r")


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_two_judges_are_reported_apart(tmp_path):
    p = build_fixture_db(
        tmp_path / "r.db",
        archs=("control", "three-part"),
        seeds=(0, 1),
        evals=False,
        failed_run=False,
        running_run=False,
    )
    conn = sqlite3.connect(p)
    # a second judge grades only the first four samples of each run: fewer grades, so not the primary
    rows = conn.execute(
        "select sample_id, grammar, creativity, consistency, plot from judge_grades "
        "where status = 'ok' and sample_id in (select id from samples where prompt_id in "
        "('pset01:0', 'pset01:1', 'pset01:2', 'pset01:3'))"
    ).fetchall()
    conn.executemany(
        "insert into judge_grades (sample_id, judge_model, prompt_hash, repeat, status, grammar, "
        "creativity, consistency, plot, average) values (?, 'other-judge', ?, 0, 'ok', 9, 9, 9, 9, 9)",
        [(r[0], PROMPT_HASH) for r in rows],
    )
    conn.commit()
    conn.close()
    md = report_engine.build(p).markdown
    judge = section(md, "Judge")
    assert judge.index(f"### {JUDGE_MODEL}") < judge.index("### other-judge")
    assert "(primary: used in Comparisons)" in judge
    other = by_model(tables(judge.split("### other-judge")[1])[0])
    n_control = q(
        p,
        "select count(distinct g.sample_id) from judge_grades g join samples s on s.id = g.sample_id "
        "join runs r on r.id = s.run_id where g.judge_model = 'other-judge' and r.arch = 'control'",
    )[0][0]
    assert other["control"]["average"] == "9.00 ± 0.00" and other["control"]["graded"] == str(n_control)
    assert 0 < n_control < 8
    cmp = [r for r in tables(section(md, "Comparisons"))[0] if r["quantity"] == "judge average"]
    assert len(cmp) == 1 and cmp[0]["n (a, b)"] == "2 shared (12 prompts)"  # the primary judge: 2 seeds, 12 prompts


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_pair_of_judges_agreement_and_where_their_rankings_differ(tmp_path):
    """A second judge (an OpenAI-compatible server, named fully) that reverses the grades: alpha and Kendall's tau
    per pair against independent computations, a ranking table that says the judges disagree, and the Comparisons
    section saying the verdict on the models' order holds for the primary judge only."""
    archs = ("control", "frailt", "three-part")
    p = build_fixture_db(tmp_path / "r.db", archs=archs, seeds=(0, 1), evals=False, failed_run=False, running_run=False)
    other = "openai:qwen3-8b@127.0.0.1:8000/v1"
    conn = sqlite3.connect(p)
    host = "generativelanguage.googleapis.com"
    conn.execute("update judge_grades set backend = 'gemini', model = judge_model, endpoint = ?", (host,))
    conn.execute(
        """insert into judge_grades (sample_id, judge_model, prompt_hash, repeat, status, grammar, creativity,
           consistency, plot, average, backend, model, endpoint, model_revision)
           select sample_id, ?, prompt_hash, repeat, status, 11 - grammar, 11 - creativity, 11 - consistency,
           11 - plot, 11 - average, 'openai', 'qwen3-8b', '127.0.0.1:8000/v1', 'fp_local1'
           from judge_grades where status = 'ok' and sample_id in
           (select id from samples where prompt_id not in ('pset01:0', 'pset01:1'))""",
        (other,),
    )
    conn.commit()
    conn.close()
    md = report_engine.build(p).markdown
    judge = section(md, "Judge")
    assert "backend `openai`, model `qwen3-8b`, endpoint `127.0.0.1:8000/v1`, system_fingerprint `fp_local1`" in judge
    assert f"backend `gemini`, model `gemini-2.5-flash`, endpoint `{host}`, modelVersion not reported" in judge
    rel = section(md, "Judge reliability")
    part = rel.split("### Agreement and ranking between every pair of judges")[1].split("### ")[0]
    pairs, ranking = tables(part)
    assert len(pairs) == 1 and pairs[0]["judge a"].startswith(f"{JUDGE_MODEL} / json") and other in pairs[0]["judge b"]

    def per_sample(judge_model):
        rows = q(
            p,
            """select g.sample_id, r.arch, avg(g.average) from judge_grades g join samples s on s.id = g.sample_id
               join runs r on r.id = s.run_id where g.judge_model = ? and g.status = 'ok' group by g.sample_id""",
            (judge_model,),
        )
        return {sid: (arch, v) for sid, arch, v in rows}

    a, b = per_sample(JUDGE_MODEL), per_sample(other)
    shared = sorted(set(a) & set(b))
    alpha = bstats.krippendorff_alpha([[a[s][1], b[s][1]] for s in shared])
    means = {arch: tuple(np.mean([g[s][1] for s in shared if a[s][0] == arch]) for g in (a, b)) for arch in archs}
    tau = sps.kendalltau([means[m][0] for m in archs], [means[m][1] for m in archs]).statistic
    assert pairs[0]["shared samples"] == str(len(shared)) and pairs[0]["alpha (average)"].startswith(fnum(alpha, 2))
    assert pairs[0]["Kendall tau"] == fnum(tau, 2) == "-1.00" and pairs[0]["models"] == "3"
    rank_a = sps.rankdata([-means[m][0] for m in archs], method="min")
    rank_b = sps.rankdata([-means[m][1] for m in archs], method="min")
    differ = [m for m, x, y in zip(archs, rank_a, rank_b) if x != y]
    assert len(differ) == 2  # reversed: the ends swap, the middle keeps its rank
    rows = by_model(ranking)
    for m, x, y in zip(archs, rank_a, rank_b):
        assert rows[m][f"{JUDGE_MODEL} / json"] == f"{int(x)} ({fnum(means[m][0], 2)})"
        assert rows[m][f"{other} / json"] == f"{int(y)} ({fnum(means[m][1], 2)})"
        assert rows[m]["judges agree"] == ("no" if m in differ else "yes")
    assert f"on the {len(shared)} samples all of them graded. The judges disagree about the rank of " in rel
    trust = rel.split("### How far to trust the judge")[1]
    assert f"the models' ranking changes with the judge for {', '.join(sorted(differ))}." in trust
    cmp = section(md, "Comparisons")
    assert "The judges disagree about the rank of " in cmp and "holds for the primary judge only" in cmp
    for m in differ:
        assert f"{m}: " in cmp.split("The judges disagree about the rank of ")[1]


def test_point_labels_never_cover_each_other_or_the_axes_text():
    """Thirty labels on a tight cluster (ten of them on one spot) and a legend: every label finds a free spot."""
    from figcheck import labels, outside_figure, overlapping_labels

    from benchctl.report.figures import _figure, label_points

    fig = _figure(6.0, 4.0)
    ax = fig.subplots()
    xs = [0.5] * 10 + [0.5 + 0.01 * i for i in range(20)]
    ys = [0.5] * 10 + [0.5 + 0.005 * (i % 5) for i in range(20)]
    ax.plot(xs, ys, "o", label="points")
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("x label")
    ax.legend()
    texts = [f"setting number {i}" for i in range(30)]
    label_points(fig, [(ax, list(zip(xs, ys, texts)))])
    assert labels(fig) == texts
    assert not overlapping_labels(fig) and not outside_figure(fig)


def _small_figures(n: int) -> dict:
    from matplotlib.figure import Figure

    figs = {}
    for i in range(n):
        fig = Figure(figsize=(3, 2), dpi=50, layout="constrained")
        ax = fig.add_subplot()
        ax.plot(range(5), [i * x for x in range(5)])
        ax.set_title(f"figure {i}")
        figs[f"f{i}.png"] = fig
    return figs


def test_figures_saved_on_several_cores_are_the_bytes_of_saving_them_one_by_one(tmp_path):
    from benchctl.report.figures import save_figure, save_figures

    figs = _small_figures(5)
    (tmp_path / "serial").mkdir()
    (tmp_path / "forked").mkdir()
    for name, fig in figs.items():
        save_figure(fig, tmp_path / "serial" / name)
    save_figures(figs, tmp_path / "forked", workers=3)
    assert sorted(p.name for p in (tmp_path / "forked").iterdir()) == sorted(figs)
    for name in figs:
        assert (tmp_path / "forked" / name).read_bytes() == (tmp_path / "serial" / name).read_bytes()


def test_a_figure_that_fails_in_a_forked_writer_raises_its_own_error_here(tmp_path):
    from benchctl.report.figures import save_figures

    class Broken:
        def savefig(self, *args, **kwargs):
            raise ValueError("this figure cannot be drawn")

    figs = _small_figures(3)
    figs["f1.png"] = Broken()  # sorted f0, f1, f2: with two writers f1 is the forked child's
    with pytest.raises(ValueError, match="cannot be drawn"):
        save_figures(figs, tmp_path, workers=2)
    assert (tmp_path / "f0.png").exists() and (tmp_path / "f2.png").exists()


def test_a_forked_writer_that_hangs_is_stopped_and_its_figures_written_here(tmp_path):
    import os

    from benchctl.report import figures

    parent = os.getpid()

    class Hangs:
        def savefig(self, path, **kwargs):
            if os.getpid() != parent:  # only in the child: the deadlock a fork can inherit
                while True:
                    time.sleep(1)
            Path(path).write_bytes(b"written by the parent")

    figs = _small_figures(3)
    figs["f1.png"] = Hangs()
    figures.save_figures(figs, tmp_path, workers=2, patience=1.0)
    assert (tmp_path / "f1.png").read_bytes() == b"written by the parent"
