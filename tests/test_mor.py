"""MoR (architectures/mor.py) against its recursions written out by hand, for expert-choice and token-choice
routing, and its declared causality: token-choice causal in train mode, expert-choice not (its eval-mode rule is
checked by the registry-parametrised tests in tests/test_architectures.py, with caching, generation and FLOPs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_architectures import assert_causal, seeded_logits, tokens


def test_mor_token_choice_trains_causally_and_expert_choice_does_not(tiny_model):
    """Token-choice decides each token's depth from its own state: causal in train mode too. Expert-choice's top-k
    over the sequence is not (a later token changes which earlier tokens are kept), which is why it declares the
    causal rule its eval mode uses."""
    assert_causal(tiny_model("mor", mor_routing="token"), "train")
    model = tiny_model("mor").train()
    x = tokens(2, 16)
    base = seeded_logits(model, x)
    leaked = False
    for t in range(1, 16):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % 512
        leaked |= not torch.allclose(seeded_logits(model, x2)[:, :t], base[:, :t], rtol=1e-5, atol=1e-6)
    assert leaked
    assert not type(model).causal_training and "sigmoid" in type(model).inference_rule


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_mor_routes_by_hand(routing, tiny_model):
    """The recursions as written out: routed tokens run the shared block (B2 B3) as their own sequence at their own
    positions; expert-choice keeps the top k_r = T (N_r - r + 1) / N_r of the previous step's tokens and adds
    g_r * block(x) to them; token-choice adds g * block output to the state that entered the recursions at each
    token's chosen depth. Aux terms: the router BCE on the top-k targets, or the balancing loss."""
    model = tiny_model("mor", mor_routing=routing).train()
    B, T, N = 2, 12, 3
    x, y = tokens(B, T), tokens(B, T, seed=1)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]

    def core(s, pos):  # one sequence's routed tokens (n, d) at positions pos (n,)
        s = s[None]
        for i in (1, 2):
            s = model.layers[i](s, cos[pos], sin[pos])
        return s[0]

    h = model.layers[0](model.tok_embeddings(x), cos, sin)
    final = []
    aux = torch.zeros(())
    for b in range(B):
        hb = h[b]
        if routing == "expert":
            cand = torch.arange(T)
            for r in range(N):
                logit = model.router[r](hb[cand]).squeeze(-1)
                g = torch.sigmoid(logit) * 0.1
                k = max(1, (T * (N - r)) // N)
                top = torch.topk(g, k).indices.sort().values
                target = torch.zeros(len(cand))
                target[top] = 1.0
                aux = aux + F.binary_cross_entropy_with_logits(logit, target) / B
                sel = cand[top]
                out = core(hb[sel], sel)
                hb = hb.index_add(0, sel, g[top][:, None] * out)
                cand = sel
            final.append(hb)
        else:
            probs = F.softmax(model.router(hb), dim=-1)
            depth = probs.argmax(-1) + 1
            g = probs.gather(-1, (depth - 1)[:, None]).squeeze(-1)
            out_b, state = hb.clone(), hb.clone()
            for r in range(N):
                sel = torch.nonzero(depth > r).squeeze(-1)
                if len(sel) == 0:
                    break
                out = core(state[sel], sel)
                ends = depth[sel] == r + 1
                out_b = out_b.index_add(0, sel[ends], g[sel[ends]][:, None] * out[ends])
                state = state.index_copy(0, sel, out)
            final.append(out_b)
    ref = model.output(model.norm(model.layers[3](torch.stack(final), cos, sin)))
    logits, _ = model(x, y)
    stats = model.take_stats()
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    if routing == "expert":
        term, weight = stats.aux["router_bce"]
        torch.testing.assert_close(term, aux, rtol=1e-5, atol=1e-6)
    else:
        probs = F.softmax(model.router(h), dim=-1)
        choice = probs.argmax(-1)
        frac = torch.stack([(choice == i).float().mean() for i in range(N)])
        term, weight = stats.aux["balance"]
        torch.testing.assert_close(term, (probs.mean((0, 1)) * N * frac).sum())
    assert weight == model.arch_args.mor_aux_weight
    assert model.spent_flops_per_token(stats, T) < model.flops_per_token(T)


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_mor_below_its_trained_depth(routing, tiny_model):
    """At a test-time depth n < N_r every token takes at most n recursions (token-choice: a deeper choice ends at n)
    and every token still gets an output."""
    model = tiny_model("mor", mor_routing=routing)
    x = tokens(2, 12)
    with torch.no_grad():
        logits, _ = model(x, n_recur=2)
    stats = model.take_stats()
    assert torch.isfinite(logits).all()
    assert float(stats.metrics["mean_depth"]) <= 2
    assert sum(float(stats.metrics[f"depth_frac_{k}"]) for k in range(3)) == pytest.approx(1.0)
    assert "depth_frac_3" not in stats.metrics
    with torch.no_grad():
        assert not torch.allclose(logits, model(x)[0])
