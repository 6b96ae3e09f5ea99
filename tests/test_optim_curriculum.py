"""Muon beside AdamW (benchctl/optim.py) and the depth curriculum (benchctl/curriculum.py), in training and resumed."""

from __future__ import annotations

import math
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from test_train import _final_state, cli_proc

import architectures
from benchctl.core.config import make_config
from benchctl.stages.train import curriculum
from benchctl.stages.train.optim import MuonAdamW, hidden_matrices, make_optimizer


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    cfg = make_config("tiny", "frailt", overrides={"train.optimizer": "muon"})
    torch.manual_seed(0)
    model = architectures.build("frailt", cfg.model)
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adam = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert not muon & adam and muon | adam == {id(p) for p in model.parameters()}
    assert id(model.output.weight) in adam and id(model.iter_emb) in adam  # tied head and depth encodings
    assert all(id(layer.attention_norm.weight) in adam for layer in model.layers)
    assert {id(p) for p in hidden_matrices(model)} == muon
    assert all(model.get_parameter(n).dim() == 2 for n, p in model.named_parameters() if id(p) in muon)
    # one schedule drives both halves: the trainer writes each group's lr
    for g in opt.param_groups:
        g["lr"] = 1e-4
    assert opt.muon.param_groups[0]["lr"] == opt.adamw.param_groups[1]["lr"] == 1e-4


def test_adamw_is_still_the_default():
    cfg = make_config("tiny", "control")
    assert (
        type(make_optimizer(architectures.build("control", cfg.model), cfg, torch.device("cpu"))) is torch.optim.AdamW
    )


@pytest.mark.parametrize(
    "kind, want",
    [
        # R = 4 over 0.25 * 40 = 10 steps: depth 1 + 3x
        ("linear", [1.0, 1.3, 2.5, 3.7, 4.0, 4.0]),
        (
            "1-sqrt",
            [1.0, 1 + 3 * (1 - math.sqrt(0.9)), 1 + 3 * (1 - math.sqrt(0.5)), 1 + 3 * (1 - math.sqrt(0.1)), 4.0, 4.0],
        ),
    ],
)
def test_curriculum_schedule(kind, want):
    cfg = make_config("tiny", "relaxed", overrides={"train.recur_curriculum": kind, "train.max_steps": 40})
    got = [curriculum.depth_at(s, cfg) for s in (0, 1, 5, 9, 10, 39)]
    assert got == pytest.approx(want)
    passes = [curriculum.passes_at(s, cfg) for s in range(40)]
    assert passes[0] == 1 and passes[10:] == [4] * 30 and passes == sorted(passes) and set(passes) == {1, 2, 3, 4}
    off = make_config("tiny", "relaxed")
    assert curriculum.depth_at(0, off) == 4.0 and not curriculum.enabled(off)


def test_curriculum_flops_are_the_sum_over_the_steps_at_their_depth():
    cfg = make_config("tiny", "frailt", overrides={"train.recur_curriculum": "linear", "train.max_steps": 20})
    model = architectures.build("frailt", cfg.model)
    T, tps = cfg.model.max_seq_len, cfg.tokens_per_step
    want = sum(tps * model.flops_per_token(T, n_recur=curriculum.passes_at(s, cfg)) for s in range(20))
    counter = curriculum.FlopCounter(model, cfg)
    assert counter.advance_to(20) == pytest.approx(want)
    assert curriculum.FlopCounter(model, cfg, start_step=7).advance_to(20) == pytest.approx(want)  # a resume
    full = 20 * tps * model.flops_per_token(T)
    assert want < full
    assert counter.total == pytest.approx(
        full
        - tps
        * sum(
            model.flops_per_token(T, n_recur=4) - model.flops_per_token(T, n_recur=curriculum.passes_at(s, cfg))
            for s in range(5)
        )
    )


