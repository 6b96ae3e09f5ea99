"""UT-ACT (architectures/ut_act.py) against ACT written out by hand: the halting unit, the remainder at the
threshold, the halting-weighted state, the ponder cost and the compute the forward reports. The registry-parametrised
tests (tests/test_architectures.py) cover the rest: causality in train mode, caching, generation, FLOPs."""

from __future__ import annotations

import pytest
import torch

from tests.test_architectures import tokens


def test_ut_act_halting_by_hand(tiny_model):
    """ACT as written in the Universal Transformer's code (halting unit, remainder at the threshold, weighted state,
    ponder cost N + R), with the halting unit set so that the tokens halt at different steps."""
    model = tiny_model("ut-act").train()
    x, y = tokens(2, 12), tokens(2, 12, seed=1)
    with torch.no_grad():
        model.halt.weight.normal_(0, 30.0)  # per-token probabilities far from the shared init
        model.halt.bias.zero_()
        model.step_emb.normal_(0, 0.02)
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    eps, N = model.arch_args.act_epsilon, 4
    h = model.tok_embeddings(x)
    B, T, _ = h.shape
    cum, rem, n_up = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
    out, state = torch.zeros_like(h), h
    halted = torch.zeros(B, T, dtype=torch.bool)
    for n in range(N):
        if halted.all():
            break
        s = state + model.step_emb[n]
        p = torch.sigmoid(model.halt(s).squeeze(-1))
        w = torch.zeros(B, T)
        for b in range(B):
            for t in range(T):
                if halted[b, t]:
                    continue
                n_up[b, t] += 1
                if cum[b, t] + p[b, t] > 1 - eps or n == N - 1:
                    rem[b, t] = 1 - cum[b, t]
                    w[b, t] = rem[b, t]
                    cum[b, t] = 1.0
                    halted[b, t] = True
                else:
                    cum[b, t] += p[b, t]
                    w[b, t] = p[b, t]
        for layer in model.layers:
            s = layer(s, cos, sin)
        state = s
        out = s * w[..., None] + out * (1 - w[..., None])
    assert len(set(n_up.flatten().tolist())) > 1  # the tokens really halted at different steps
    ref = model.output(model.norm(out))
    logits, loss = model(x, y)
    stats = model.take_stats()
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    ponder, weight = stats.aux["ponder"]
    torch.testing.assert_close(ponder, (n_up + rem).mean())
    assert weight == model.arch_args.act_tau
    assert stats.metrics["mean_depth"] == pytest.approx(float(n_up.mean()))
    assert sum(float(stats.metrics[f"depth_frac_{k}"]) for k in range(1, N + 1)) == pytest.approx(1.0)
    steps = int(n_up.max())
    assert stats.metrics["steps_run"] == steps
    assert model.spent_flops_per_token(stats, 12) == pytest.approx(
        model.flops_per_token(12) * steps / N + 2 * 32 * 512 * 3 * (1 - steps / N)
    )
    # the ponder cost reaches the halting unit through the remainders
    (g,) = torch.autograd.grad(ponder, model.halt.bias)
    assert g.abs() > 0
