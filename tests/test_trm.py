"""trm: the recursion written out by hand, where gradients flow, the deep-supervision term, and the compute a forward
reports."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchctl.core.errors import ConfigError


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("context_scale", ["unit", "sqrt-dim"])
def test_schedule_by_hand(tiny_model, context_scale):
    model = tiny_model("trm", n_latent=3, n_cycles=2, context_scale=context_scale)
    with torch.no_grad():  # norm gains away from one, so a misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    x_tok = tokens(2, 9)
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]

    def net(h):
        for b in model.layers:
            h = rms(h + b.attention(h, cos, sin), b.attention_norm.weight)
            h = rms(h + b.feed_forward(h), b.ffn_norm.weight)
        return h

    with torch.no_grad():
        emb = model.tok_embeddings(x_tok)
        x = emb / model.args.init_std if context_scale == "unit" else emb * math.sqrt(model.args.dim)
        y, z = model.y_init.expand_as(x), model.z_init.expand_as(x)
        for _ in range(model.args.n_recur):  # supervision steps
            for _ in range(2):  # cycles
                for _ in range(3):  # latent updates
                    z = net(z + y + x)
                y = net(y + z)
        ref = model.output(rms(y, model.norm.weight))
        torch.testing.assert_close(model(x_tok)[0], ref, rtol=1e-4, atol=1e-5)
        # the iteration hooks run the same schedule
        torch.testing.assert_close(model.iterate(x_tok).logits, ref, rtol=1e-4, atol=1e-5)


def test_the_question_starts_at_the_scale_of_the_states(tiny_model):
    # x beside y0 and z0 (std 1 each): at sqrt(d) times the std-0.02 embedding it would start near 0.02 * sqrt(d) and
    # the network would see almost nothing of the token
    model = tiny_model("trm", dim=64, n_heads=4, n_kv_heads=4, hidden_dim=64)
    h = model.tok_embeddings(tokens(4, 64)).detach()
    _, x = model.prelude(h, None, None, None)
    assert 0.9 < float(x.std()) < 1.1
    _, x_old = tiny_model("trm", dim=64, n_heads=4, n_kv_heads=4, hidden_dim=64, context_scale="sqrt-dim").prelude(
        h, None, None, None
    )
    assert float(x_old.std()) < 0.2


def test_context_scale_is_checked(tiny_args):
    with pytest.raises(ConfigError, match="model.context_scale: must be one of unit, sqrt-dim, got 'half'"):
        tiny_args("trm", context_scale="half")


def test_initial_states_are_fixed_unit_variance_buffers(tiny_model):
    model = tiny_model("trm", dim=256, n_heads=4, n_kv_heads=4, hidden_dim=64)
    names = {n for n, _ in model.named_parameters()}
    assert not any("init" in n for n in names)  # y0 and z0 are not trained
    for buf in (model.y_init, model.z_init):
        assert buf.abs().max() <= 2.0 / 0.87  # truncated at +-2 before the rescale to std 1 (factor ~1.14)
        assert abs(float(buf.std()) - 1.0) < 0.15
    assert not torch.equal(model.y_init, model.z_init)


def test_gradients_flow_through_the_last_cycle_of_each_step(tiny_model):
    model = tiny_model("trm", n_latent=2, n_cycles=3).train()  # n_recur = 2 supervision steps
    calls: list[bool] = []
    model.layers[0].register_forward_hook(lambda m, i, o: calls.append(o.requires_grad))
    x = tokens(2, 8)
    model(x, x)
    per_step = [False] * (2 * 3) + [True] * 3  # (T - 1)(n + 1) without a graph, then n + 1 with
    assert calls == per_step * 2
    model.take_stats()


def test_deep_supervision_scores_the_earlier_answers(tiny_model):
    model = tiny_model("trm").train()
    x, y = tokens(2, 8), tokens(2, 8, seed=1)
    torch.manual_seed(0)
    _, loss = model(x, y)
    stats = model.take_stats()
    term, weight = stats.aux["deep_supervision"]
    assert weight == 1.0 and term.requires_grad  # n_recur = 2: one earlier step
    # the earlier step's answer is the one-step model's answer
    with torch.no_grad():
        one = model(x, y, n_recur=1)[1]
    assert not model.take_stats().aux  # one step: nothing earlier to score
    torch.testing.assert_close(term.detach(), one, rtol=1e-5, atol=1e-6)
    # the fused head loss scores the earlier answer the same
    _, fused = model(x, y, return_logits=False)
    torch.testing.assert_close(model.take_stats().aux["deep_supervision"][0].detach(), one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, loss, rtol=1e-5, atol=1e-6)
    # the final loss is the plain cross-entropy of the last answer, and evaluation reports no term
    model.eval()
    with torch.no_grad():
        logits, ev = model(x, y)
    assert not model.take_stats().aux
    torch.testing.assert_close(ev, F.cross_entropy(logits.view(-1, 512), y.view(-1)))
    # the steps are detached: the final loss alone does not reach the first step's graph, the trainer's loss does
    model.train()
    grads: list[int] = []
    model.layers[0].register_full_backward_hook(lambda m, gi, go: grads.append(1))
    _, loss = model(x, y)
    model.take_stats()
    loss.backward()
    assert len(grads) == 3  # the last step's n + 1 passes only
    grads.clear()
    model.zero_grad()
    _, loss = model(x, y)
    aux = model.take_stats().aux_total()
    assert aux is not None
    (loss + aux).backward()
    assert len(grads) == 6  # both steps' last cycles


def test_reported_compute_is_the_analytic_count_in_training(tiny_model):
    model = tiny_model("trm", n_latent=3, n_cycles=2, n_recur=3).train()
    x = tokens(2, 16)
    model(x, x)
    stats = model.take_stats()
    cycle = 4 * len(model.layers) * model.block_flops(16)
    head = 2.0 * model.args.dim * model.args.vocab_size
    assert stats.compute == [(cycle, False), (cycle, True), (head, True)] * 2 + [(cycle, False), (cycle, True)]
    assert model.spent_flops_per_token(stats, 16) == model.flops_per_token(16)
    # evaluation scores the final answer only: below the training count, and the cycles still count once each
    model.eval()
    with torch.no_grad():
        model(x, x)
    stats = model.take_stats()
    assert stats.compute == [(cycle, False)] * 6
    assert model.spent_flops_per_token(stats, 16, training=False) == 6 * cycle + head


def test_runs_past_the_trained_depth(tiny_model):
    """No per-step parameters: more supervision steps than trained are the same recursion run longer."""
    model = tiny_model("trm")
    x = tokens(1, 8)
    with torch.no_grad():
        outs = [model(x, n_recur=r)[0] for r in (1, 2, 4)]
    assert torch.equal(outs[1], model(x)[0])
    assert not torch.allclose(outs[0], outs[1]) and torch.isfinite(outs[2]).all()
    assert model.effective_depth(4) == 4 * 2 * 3 * len(model.layers)