def test_sampled_depth_curriculum_moves_the_mean_for_the_step_only():
    cfg = make_config(
        "tiny",
        "three-part",
        overrides={
            "train.recur_curriculum": "linear",
            "train.max_steps": 40,
            "model.recur_sampling": "poisson-lognormal",
        },
    )
    model = architectures.build("three-part", cfg.model).train()
    args = model.args
    T = cfg.model.max_seq_len
    with curriculum.at_step(model, 0, cfg) as n:
        assert n is None and model.args.n_recur == 1.0  # the model samples around the scheduled mean
        early = model.flops_per_token(T)
        torch.manual_seed(0)
        draws = [model.sample_n_recur() for _ in range(400)]
    assert model.args is args  # restored: evaluation runs at the trained depth
    assert sum(draws) / len(draws) == pytest.approx(2.0, abs=0.25)  # E[Poisson(tau) + 1] = r_bar + 1
    assert curriculum.step_flops(model, 0, cfg) == pytest.approx(early * cfg.tokens_per_step)
    assert early < model.flops_per_token(T)


@pytest.mark.slow  # three CLI processes (~75 s on a loaded 2-core box)
def test_muon_with_a_curriculum_resumes_bit_identically_after_kill_9(tmp_path, tinystories_dir):
    """A relaxed run with Muon and a depth curriculum, killed after a checkpoint and rerun, ends exactly where an
    uninterrupted run ends: weights, losses and every metric row (the FLOPs spent included)."""
    cache = tmp_path / "cache"
    args = [
        "train",
        "--arch",
        "relaxed",
        "--preset",
        "tiny",
        "--data",
        str(tinystories_dir),
        "--no-progress",
        "--set",
        "train.max_steps=12",
        "--set",
        "train.eval_interval=4",
        "--set",
        "train.ckpt_interval=3",
        "--set",
        "train.log_interval=2",
        "--set",
        "train.optimizer=muon",
        "--set",
        "train.recur_curriculum=linear",
        "--set",
        "train.recur_curriculum_frac=0.5",
    ]
    ref_db = tmp_path / "ref" / "results.db"
    ref = cli_proc([*args, "--db", str(ref_db)], cache)
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err

    db_path = tmp_path / "killed" / "results.db"
    p = cli_proc([*args, "--db", str(db_path)], cache)
    deadline, step = time.time() + 240, 0
    while time.time() < deadline and p.poll() is None and step < 3:
        if db_path.exists():
            try:
                con = sqlite3.connect(db_path, timeout=1)
                step = con.execute("select max(step) from checkpoints").fetchone()[0] or 0
                con.close()
            except sqlite3.OperationalError:
                step = 0
        time.sleep(0.05)
    assert p.poll() is None, "the run finished before it could be killed; make it longer"
    p.send_signal(signal.SIGKILL)
    p.wait()
    again = cli_proc([*args, "--db", str(db_path)], cache)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming" in out

    (r_ref, m_ref, w_ref), (r_new, m_new, w_new) = _final_state(ref_db, "relaxed"), _final_state(db_path, "relaxed")
    assert r_new[1] == "done" and r_new[3] == r_ref[3]
    assert m_new == m_ref
    assert all(torch.equal(w_ref[k], w_new[k]) for k in w_ref)
    flops = [v for (name, _s, v) in _metrics(db_path) if name == "train_flops"]
    cfg = make_config(
        "tiny",
        "relaxed",
        overrides={"train.max_steps": 12, "train.recur_curriculum": "linear", "train.recur_curriculum_frac": 0.5},
    )
    model = architectures.build("relaxed", cfg.model)
    assert flops[-1] == pytest.approx(curriculum.FlopCounter(model, cfg).advance_to(12))


def _metrics(db_path: Path) -> list[tuple[str, int, float]]:
    con = sqlite3.connect(db_path)
    rows = con.execute("select name, step, value from metrics order by name, step").fetchall()
    con.close()
    return rows
