"""MoR (architectures/mor.py) against its recursions written out by hand, for expert-choice and token-choice
routing, and its declared causality: token-choice causal in train mode, expert-choice not (its eval-mode rule is
checked by the registry-parametrised tests in tests/test_architectures.py, with caching, generation and FLOPs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from architectures.blocks import KVCache, rotate_pairs
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


class _KeyProjections(TorchFunctionMode):
    """Records, per block of the recursion, the length of every sequence its key projection is applied to (however
    the block applies it: a module call or a functional linear over its weight)."""

    def __init__(self, model):
        super().__init__()
        self.blocks = {id(model.layers[i].attention.wk.weight): i for i in (1, 2)}
        self.seen: dict[int, list[int]] = {1: [], 2: []}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            if id(weight) in self.blocks:
                self.seen[self.blocks[id(weight)]].append(args[0].shape[1])
        return func(*args, **kwargs)


@pytest.mark.parametrize("routing", ["expert", "token"])
def test_mor_kv_options_say_which_keys_and_values_a_step_attends_to(routing, tiny_model):
    """Recursion-wise (the default): every step projects keys and values of its own routed tokens (expert-choice in
    training: T, 2T/3, T/3 of them). Recursive sharing: only the first step does, over every token, and the result
    differs with the same weights."""
    T, N = 12, 3
    x = tokens(2, T)
    rec, shared = tiny_model("mor", mor_routing=routing), tiny_model("mor", mor_routing=routing, mor_kv="share")
    assert rec.arch_args.mor_kv == "recursion"
    shared.load_state_dict(rec.state_dict())
    seen_rec, seen_shared = _KeyProjections(rec), _KeyProjections(shared)
    with seen_rec:
        rec.train()(x)
    with seen_shared:
        shared.train()(x)
    seen_rec, seen_shared = seen_rec.seen, seen_shared.seen
    if routing == "expert":
        assert seen_rec == {i: [T, T * 2 // N, T // N] for i in (1, 2)}
    else:
        assert len(seen_rec[1]) > 1  # at least one token took a second step (checked below to differ)
    assert seen_shared == {1: [T], 2: [T]}
    assert not torch.allclose(seeded_logits(rec, x), seeded_logits(shared, x))


def test_mor_kv_sharing_by_hand(tiny_model):
    """Expert-choice with recursive KV sharing, written out: the first step runs the recursion block over every
    token and keeps each block's rotated keys and values; at a later step the kept tokens' queries attend causally
    (by position) over those, and their blocks' own key and value projections are not used."""
    model = tiny_model("mor", mor_kv="share").train()
    B, T, N = 2, 12, 3
    x = tokens(B, T)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    blocks = [model.layers[1], model.layers[2]]
    H, hd = model.args.n_heads, model.args.dim // model.args.n_heads

    def attend(block, s, k, v):  # s (T, d) at positions 0..T-1, causal over k, v (H, T, hd)
        a = block.attention
        q = rotate_pairs(a.wq(block.attention_norm(s)).view(1, T, H, hd), cos, sin)[0].transpose(0, 1)
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = s + a.wo(y.transpose(0, 1).reshape(T, -1))
        return h + block.feed_forward(block.ffn_norm(h))

    h = model.layers[0](model.tok_embeddings(x), cos, sin)
    final = []
    for b in range(B):
        hb, cand, kv = h[b], torch.arange(T), []
        for r in range(N):
            g = torch.sigmoid(model.router[r](hb[cand]).squeeze(-1)) * 0.1
            top = torch.topk(g, max(1, (T * (N - r)) // N)).indices.sort().values
            sel = cand[top]
            s = hb.clone()  # every row computed, the routed ones kept: attention is causal by position
            for i, block in enumerate(blocks):
                if r == 0:
                    xn = block.attention_norm(s)
                    k = rotate_pairs(block.attention.wk(xn).view(1, T, H, hd), cos, sin)[0].transpose(0, 1)
                    kv.append((k, block.attention.wv(xn).view(T, H, hd).transpose(0, 1)))
                s = attend(block, s, *kv[i])
            hb = hb.index_add(0, sel, g[top][:, None] * s[sel])
            cand = sel
        final.append(hb)
    ref = model.output(model.norm(model.layers[3](torch.stack(final), cos, sin)))
    torch.testing.assert_close(model(x)[0], ref, rtol=1e-4, atol=1e-5)


def test_mor_kv_sharing_is_causal_and_caches_as_its_full_forward(tiny_model):
    """Sharing keeps each option's causality: token-choice in train mode, expert-choice by its inference rule; the
    generation cache gives the full forward's logits; the steps after the first count no key and value projections."""
    assert_causal(tiny_model("mor", mor_routing="token", mor_kv="share"), "train")
    model = tiny_model("mor", mor_kv="share")
    assert_causal(model, "eval")
    model.eval()
    x = tokens(2, 14)
    with torch.no_grad():
        full = model(x)[0]
        cache = KVCache(model.args.max_seq_len)
        parts = [model(x[:, :5], cache=cache)[0]] + [model(x[:, i : i + 1], cache=cache)[0] for i in range(5, 14)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)

    T, N = 12, 3
    rec = tiny_model("mor").train()
    shared = tiny_model("mor", mor_kv="share").train()
    spent = []
    for m in (rec, shared):
        m(tokens(2, T))
        spent.append(m.spent_flops_per_token(m.take_stats(), T))
    a, hd = rec.args, rec.args.dim // rec.args.n_heads
    saved = sum(
        (n / T) * 2 * (4 * a.dim * a.n_kv_heads * hd - 4 * (T - n) * a.n_heads * hd) for n in (T * 2 // N, T // N)
    )
    assert spent[1] == pytest.approx(spent[0] - 3 * saved)  # forward and backward, as every spent count
