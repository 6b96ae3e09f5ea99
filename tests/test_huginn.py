"""huginn: the released recurrent-depth model's pieces checked against their formulas — the sandwich block, the
query/key biases, the schedule (scaled embedding, random state, adapter, final norm applied twice), the sampled
training depth with truncated backprop, its expected FLOPs and the "auto" truncation depth."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from architectures.blocks import Attention, rotate_pairs
from architectures.huginn import Huginn, QKBiasAttention, poisson_lognormal_pmf
from benchctl.core.config import make_config
from benchctl.core.errors import ConfigError


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def perturbed(model: Huginn) -> Huginn:
    """Give the parameters that start at one or zero (norm gains, query/key biases) other values, so a formula
    that left one out would not match."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_qk_bias_attention_by_hand(tiny_args):
    args = tiny_args("huginn")
    torch.manual_seed(0)
    attn = QKBiasAttention(args)
    with torch.no_grad():
        attn.q_bias.normal_(0, 0.5)
        attn.k_bias.normal_(0, 0.5)
    x = torch.randn(2, 7, args.dim)
    H, hd = args.n_heads, args.dim // args.n_heads
    cos, sin = torch.randn(7, hd // 2), torch.randn(7, hd // 2)
    q = rotate_pairs((x @ attn.wq.weight.T + attn.q_bias).view(2, 7, H, hd), cos, sin).transpose(1, 2)
    k = rotate_pairs((x @ attn.wk.weight.T + attn.k_bias).view(2, 7, H, hd), cos, sin).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(2, 7, H, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, -1)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), y @ attn.wo.weight.T)
        # with zero biases it is the plain attention
        attn.q_bias.zero_()
        attn.k_bias.zero_()
        plain = Attention(args)
        plain.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.endswith("_bias")})
        torch.testing.assert_close(attn(x, cos, sin), plain(x, cos, sin))


def test_schedule_by_hand(tiny_model):
    """Eval forward = coda(ln_f(core^7(...))) on the sandwich blocks, written out with the module's parts."""
    model = perturbed(tiny_model("huginn"))
    x = tokens(2, 10)
    T, d = 10, model.args.dim
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    eps = model.args.norm_eps

    def block(b, h):
        a = b.attention(rms(h, b.attention_norm.weight, eps), cos, sin)
        h = rms(h + a, b.attention_out_norm.weight, eps)
        return rms(h + b.feed_forward(rms(h, b.ffn_norm.weight, eps)), b.ffn_out_norm.weight, eps)

    with torch.no_grad():
        torch.manual_seed(3)
        ref = model(x)[0]
        torch.manual_seed(3)
        e = block(model.layers[0], model.tok_embeddings(x) * math.sqrt(d))
        sigma = math.sqrt(0.4)
        s = torch.nn.init.trunc_normal_(torch.empty_like(e), std=sigma, a=-3 * sigma, b=3 * sigma)
        for _ in range(7):
            s = model.adapter(torch.cat([s, e], -1))
            s = block(model.layers[2], block(model.layers[1], s))
        out = block(model.layers[3], rms(s, model.norm.weight, eps))
        logits = rms(out, model.norm.weight, eps) @ model.tok_embeddings.weight.T
    torch.testing.assert_close(ref, logits, rtol=1e-4, atol=1e-5)


def test_initial_state_is_a_truncated_normal(tiny_model):
    model = tiny_model("huginn")
    torch.manual_seed(0)
    s = model.initial_state(torch.empty(64, 32, 32))
    sigma = math.sqrt(0.4)
    assert s.abs().max().item() <= 3 * sigma
    assert s.std().item() == pytest.approx(sigma * 0.9866, rel=0.02)  # a normal truncated at 3 sigma
    assert torch.equal(tiny_model("huginn", state_std=0.0).initial_state(torch.ones(2, 3)), torch.zeros(2, 3))


class CountAdapterCalls:
    """One adapter call per core iteration; records whether each built a graph."""

    def __init__(self, model):
        self.calls: list[bool] = []
        model.adapter.register_forward_hook(lambda m, i, o: self.calls.append(o.requires_grad))

    def take(self) -> list[bool]:
        out, self.calls = self.calls, []
        return out


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_sampled_depth_and_truncated_backprop(tiny_model):
    model = tiny_model("huginn")
    assert model.arch_args.mean_backprop_depth == 2  # auto: a quarter of r_bar = 7, rounded
    counter = CountAdapterCalls(model)
    x = tokens(1, 8)
    torch.manual_seed(0)
    model.train()
    depths = []
    for _ in range(40):
        model(x, x)
        calls = counter.take()
        r = len(calls)
        assert calls == [False] * max(r - 2, 0) + [True] * min(r, 2)  # gradients through the last k only
        depths.append(r)
    assert min(depths) >= 1 and len(set(depths)) > 3
    assert 6.0 < sum(depths) / len(depths) < 10.5  # E[r] = r_bar + 1 = 8
    model.eval()
    with torch.no_grad():
        model(x)
    assert len(counter.take()) == 7  # evaluation runs r_bar
    fixed = tiny_model("huginn", sampling_scheme="fixed", mean_backprop_depth=3).train()
    fixed_counter = CountAdapterCalls(fixed)
    fixed(x, x)
    assert fixed_counter.take() == [False] * 4 + [True] * 3
    whole = tiny_model("huginn", mean_backprop_depth=0).train()
    whole_counter = CountAdapterCalls(whole)
    whole(x, x)
    assert all(whole_counter.take())


def test_expected_flops_are_the_sampler_average(tiny_model):
    model = tiny_model("huginn")
    dist = dict(model.depth_distribution())
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(r * p for r, p in dist.items()) == pytest.approx(8.0, rel=1e-6)
    torch.manual_seed(0)
    draws = [model.sample_n_recur() for _ in range(20_000)]
    for r in (1, 4, 8, 12):
        assert draws.count(r) / len(draws) == pytest.approx(dist[r], abs=0.01)
    expected = model.flops_per_token()
    assert expected == pytest.approx(sum(model.flops_per_token(n_recur=r) for r in draws) / len(draws), rel=0.01)
    fixed = tiny_model("huginn", sampling_scheme="fixed")
    assert fixed.flops_per_token() == model.flops_per_token(n_recur=7) != expected
    assert model.flops_per_token(training=False) == fixed.flops_per_token(training=False)
    assert poisson_lognormal_pmf(32, 0.5)[0][0] == 1


def test_auto_backprop_depth_keeps_huginns_share():
    def k(**over):
        return make_config("tiny", "huginn", overrides={f"model.{a}": b for a, b in over.items()}).model.arch_args

    assert k().mean_backprop_depth == 2
    assert k(n_recur=32).mean_backprop_depth == 8  # Huginn's r_bar = 32, k = 8
    assert k(n_recur=1).mean_backprop_depth == 1
    assert k(mean_backprop_depth=0).mean_backprop_depth == 0


@pytest.mark.parametrize(
    "over,msg",
    [
        ({"model.n_layers_in_prelude": 2, "model.n_layers_in_coda": 2}, "model.n_layers_in_prelude (2)"),
        ({"model.mean_backprop_depth": -1}, "model.mean_backprop_depth"),
        ({"model.state_std": -0.1}, "model.state_std"),
    ],
)
def test_bad_arguments_are_config_errors(over, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        make_config("tiny", "huginn", overrides=over)
