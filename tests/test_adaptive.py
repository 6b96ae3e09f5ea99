"""The trainer's side of adaptive computation: an architecture's auxiliary losses join the loss it optimises (and only
that loss: validation stays the plain cross-entropy), its terms and metrics are stored per logged step and beside each
validation loss, and the training FLOPs a run records are the ones its forwards really spent, carried across a
resume."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

import architectures
from benchctl import stages
from benchctl.core.config import make_config
from benchctl.stages.train import engine


class CapturingOptimizer:
    """Stands in for AdamW in `train_step`: keeps the gradients it is asked to apply, changes nothing."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> None:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def test_train_step_optimises_the_loss_plus_the_weighted_auxiliary_terms(tiny_model):
    cfg = make_config("tiny", "ut-act", overrides={"train.grad_accum": 2, "train.grad_clip": 0.0})
    model = tiny_model("ut-act").train()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 17), generator=g) for _ in range(2)]
    feed = iter([(b[:, :-1], b[:, 1:]) for b in batches])
    opt = CapturingOptimizer(model)
    stats = engine.StepStats()
    ce_sum, _ = engine.train_step(model, model, opt, lambda: next(feed), cfg, torch.device("cpu"), None, stats=stats)

    model.zero_grad()
    ce_ref, ponder = 0.0, []
    for b in batches:
        _, ce = model(b[:, :-1], b[:, 1:], return_logits=False)
        fwd = model.take_stats()
        term, weight = fwd.aux["ponder"]
        assert weight == model.arch_args.act_tau
        ((ce + weight * term) / 2).backward()
        ce_ref += float(ce.detach()) / 2
        ponder.append(float(term.detach()))
    for n, p in model.named_parameters():
        torch.testing.assert_close(opt.grads[n], p.grad, msg=n)
    assert float(ce_sum) == pytest.approx(ce_ref)  # the step's loss is the cross-entropy alone
    assert stats.micro == 2
    assert stats.means()["aux/ponder"] == pytest.approx(sum(ponder) / 2)
    assert "arch/mean_depth" in stats.means() and "arch/depth_frac_4" in stats.means()
    assert 0 < stats.flops < model.flops_per_token(16) * 2 * 2 * 16


def test_train_step_of_an_architecture_without_auxiliary_terms_is_unchanged(tiny_model):
    cfg = make_config("tiny", "control", overrides={"train.grad_clip": 0.0})
    model = tiny_model("control").train()
    x = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    opt = CapturingOptimizer(model)
    stats = engine.StepStats()
    engine.train_step(model, model, opt, lambda: (x[:, :-1], x[:, 1:]), cfg, torch.device("cpu"), None, stats=stats)
    model.zero_grad()
    model(x[:, :-1], x[:, 1:], return_logits=False)[1].backward()
    assert all(torch.equal(opt.grads[n], p.grad) for n, p in model.named_parameters())
    assert stats == engine.StepStats()  # nothing reported, nothing gathered: its FLOPs come from the schedule


def test_evaluate_reports_the_auxiliary_terms_beside_the_plain_loss(tiny_model):
    model = tiny_model("ut-act")
    windows = torch.randint(0, 512, (5, 17), generator=torch.Generator().manual_seed(2))
    extras: dict[str, float] = {}
    loss = engine.evaluate(model, windows, 2, torch.device("cpu"), None, seed=0, extras=extras)
    with torch.no_grad():
        ce = [float(model(w[None, :-1], w[None, 1:])[1]) for w in windows]
    assert loss == pytest.approx(sum(ce) / len(ce), rel=1e-6)  # cross-entropy alone, whatever the ponder cost
    assert {"val_aux/ponder", "val_arch/ponder_time", "val_arch/mean_depth"} <= set(extras)
    assert extras["val_aux/ponder"] == pytest.approx(extras["val_arch/ponder_time"])
    assert engine.evaluate(tiny_model("control"), windows, 2, torch.device("cpu"), None, seed=0, extras=extras) > 0


