"""The report's lm-eval section against chance: every accuracy cell marked above chance or not, from an exact
one-sided binomial test of the pooled correct answers (recomputed here with scipy from the database rows), Holm across
the table's cells; a task on which no model beats chance gets the sentence saying it cannot separate the models."""

from __future__ import annotations

import sqlite3

import pytest
from fixtures_db import STUDY_ARCHS, build_fixture_db
from scipy import stats as sps
from test_report import by_model, section, tables

from benchctl.core import stats as bstats
from benchctl.stages.eval import chance as chance_mod
from benchctl.stages.report import engine as report


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    path = build_fixture_db(tmp_path_factory.mktemp("ladder") / "results.db", judge=False, ladder=True)
    return {"db": path, "md": report.build(path).markdown}


def pooled(db, arch: str, task: str, metric: str) -> tuple[int, int]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "select e.value, e.n_samples from eval_results e join runs r on r.id = e.run_id where r.status = 'done' "
            "and r.arch = ? and e.task = ? and e.metric = ?",
            (arch, task, metric),
        ).fetchall()
    finally:
        conn.close()
    return sum(round(v * n) for v, n in rows), sum(n for _, n in rows)


def test_chance_levels_are_stated_by_the_templates():
    assert chance_mod.chance_levels() == {
        "tinystories_ending": 0.25,
        "tinystories_names": 0.25,
        "tinystories_order": 0.5,
    }
    assert [chance_mod.fraction(c) for c in (0.25, 0.5, 0.1234)] == ["1/4", "1/2", "0.1234"]


def test_binom_above_chance_is_scipys_one_sided_exact_test():
    assert bstats.binom_above_chance(140, 200, 0.5) == pytest.approx(
        sps.binomtest(140, 200, 0.5, alternative="greater").pvalue
    )
    assert bstats.binom_above_chance(50, 200, 0.25) == pytest.approx(
        sum(sps.binom.pmf(k, 200, 0.25) for k in range(50, 201))
    )
    assert bstats.binom_above_chance(0, 0, 0.5) is None and bstats.binom_above_chance(3, 4, 1.0) is None
    with pytest.raises(ValueError):
        bstats.binom_above_chance(5, 4, 0.5)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_cells_are_marked_from_an_independent_binomial_test(ladder):
    db, sec = ladder["db"], section(ladder["md"], "lm-eval")
    main, against = tables(sec)
    cells = [
        (arch, task, metric)
        for arch in STUDY_ARCHS
        for task, metric in (
            ("tinystories_ending", "acc"),
            ("tinystories_ending", "acc_norm"),
            ("tinystories_names", "acc"),
            ("tinystories_names", "acc_norm"),
            ("tinystories_order", "acc"),
        )
    ]
    counts = {c: pooled(db, *c) for c in cells}
    raw = [
        sps.binomtest(k, n, 0.5 if c[1] == "tinystories_order" else 0.25, alternative="greater").pvalue
        for c, (k, n) in counts.items()
    ]
    # Holm by hand: sort, multiply by the number left, running maximum
    order = sorted(range(len(raw)), key=lambda i: raw[i])
    adj, running = [0.0] * len(raw), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(raw) - rank) * raw[i]))
        adj[i] = running
    rows, detail = by_model(main), by_model(against)
    for (arch, task, metric), p, (k, n) in zip(cells, adj, counts.values()):
        cell = rows[arch][f"{task} {metric}"]
        assert cell.endswith(" ✓") == (p < 0.05) and cell.endswith(" (chance)") == (p >= 0.05), (cell, p)
        assert detail[arch][f"{task} {metric}"].startswith(f"{k}/{n}, p ")
    # the fixture's design: ending and order above chance for everyone, names at chance for everyone
    assert all(rows[a]["tinystories_order acc"].endswith("✓") for a in STUDY_ARCHS)
    assert all(rows[a]["tinystories_names acc"].endswith("(chance)") for a in STUDY_ARCHS)
    assert all(
        " ✓" not in rows[a]["tinystories_ppl bits_per_byte"]
        and "chance" not in rows[a]["tinystories_ppl bits_per_byte"]
        for a in STUDY_ARCHS
    )  # no chance level, no mark
    assert "tinystories_ppl bits_per_byte" not in detail["control"]


def test_a_task_at_chance_gets_the_sentence_instead_of_a_comparison(ladder):
    sec = section(ladder["md"], "lm-eval")
    lines = {line.split("**")[1]: line for line in sec.splitlines() if line.startswith("- **")}
    assert set(lines) == {"tinystories_ending", "tinystories_names", "tinystories_order"}
    assert "cannot separate the models" in lines["tinystories_names"]
    assert "chance 1/4" in lines["tinystories_names"] and "`tiny` preset" in lines["tinystories_names"]
    for task in ("tinystories_ending", "tinystories_order"):
        assert "cannot separate" not in lines[task]
        assert lines[task].endswith(f"above chance for {', '.join(STUDY_ARCHS)}.")
    assert "Holm-adjusted over the 20 tested accuracy cells of the table" in sec
    assert "Holm-adjusted p over the 20 tested accuracy cells of the table):" in sec


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_some_models_above_chance_and_untested_cells(tmp_path):
    """A task where one model is above chance names it and the others; a run without a document count leaves its
    cell untested (no mark, no claim), and with no accuracy tasks there are no marks at all."""
    path = build_fixture_db(
        tmp_path / "r.db",
        archs=("control", "frailt"),
        seeds=(0,),
        judge=False,
        ladder=True,
        failed_run=False,
        running_run=False,
    )
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "update eval_results set value = 0.5 where task = 'tinystories_order' and run_id in "
            "(select id from runs where arch = 'frailt')"
        )
        conn.execute(
            "update eval_results set n_samples = null where task = 'tinystories_ending' and metric = 'acc_norm'"
        )
    conn.close()
    sec = section(report.build(path).markdown, "lm-eval")
    line = next(x for x in sec.splitlines() if x.startswith("- **tinystories_order**"))
    assert line.endswith("above chance for control; not for frailt.")
    main, against = tables(sec)
    rows = by_model(main)
    assert rows["frailt"]["tinystories_order acc"].startswith("0.5000 ± ")
    assert rows["frailt"]["tinystories_order acc"].endswith(" (chance)")
    assert not rows["control"]["tinystories_ending acc_norm"].endswith((" ✓", "(chance)"))
    assert by_model(against)["control"]["tinystories_ending acc_norm"] == "not tested"
    # the family the adjustment is over counts the tested cells only: 5 cells per model, one per model untested
    assert "Holm-adjusted over the 8 tested accuracy cells of the table" in sec

    plain = build_fixture_db(
        tmp_path / "plain.db", archs=("control",), seeds=(0,), judge=False, failed_run=False, running_run=False
    )
    conn = sqlite3.connect(plain)
    with conn:
        conn.execute("delete from eval_results where metric like 'acc%'")
    conn.close()
    sec = section(report.build(plain).markdown, "lm-eval")
    assert len(tables(sec)) == 1 and "chance" not in sec
