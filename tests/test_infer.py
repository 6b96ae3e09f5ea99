"""`benchctl infer` (benchctl/stages/infer): its options (one-line errors naming the flag), the settings each
architecture gets, the stage end to end on tiny trained runs (rows for every setting, the control's reference row,
agreement against full depth, the latent view; a rerun measures nothing), its browse query, and the report section
"Inference cost" from a fixture database."""

from __future__ import annotations

import json

import pytest
from fixtures_db import build_fixture_db

from benchctl.core.errors import ConfigError
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
    ],
)
def test_bad_options_name_their_flag(bad, says):
    with pytest.raises(ConfigError) as e:
        InferOptions(**bad)
    assert says in str(e.value)


# ---- browse and report -----------------------------------------------------------------------------------------------


def test_browse_query_follows_the_files_columns():
    assert browse_queries({"runs": ["id"]}) == {}
    q = browse_queries({"runs": ["id", "variant"], "inference_results": ["run_id", "setting", "tokens_json"]})
    sql = q["inference_results"]["sql"]
    assert "coalesce(r.variant, r.arch) as model" in sql and "i.setting" in sql and "tokens_json" not in sql


def _section(md: str, title: str) -> str:
    sec = md[md.index(f"\n## {title}\n") :]
    return sec[: sec.index("\n## ", 5)] if "\n## " in sec[5:] else sec


def test_report_section_renders_on_a_fixture(tmp_path):
    path = build_fixture_db(tmp_path / "results.db", seeds=(0, 1), judge=False, evals=False, infer=True)
    built = report.build(path)
    sec = _section(built.markdown, "Inference cost")
    for fig in ("infer_frontier.png", "infer_convergence.png", "infer_trajectories.png"):
        assert f"(figures/{fig})" in sec and fig in built.figures
    assert "**control** (reference)" in sec and "| full depth | 2 |" in sec
    assert "- frailt: `exit kl<0.001 kv last` is cheaper than full depth" in sec
    assert "no worse = the upper end of the loss change's 95% CI over 2 seeds below 0.01 nats" in sec
    assert "- relaxed: no cheaper setting is shown to be no worse than full depth" in sec
    assert "- three-part: no setting spends fewer FLOPs per generated token or holds fewer KV bytes" in sec
    assert "- control" not in sec  # the reference gets no sentence
    one = report.build(build_fixture_db(tmp_path / "one.db", seeds=(0,), judge=False, evals=False, infer=True))
    assert "one seed, so about that trained model only" in _section(one.markdown, "Inference cost")
    empty = report.build(build_fixture_db(tmp_path / "none.db", seeds=(0,), judge=False, evals=False)).markdown
    assert "No inference rows" in _section(empty, "Inference cost")
    assert json  # noqa: B018 (json is used by the end-to-end tests below)