def _metrics(db_path: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    con = sqlite3.connect(db_path)
    out: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in con.execute(
        "select name, step, value from metrics where run_id = ? order by name, step", [run_id]
    ):
        out.setdefault(name, []).append((step, value))
    con.close()
    return out


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_an_adaptive_run_stores_its_terms_metrics_and_spent_flops_across_a_resume(
    tmp_path, tinystories_dir, monkeypatch
):
    from benchctl.core import data
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    overrides = {
        "data.source": str(tinystories_dir),
        "train.max_steps": 6,
        "train.eval_interval": 3,
        "train.ckpt_interval": 2,
        "train.log_interval": 1,
        "train.warmup_steps": 1,
    }
    cfg = make_config("tiny", "ut-act", overrides=overrides)
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    a_path, b_path = tmp_path / "a" / "results.db", tmp_path / "b" / "results.db"
    ra = train_run(cfg, prepared, stages.connect(a_path), a_path, progress=False, log=lambda *_: None)
    b = stages.connect(b_path)
    # stopped (and checkpointed) after step 3, then resumed
    train_run(cfg, prepared, b, b_path, progress=False, log=lambda *_: None, stop_after=3)
    rb = train_run(cfg, prepared, b, b_path, progress=False, log=lambda *_: None)
    assert ra.run_id == rb.run_id and rb.resumed_from == 3

    ma, mb = _metrics(a_path, ra.run_id), _metrics(b_path, rb.run_id)
    for name in ("peak_rss_bytes", "tokens_per_s"):  # the machine's numbers, not the model's
        ma.pop(name, None), mb.pop(name, None)
    assert ma == mb  # terms, metrics and spent FLOPs: the same as one uninterrupted run
    assert [s for s, _ in ma["aux/ponder"]] == [1, 2, 3, 4, 5, 6]
    assert {"arch/ponder_time", "arch/mean_depth", "arch/steps_run", "arch/depth_frac_1"} <= set(ma)
    assert [s for s, _ in ma["val_aux/ponder"]] == [s for s, _ in ma["val_loss"]] == [0, 3, 6]
    flops = [v for _, v in ma["train_flops"]]
    assert all(b > a for a, b in zip(flops, flops[1:]))
    model = architectures.build("ut-act", cfg.model)
    analytic = model.flops_per_token(cfg.model.max_seq_len) * cfg.tokens_per_step * 6
    steps = [v for _, v in ma["arch/steps_run"]]
    assert flops[-1] <= analytic
    if min(steps) < cfg.model.n_recur:  # the halting unit starts at p ~ 0.73: two steps, not four
        assert flops[-1] < analytic


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_every_run_records_its_training_flops(tmp_path, tinystories_dir, monkeypatch):
    """An architecture that reports no compute spends its analytic count, recorded the same way."""
    from benchctl.core import data
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    overrides = {
        "data.source": str(tinystories_dir),
        "train.max_steps": 4,
        "train.log_interval": 2,
        "train.warmup_steps": 1,
    }
    cfg = make_config("tiny", "frailt", overrides=overrides)
    prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
    db_path = tmp_path / "results.db"
    r = train_run(cfg, prepared, stages.connect(db_path), db_path, progress=False, log=lambda *_: None)
    per_step = architectures.build("frailt", cfg.model).flops_per_token(cfg.model.max_seq_len) * cfg.tokens_per_step
    assert _metrics(db_path, r.run_id)["train_flops"] == [(2, 2 * per_step), (4, 4 * per_step)]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_report_shows_spent_flops_and_the_adaptive_metrics(tmp_path, tinystories_dir, monkeypatch):
    """A report over an adaptive model and the control: training FLOPs as spent beside the analytic maximum, the
    auxiliary losses and metrics with the validation depth distribution, and their figure."""
    from benchctl.core import data
    from benchctl.stages.report import engine as report_engine
    from benchctl.stages.train.engine import train_run

    monkeypatch.setenv("BENCHCTL_CACHE", str(tmp_path / "cache"))
    overrides = {
        "data.source": str(tinystories_dir),
        "train.max_steps": 4,
        "train.eval_interval": 2,
        "train.log_interval": 1,
        "train.warmup_steps": 1,
    }
    db_path = tmp_path / "results.db"
    db = stages.connect(db_path)
    for arch in ("control", "ut-act"):
        cfg = make_config("tiny", arch, overrides=overrides)
        prepared = data.prepare(cfg.data, cfg.model.vocab_size, progress=False)
        train_run(cfg, prepared, db, db_path, progress=False, log=lambda *_: None)
    out = report_engine.write_report(db_path, tmp_path / "report")
    md = out.read_text()
    compute = md.split("## Loss against compute", 1)[1].split("\n## ", 1)[0]
    assert "analytic max" in compute and "as spent" in compute
    rows = {
        ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in compute.splitlines() if "|" in ln
    }
    ut, ctrl = rows["ut-act"], rows["control"]
    assert float(ut[5]) < float(ut[6])  # spent below the analytic maximum
    assert float(ctrl[5]) == float(ctrl[6])  # a fixed-depth model spends exactly its count
    adaptive = md.split("## Adaptive computation", 1)[1].split("\n## ", 1)[0]
    assert "aux/ponder" in adaptive and "arch/mean_depth" in adaptive and "depth 1" in adaptive
    assert "| ut-act" in adaptive and "| control" not in adaptive
    assert "](figures/adaptive_metrics.png)" in adaptive
    assert (tmp_path / "report" / "figures" / "adaptive_metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_steps_report_afresh_rather_than_pile_up(tiny_model):
    """Each decode step starts its stats from nothing, as each forward does: generating many tokens must not grow the
    reported compute list or keep summing auxiliary losses."""
    import architectures.generate as gen

    model = tiny_model("ut-act").eval()
    gen.generate(model, [[1, 2, 3, 4]], max_new_tokens=6, temperature=0.0)
    stats = model.take_stats()
    assert stats.compute is None or len(stats.compute) <= 1
