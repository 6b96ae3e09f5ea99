"""Tests of the model zoo (architectures/): the registry, exact parameter accounting (the study's totals), FLOPs per
token checked against torch.utils.flop_counter, and the behaviour every architecture promises — causality, seeding,
KV-cached decoding, generation, the reductions to simpler models (FraiLT with one zero-encoded pass is the control;
relaxed with zero LoRA is the plain looped model), recurrence overrides and their bounds, Huginn's sampled depth and
truncated backprop.

Behaviour tests are parametrised over `architectures.names()`, so a fifth architecture is picked up automatically.
Everything runs at the `tiny` preset (dim 32, 4 blocks, vocab 512, context 32) in float32 on the CPU.
"""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import architectures
from architectures import BaseLM, RecurrenceError, UnknownArchitectureError, kernels
from architectures.blocks import PROJECTIONS, KVCache
from architectures.generate import Generation, generate, sample_next
from architectures.kernels import (
    CPU_EXPLICIT_ATTENTION_MAX_T,
    causal_attention,
    linear_cross_entropy,
    rms_norm,
    softmax_and_target_logp,
    swiglu,
)
from benchctl.core.config import make_config

NAMES = architectures.names()
STUDY = ["control", "frailt", "three-part", "relaxed"]
PAPER_TOTALS = {"control": 4_212_992, "frailt": 4_214_016, "three-part": 4_344_320, "relaxed": 5_462_272}
# Architectures that draw a random initial state every forward, and the argument that makes it zero: a KV-cached
# decode draws it per new token and a re-encoding for the whole sequence, so the two agree only without it.
NO_RANDOM_STATE = {"three-part": {"state_init_std": 0.0}, "huginn": {"state_std": 0.0}}
# Architectures that sample their training depth by default, and the argument that fixes it: one training forward
# then costs the FLOPs counted at that depth (with sampling, `flops_per_token` is the expectation over depths).
FIXED_TRAINING_DEPTH = {"huginn": {"sampling_scheme": "fixed"}}


def tokens(B: int, T: int, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)  # (B, T)


def seeded_logits(model: BaseLM, x: torch.Tensor, seed: int = 123, **kw) -> torch.Tensor:
    """Logits with the global RNG fixed first (three-part draws its initial state s0 from it every forward)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(x, **kw)[0]


def paper_model(arch: str, **overrides) -> BaseLM:
    cfg = make_config("paper", arch, overrides={f"model.{k}": v for k, v in overrides.items()})
    return architectures.build_shapes(arch, cfg.model)


# ---- registry -------------------------------------------------------------------------------------------------------


def test_names_order():
    assert NAMES[:4] == STUDY


def test_unknown_name_suggests(tiny_args):
    with pytest.raises(UnknownArchitectureError) as info:
        architectures.get("thre-part")
    assert str(info.value) == (
        "unknown architecture 'thre-part'; did you mean 'three-part'? available: " + ", ".join(NAMES)
    )
    with pytest.raises(UnknownArchitectureError) as info:
        architectures.build("transformer-xl", tiny_args("control"))
    assert "did you mean" not in str(info.value) and "available: control" in str(info.value)
    assert isinstance(info.value, KeyError)  # callers that catch KeyError keep working


def test_duplicate_registration_is_an_error():
    class Impostor(BaseLM):
        def schedule(self, h, cos, sin, n_recur, cache):
            return h

    with pytest.raises(ValueError, match="architecture 'control' is already registered"):
        architectures.register("control")(Impostor)
    assert architectures.get("control").__name__ == "Control"
    assert architectures.register("control")(architectures.get("control")) is architectures.get("control")
    with pytest.raises(TypeError, match="expects a BaseLM subclass"):
        architectures.register("not-a-model")(torch.nn.Linear)
    assert "not-a-model" not in architectures.names()


@pytest.fixture
def reversed_arch():
    """A fifth architecture registered for one test (blocks run B4..B1), removed from the registry afterwards."""

    class Reversed(BaseLM):
        label = "Reversed"

        @classmethod
        def max_n_recur(cls, args):
            return 1

        def schedule(self, h, cos, sin, n_recur, cache):
            for layer in reversed(self.layers):
                h = layer(h, cos, sin, cache=cache)
            return h

    name = "zz-test-reversed"
    architectures.register(name)(Reversed)
    yield name, Reversed
    architectures._REGISTRY.pop(name)
    assert name not in architectures.names()


def test_registering_a_new_architecture_is_picked_up(reversed_arch, tiny_args):
    name, cls = reversed_arch
    assert architectures.names() == NAMES + [name]  # the names registered at start-up, then the new one
    cfg = make_config("tiny", name)  # the config layer accepts it too
    torch.manual_seed(0)
    model = architectures.build(name, cfg.model)
    assert type(model) is cls and model.name == name
    torch.manual_seed(0)
    control = architectures.build("control", tiny_args("control"))
    model.load_state_dict(control.state_dict())
    x = tokens(1, 8)
    assert not torch.allclose(model(x)[0], control(x)[0])  # its own schedule runs
    assert model.param_report()["total"] == control.param_report()["total"]


# ---- parameter accounting -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", STUDY)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_paper_totals_exact(arch):
    rep = paper_model(arch).param_report()
    assert rep["total"] == PAPER_TOTALS[arch]
    assert sum(rep["components"].values()) == rep["total"]


def test_paper_components_match_spec_formulas():
    V, d, L, h, R, r = 4096, 256, 4, 688, 4, 16
    p_blk = 4 * d * d + 3 * d * h + 2 * d
    assert p_blk == 791_040
    common = {"embedding": V * d, "blocks": L * p_blk, "final_norm": d}
    reps = {a: paper_model(a).param_report() for a in STUDY}
    assert reps["control"]["components"] == common
    assert reps["frailt"]["components"] == {**common, "depth_encoding": R * d}
    assert R * d == 1_024
    assert reps["three-part"]["components"] == {**common, "adapter": 2 * d * d, "recurrent_norm": d}
    assert (2 * d * d, d) == (131_072, 256)
    assert reps["relaxed"]["components"] == {**common, "lora": R * L * r * (8 * d + 3 * (d + h))}
    assert R * L * r * (8 * d + 3 * (d + h)) == 1_249_280
    # Effective (unrolled) parameters: what one token passes through at the trained recurrence.
    assert reps["control"]["effective"] == V * d + L * p_blk + d
    assert reps["frailt"]["effective"] == V * d + R * L * p_blk + R * d + d
    assert reps["three-part"]["effective"] == V * d + (2 + 7 * 2) * p_blk + 7 * 2 * d * d + d + d
    assert reps["relaxed"]["effective"] == V * d + R * L * p_blk + 1_249_280 + d
    assert reps["frailt"]["effective"] == 13_706_496
    assert reps["three-part"]["effective"] == 14_623_232
    # at a test-time recurrence the effective count follows it
    assert paper_model("three-part").param_report(n_recur=3)["effective"] == V * d + 8 * p_blk + 3 * 2 * d * d + 2 * d


def test_three_part_recur_out_bias_gives_same_total():
    rep = paper_model("three-part", recur_out="bias").param_report()
    assert rep["total"] == PAPER_TOTALS["three-part"]
    assert rep["components"]["adapter"] == 2 * 256 * 256 + 256 and "recurrent_norm" not in rep["components"]


def test_weight_sharing_is_one_module_per_block():
    # Sharing is one module called in a loop: no architecture holds more than the n_layers unique blocks.
    for arch in STUDY:
        model = paper_model(arch)
        blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
        assert len(blocks) == 4
        assert model.tok_embeddings.weight is model.output.weight  # tied head


# ---- FLOPs ----------------------------------------------------------------------------------------------------------


def counted_flops_per_token(
    model: BaseLM, x: torch.Tensor, backward: bool = True, **kw
) -> tuple[float, architectures.base.ForwardStats]:
    """What torch.utils.flop_counter counts for one forward (+ backward) of x (B, T), per token, and what that forward
    reported. The backward is the trainer's: of cross-entropy + the weighted auxiliary terms (part of a model's graph
    may hang off an auxiliary term alone, e.g. deep supervision's earlier answers). SDPA is forced to the math
    backend: the CPU flash kernel has no FLOP formula registered, the math one decomposes into matmuls."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(x, x, **kw)
        stats = model.take_stats()
        if backward:
            aux = stats.aux_total()
            (loss if aux is None else loss + aux).backward()
    return counter.get_total_flops() / x.numel(), stats


FLOP_CASES = [(a, FIXED_TRAINING_DEPTH.get(a, {}), {}) for a in NAMES] + [
    ("three-part", {"backprop_depth": 3}, {}),  # truncated: forward of all 7 iterations, backward of the last 3
    ("three-part", {"backprop_depth": 9}, {}),  # k > r: everything takes part in backward
    ("three-part", {}, {"n_recur": 2}),
    ("frailt", {}, {"n_recur": 2}),
    ("relaxed", {"n_kv_heads": 1}, {"n_recur": 3}),  # grouped-query attention, LoRA on smaller wk/wv
    ("control", {"n_layers": 2, "hidden_dim": 40}, {}),
]


@pytest.mark.parametrize("arch,overrides,kw", FLOP_CASES)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_flops_per_token_match_flop_counter(arch, overrides, kw, tiny_model):
    model = tiny_model(arch, **overrides).train()
    T = 16  # below the context, so the formula must use the actual sequence length
    x = tokens(2, T)
    torch.manual_seed(0)
    counted, stats = counted_flops_per_token(model, x, **kw)
    # what the forward reports it ran (the analytic count for an architecture that reports nothing), and the
    # analytic count as its upper bound
    spent = model.spent_flops_per_token(stats, T, kw.get("n_recur"))
    assert spent == counted and spent <= model.flops_per_token(T, **kw)
    if not type(model).reports_stats:
        assert model.flops_per_token(T, **kw) == counted
    # forward only: work without gradients counts once
    model.zero_grad()
    with torch.no_grad():
        counted_fwd, stats = counted_flops_per_token(model, x, backward=False, **kw)
    assert model.spent_flops_per_token(stats, T, kw.get("n_recur"), training=False) == counted_fwd
    if type(model).reports_stats:  # a forward-only forward costs 1x, even counted as training
        assert model.spent_flops_per_token(stats, T, kw.get("n_recur"), training=True) == counted_fwd
    else:
        assert model.flops_per_token(T, training=False, **kw) == counted_fwd


@pytest.mark.parametrize("arch", STUDY)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_paper_flops_match_flop_counter_on_meta(arch):
    with torch.device("meta"):  # counted on meta: a paper model's activations need no memory
        model = architectures.build(arch, make_config("paper", arch).model).train()
        x = torch.zeros(1, 128, dtype=torch.long)
    assert model.flops_per_token(128) == counted_flops_per_token(model, x)[0]


def test_flops_reflect_recurrence():
    f = {a: paper_model(a).flops_per_token() for a in STUDY}
    # 16 block passes vs the control's 4: about 4x the block compute (the head is shared), never 6 * N_unique.
    for a in ("frailt", "three-part", "relaxed"):
        assert 3.0 < f[a] / f["control"] < 4.0
    assert f["control"] < f["frailt"] < f["three-part"] < f["relaxed"]
    assert f["frailt"] != pytest.approx(6 * PAPER_TOTALS["frailt"], rel=0.2)


# ---- behaviour, every architecture ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", NAMES)
def test_forward_shapes_and_initial_loss(arch, tiny_model):
    model = tiny_model(arch)
    x, y = tokens(3, 20), tokens(3, 20, seed=1)
    torch.manual_seed(0)
    logits, loss = model(x, y)
    assert logits.shape == (3, 20, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(512)) < 0.3  # llama2.c init: near-uniform predictions
    assert model(x)[1] is None
    y_masked = y.clone()
    y_masked[:, :10] = -1  # ignore_index -1, as llama2.c
    ref = F.cross_entropy(logits[:, 10:].reshape(-1, 512), y[:, 10:].reshape(-1))
    torch.manual_seed(0)  # the same s0 for three-part
    torch.testing.assert_close(model(x, y_masked)[1], ref)
    with pytest.raises(ValueError, match="exceeds the context of 32"):
        model(tokens(1, 33))


def assert_causal(model: BaseLM, mode: str) -> None:
    """Changing token t never changes the logits, or the loss over the targets, before t (in `mode`).

    Bit for bit, except for an architecture that routes tokens (`reports_stats`): it runs a block over the tokens
    routed to it as a shorter sequence whose length a later token can change, and a matmul of another shape rounds
    differently; for it the earlier values must agree to float32 rounding."""
    model.train(mode == "train")
    T = 16
    x, y = tokens(2, T), tokens(2, T, seed=1)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if type(model).reports_stats:
            return torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        return torch.equal(a, b)

    base = seeded_logits(model, x)
    for t in (1, 7, T - 1):
        x2 = x.clone()
        x2[:, t] = (x2[:, t] + 1) % 512
        out = seeded_logits(model, x2)
        assert same(out[:, :t], base[:, :t]), f"{mode} mode: position < {t} saw token {t}"
        assert not torch.allclose(out[:, t], base[:, t])  # the change is visible where it may be
        before = y.clone()
        before[:, t:] = -1  # the loss over the positions before t only
        torch.manual_seed(1)
        with torch.no_grad():
            ref = model(x, before)[1]
        torch.manual_seed(1)
        with torch.no_grad():
            assert same(model(x2, before)[1], ref), f"{mode} mode: the loss before {t} saw token {t}"
    model.eval()


@pytest.mark.parametrize("arch", NAMES)
def test_causality(arch, tiny_model):
    """The declared causality contract: a causal training forward (checked in train mode), or the causal inference
    rule the architecture names (checked in eval mode, which evaluation and generation use)."""
    model = tiny_model(arch)
    cls = type(model)
    if cls.causal_training:
        assert_causal(model, "train")
    else:
        assert cls.inference_rule.strip(), f"{arch}: a non-causal training forward must name its inference rule"
    assert_causal(model, "eval")


@pytest.mark.parametrize("arch", NAMES)
def test_forward_stats(arch, tiny_model):
    """What a forward reports beyond its loss: every auxiliary term a finite scalar that carries gradients in
    training, metrics finite scalars with the same names in every forward, the compute it ran within the analytic
    bound; each forward starts afresh, and an architecture that reports nothing has empty stats."""
    model = tiny_model(arch).train()
    x, y = tokens(2, 16), tokens(2, 16, seed=1)
    names = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model(tokens(2, 16, seed=seed), y)
        stats = model.take_stats()
        assert model.take_stats() == architectures.base.ForwardStats()  # taken: forgotten
        names.append((sorted(stats.aux), sorted(stats.metrics)))
        for name, (term, weight) in stats.aux.items():
            assert term.ndim == 0 and torch.isfinite(term) and term.requires_grad, name
            assert math.isfinite(weight) and weight >= 0, name
        assert all(math.isfinite(v) for v in stats.scalars().values())
        assert model.spent_flops_per_token(stats, 16) <= model.flops_per_token(16) * (1 + 1e-12)
        if not type(model).reports_stats:
            assert stats == architectures.base.ForwardStats()
            assert stats.aux_total() is None and stats.scalars() == {}
    assert names[0] == names[1]
    if type(model).reports_stats:  # two forwards without a take in between: the second one's stats only
        torch.manual_seed(0)
        model(x, y)
        torch.manual_seed(0)
        model(x, y)
        twice = model.take_stats()
        torch.manual_seed(0)
        model(x, y)
        once = model.take_stats()
        assert twice.scalars() == once.scalars() and twice.compute == once.compute


def test_a_block_runs_over_tokens_gathered_at_their_own_positions(tiny_model):
    """Rotary tables per row (B, T, hd/2): a block over tokens gathered from each sequence (a router's selection)
    computes, row by row, what it computes over that row alone with the row's positions."""
    model = tiny_model("control")
    x = model.tok_embeddings(tokens(2, 10))
    idx = torch.tensor([[0, 2, 3, 7], [1, 4, 8, 9]])
    gathered = torch.gather(x, 1, idx[..., None].expand(2, 4, x.shape[-1]))
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        both = model.layers[0](gathered, cos[idx], sin[idx])
        for b in range(2):
            alone = model.layers[0](gathered[b : b + 1], cos[idx[b]], sin[idx[b]])
            torch.testing.assert_close(both[b : b + 1], alone, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(both, model.layers[0](gathered, cos[:4], sin[:4]))  # the positions matter


def test_reporting_stats_must_be_declared(tiny_model):
    model = tiny_model("control")
    with pytest.raises(TypeError, match="reports_stats = True"):
        model.add_metric("x", 1.0)


@pytest.mark.parametrize("arch", NAMES)
def test_same_seed_same_weights(arch, tiny_model):
    a, b, c = tiny_model(arch, seed=5), tiny_model(arch, seed=5), tiny_model(arch, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_embeddings.weight"], sc["tok_embeddings.weight"])


@pytest.mark.parametrize("arch", NAMES)
def test_init_follows_llama2c(arch, tiny_model):
    model = tiny_model(arch, seed=0)
    std_scaled = 0.02 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.startswith("layers.") and name.endswith(("wo.weight", "w3.weight")):
            assert p.std().item() == pytest.approx(std_scaled, rel=0.25), name
        elif name.startswith("layers.") and name.endswith(("wq.weight", "w1.weight", "w2.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.25), name
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name


@pytest.mark.parametrize("arch", NAMES)
def test_kv_cache_matches_full_forward(arch, tiny_model):
    overrides = NO_RANDOM_STATE.get(arch, {})
    model = tiny_model(arch, **overrides)
    x = tokens(2, 14)
    with torch.no_grad():
        full = model(x)[0]
        cache = KVCache(model.args.max_seq_len)
        parts = [model(x[:, :5], cache=cache)[0], model(x[:, 5:9], cache=cache)[0]]  # prompt, then a chunk
        parts += [model(x[:, i : i + 1], cache=cache)[0] for i in range(9, 14)]  # then one token at a time
    assert cache.pos == 14
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_select_rows_continues_the_kept_sequences(tiny_model):
    model = tiny_model("relaxed")  # a recurrent model: several slots per block
    x = tokens(3, 9)
    with torch.no_grad():
        alone = model(x[1:2])[0]
        cache = KVCache(32)
        model(x[:, :6], cache=cache)
        cache.select_rows(torch.tensor([1]))  # rows 0 and 2 finished
        rest = model(x[1:2, 6:], cache=cache)[0]
    torch.testing.assert_close(rest, alone[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["frailt", "three-part", "relaxed", "huginn"])
def test_kv_cache_at_recurrence_override(arch, tiny_model):
    model = tiny_model(arch, **NO_RANDOM_STATE.get(arch, {}))
    x = tokens(1, 6)
    with torch.no_grad():
        full = model(x, n_recur=2)[0]
        cache = KVCache(32)
        inc = torch.cat([model(x[:, i : i + 1], n_recur=2, cache=cache)[0] for i in range(6)], dim=1)
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def greedy_by_full_forward(model: BaseLM, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Reference decoder: re-encode the last max_seq_len tokens for every new token, no cache (llama2.c sampler)."""
    seq = idx
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq[:, -model.args.max_seq_len :])[0]
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, idx.shape[1] :]


def generated(model: BaseLM, idx: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """The routine's tokens for prompts idx (B, T) as a (B, n) tensor (every row must run to the full length)."""
    outs = generate(model, idx.tolist(), max_new_tokens=n, **kw)
    assert all(o.finish_reason == "length" and len(o.tokens) == n for o in outs)
    return torch.tensor([o.tokens for o in outs], dtype=torch.long)


@pytest.mark.parametrize("arch", NAMES)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_generate(arch, tiny_model):
    overrides = NO_RANDOM_STATE.get(arch, {})
    model = tiny_model(arch, **overrides)
    prompt = tokens(2, 6)

    def gens(seed):
        return [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)]

    # sampling: shape, reproducible with the same generators
    new = generated(model, prompt, 7, temperature=1.0, top_k=20, generators=gens(1))
    assert torch.equal(new, generated(model, prompt, 7, temperature=1.0, top_k=20, generators=gens(1)))
    assert new.shape == (2, 7) and ((0 <= new) & (new < 512)).all()
    assert generated(model, prompt, 3, temperature=0.8, top_p=0.9, generators=gens(2)).shape == (2, 3)
    # greedy with the KV cache equals greedy by re-encoding
    assert torch.equal(generated(model, prompt, 10, temperature=0.0), greedy_by_full_forward(model, prompt, 10))
    # sliding beyond the context: 28 + 12 tokens > 32 (the cache fills, then the window slides)
    long_prompt = tokens(2, 28, seed=3)
    slid = generated(model, long_prompt, 12, temperature=0.0)
    assert torch.equal(slid, greedy_by_full_forward(model, long_prompt, 12))
    # a prompt longer than the context is cut to its last max_seq_len tokens
    over = generated(model, tokens(1, 40, seed=4), 3, temperature=0.0)
    assert torch.equal(over, greedy_by_full_forward(model, tokens(1, 40, seed=4)[:, -32:], 3))
    # nothing to generate for no prompt; a count below one, an empty prompt or a generator short are errors
    assert generate(model, [], max_new_tokens=3) == []
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, prompt.tolist(), max_new_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], max_new_tokens=1)
    with pytest.raises(ValueError, match="1 generators for 2 prompts"):
        generate(model, prompt.tolist(), max_new_tokens=1, generators=[None])


@pytest.mark.parametrize("arch", NAMES)
def test_generate_stops_at_a_stop_id_or_when_asked(arch, tiny_model):
    overrides = NO_RANDOM_STATE.get(arch, {})
    model = tiny_model(arch, **overrides)
    prompt = tokens(2, 5).tolist()
    free = generated(model, torch.tensor(prompt), 6, temperature=0.0).tolist()
    stop = free[0][2]  # row 0 emits it at step 2 (or earlier, if it also came before)
    outs = generate(model, prompt, max_new_tokens=6, temperature=0.0, stop_ids=(stop,))
    for row, out in zip(free, outs):  # the stop id ends its row and is not kept; the other row runs on
        cut = row.index(stop) if stop in row else None
        assert out == (Generation(row[:cut], "eos") if cut is not None else Generation(row, "length"))
    # should_stop sees the row's index and its new tokens so far; True ends the row keeping the token
    asked: list[tuple[int, list[int]]] = []

    def at_three(i: int, new: list[int]) -> bool:
        asked.append((i, list(new)))
        return i == 1 and len(new) == 3

    outs = generate(model, prompt, max_new_tokens=6, temperature=0.0, should_stop=at_three)
    assert outs == [Generation(free[0], "length"), Generation(free[1][:3], "eos")]
    assert (1, free[1][:3]) in asked and (0, free[0][:6]) in asked and not any(i == 1 and len(n) > 3 for i, n in asked)


def test_generate_draws_like_the_single_row_sampler(tiny_model):
    # One row, one generator: the same draws as sampling token by token with `sample_next` on full forwards.
    model = tiny_model("frailt")
    prompt = tokens(1, 5, seed=7)
    out = generate(
        model,
        prompt.tolist(),
        max_new_tokens=8,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        generators=[torch.Generator().manual_seed(5)],
    )
    g, seq = torch.Generator().manual_seed(5), prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = sample_next(model(seq)[0][:, -1, :], 0.9, 40, 0.95, g)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    assert out[0].tokens == seq[0, 5:].tolist()


def test_frailt_one_zero_pass_equals_control(tiny_model):
    control = tiny_model("control", seed=0)
    frailt = tiny_model("frailt", seed=1)
    assert frailt.arch_args.frailt_init == "zeros" and frailt.args.n_recur == 4
    missing, unexpected = frailt.load_state_dict(control.state_dict(), strict=False)
    assert missing == ["iter_emb"] and unexpected == []
    assert torch.count_nonzero(frailt.iter_emb) == 0
    x = tokens(2, 12)
    with torch.no_grad():
        assert torch.equal(frailt(x, n_recur=1)[0], control(x)[0])
        assert not torch.allclose(frailt(x)[0], control(x)[0])  # four passes are a different model
        frailt.iter_emb[0].normal_(0, 0.02)
        assert not torch.allclose(frailt(x, n_recur=1)[0], control(x)[0])  # the encoding is really added


def test_frailt_schedule_by_hand(tiny_model):
    model = tiny_model("frailt", frailt_init="normal")
    assert torch.count_nonzero(model.iter_emb) == model.iter_emb.numel()
    x = tokens(2, 10)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    with torch.no_grad():
        h = model.tok_embeddings(x)
        for t in range(4):
            h = h + model.iter_emb[t]
            for layer in model.layers:
                h = layer(h, cos, sin)
        ref = model.output(model.norm(h))
        torch.testing.assert_close(model(x)[0], ref, rtol=0, atol=0)


def looped_by_hand(model: BaseLM, x: torch.Tensor, n_recur: int, blocks=None) -> torch.Tensor:
    """The plain looped model: n_recur passes over the shared blocks (or over per-pass block lists)."""
    T = x.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    h = model.tok_embeddings(x)
    for t in range(n_recur):
        for layer in blocks[t] if blocks is not None else model.layers:
            h = layer(h, cos, sin)
    return model.output(model.norm(h))


def test_relaxed_zero_lora_equals_plain_looped_model(tiny_model):
    model = tiny_model("relaxed")
    loras = [m for m in model.modules() if isinstance(m, architectures.blocks.LoRA)]
    assert len(loras) == 4 * 4 * 7
    assert all(torch.count_nonzero(m.B) == 0 and torch.count_nonzero(m.A) > 0 for m in loras)
    x = tokens(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], looped_by_hand(model, x, 4), rtol=0, atol=0)
        torch.testing.assert_close(model(x, n_recur=2)[0], looped_by_hand(model, x, 2), rtol=0, atol=0)


def test_relaxed_lora_is_a_per_pass_weight_delta(tiny_model):
    # With B != 0, pass t / block l must equal the shared block with W + (alpha/r) B_{l,t} A_{l,t} on every projection.
    model = tiny_model("relaxed", lora_alpha=2.0)  # rank 4 -> scale 0.5
    with torch.no_grad():
        for m in model.lora.modules():
            if isinstance(m, architectures.blocks.LoRA):
                m.B.normal_(0, 0.05)
        merged = []
        for t in range(4):
            row = []
            for li, layer in enumerate(model.layers):
                blk = copy.deepcopy(layer)
                for p in PROJECTIONS:
                    lin = getattr(blk.attention, p) if p in ("wq", "wk", "wv", "wo") else getattr(blk.feed_forward, p)
                    lora = model.lora[t][li][p]
                    assert lora.scale == 0.5
                    lin.weight += lora.scale * lora.B @ lora.A
                row.append(blk)
            merged.append(row)
        x = tokens(2, 12)
        out = model(x)[0]
        torch.testing.assert_close(out, looped_by_hand(model, x, 4, blocks=merged), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(out, looped_by_hand(model, x, 4), atol=1e-4)


def test_three_part_schedule_by_hand(tiny_model):
    model = tiny_model("three-part")
    a = model.arch_args
    assert (model.args.n_recur, a.n_prelude, a.n_coda, a.state_init_std) == (7, 1, 1, 0.02)
    x = tokens(2, 10)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    with torch.no_grad():
        torch.manual_seed(9)
        e = model.layers[0](model.tok_embeddings(x), cos, sin)
        s = torch.randn_like(e) * 0.02  # s0 ~ N(0, sigma^2), (B, T, d)
        for _ in range(7):
            s = model.adapter(torch.cat([s, e], dim=-1))  # W_ad [s ; e]
            s = model.layers[2](model.layers[1](s, cos, sin), cos, sin)
        s = model.layers[3](model.recur_norm(s), cos, sin)
        ref = model.output(model.norm(s))
        torch.testing.assert_close(seeded_logits(model, x, seed=9), ref, rtol=0, atol=0)
    # s0 is fresh every forward: two unseeded forwards differ, the seeded ones above do not
    with torch.no_grad():
        assert not torch.equal(model(x)[0], model(x)[0])


def test_three_part_recurrence_override(tiny_model):
    model = tiny_model("three-part")
    x = tokens(2, 10)
    outs = {r: seeded_logits(model, x, n_recur=r) for r in (1, 2, 7, 20)}
    assert all(torch.isfinite(o).all() for o in outs.values())
    assert torch.equal(outs[7], seeded_logits(model, x))  # the default is the trained r = 7
    rs = list(outs)
    for i, r1 in enumerate(rs):
        for r2 in rs[i + 1 :]:
            assert not torch.allclose(outs[r1], outs[r2]), (r1, r2)
    with pytest.raises(RecurrenceError, match="n_recur must be >= 1"):
        model(x, n_recur=0)


@pytest.mark.parametrize("arch", ["frailt", "relaxed"])
def test_recurrence_past_the_trained_depth(arch, tiny_model):
    """Depths up to R use the trained schedule; past R the inference-only extrapolation rule applies."""
    model = tiny_model(arch)
    x = tokens(1, 8)
    outs = [model(x, n_recur=r)[0] for r in (1, 2, 3, 4)]
    assert torch.equal(outs[-1], model(x)[0])
    assert not torch.allclose(outs[0], outs[-1])
    assert torch.isfinite(model(x, n_recur=8)[0]).all()
    assert torch.equal(model(x, n_recur=8)[0], model(x, n_recur=8, extrapolate=model.extrapolate_rules[0])[0])
    with pytest.raises(RecurrenceError, match="extrapolate must be one of"):
        model(x, n_recur=8, extrapolate="bogus")
    with pytest.raises(RecurrenceError, match="n_recur must be >= 1"):
        model(x, n_recur=0)


def test_control_has_no_recurrence(tiny_model):
    model = tiny_model("control")
    x = tokens(1, 8)
    assert torch.equal(model(x, n_recur=1)[0], model(x)[0])
    with pytest.raises(RecurrenceError, match="at most 1"):
        model(x, n_recur=2)


class CountAdapterCalls:
    """Counts the three-part core iterations of each forward (one adapter call per iteration) and how many of them
    build an autograd graph."""

    def __init__(self, model: BaseLM):
        self.calls: list[bool] = []
        self.handle = model.adapter.register_forward_hook(lambda m, i, o: self.calls.append(o.requires_grad))

    def take(self) -> list[bool]:
        out, self.calls = self.calls, []
        return out


def test_three_part_sampled_depth(tiny_model):
    model = tiny_model("three-part", recur_sampling="poisson-lognormal")
    counter = CountAdapterCalls(model)
    x = tokens(1, 8)
    torch.manual_seed(0)
    model.train()
    depths = []
    for _ in range(24):
        model(x)
        depths.append(len(counter.take()))
    assert min(depths) >= 1 and len(set(depths)) > 3  # varies per training step
    # Huginn: r = Poisson(tau) + 1 with E[tau] = r_bar = 7
    assert 5.0 < sum(depths) / len(depths) < 11.0
    model.eval()
    for _ in range(3):
        with torch.no_grad():
            model(x)
        assert len(counter.take()) == 7  # fixed at evaluation
    with torch.no_grad():
        model(x, n_recur=3)
    assert len(counter.take()) == 3
    # "fixed" (the paper default) never samples, even in train mode
    fixed = tiny_model("three-part").train()
    fixed_counter = CountAdapterCalls(fixed)
    for _ in range(3):
        fixed(x)
        assert len(fixed_counter.take()) == 7


@pytest.mark.parametrize("backprop_depth", [0, 2])
def test_three_part_sampled_depth_flops_are_the_expectation(tiny_model, backprop_depth):
    model = tiny_model("three-part", recur_sampling="poisson-lognormal", backprop_depth=backprop_depth)
    dist = dict(model.depth_distribution())
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(r * p for r, p in dist.items()) == pytest.approx(8.0, rel=1e-6)  # E[r] = r_bar + 1
    torch.manual_seed(0)
    draws = [model.sample_n_recur() for _ in range(20_000)]
    for r in (1, 4, 8, 12):  # the quadrature's pmf is the sampler's
        assert draws.count(r) / len(draws) == pytest.approx(dist[r], abs=0.01)
    expected = model.flops_per_token()
    monte_carlo = sum(model.flops_per_token(n_recur=r) for r in draws) / len(draws)
    assert expected == pytest.approx(monte_carlo, rel=0.01)
    if backprop_depth == 0:  # FLOPs are affine in r: the expectation is the count at the mean depth
        assert expected == pytest.approx(model.flops_per_token(n_recur=8), rel=1e-9)
        # a given depth, and inference (which runs r_bar), keep the fixed count
        assert model.flops_per_token(n_recur=7) == tiny_model("three-part").flops_per_token()
    assert model.flops_per_token(training=False) == tiny_model("three-part").flops_per_token(training=False)


def test_three_part_truncated_backprop(tiny_model):
    full = tiny_model("three-part", seed=3).train()
    trunc = tiny_model("three-part", seed=0, backprop_depth=2).train()
    trunc.load_state_dict(full.state_dict())
    x, y = tokens(2, 10), tokens(2, 10, seed=1)
    c_full, c_trunc = CountAdapterCalls(full), CountAdapterCalls(trunc)

    def loss_and_grads(model):
        model.zero_grad()
        torch.manual_seed(11)
        logits, loss = model(x, y)
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    l_full, g_full = loss_and_grads(full)
    l_trunc, g_trunc = loss_and_grads(trunc)
    assert torch.equal(l_trunc, l_full)  # same forward values
    assert c_full.take() == [True] * 7
    assert c_trunc.take() == [False] * 5 + [True] * 2  # the first 5 iterations build no graph
    assert not torch.allclose(g_trunc["layers.1.attention.wq.weight"], g_full["layers.1.attention.wq.weight"])
    assert torch.equal(g_trunc["layers.3.attention.wq.weight"], g_full["layers.3.attention.wq.weight"])  # coda

    # Reference: the same forward with the state detached after 5 iterations gives exactly the truncated gradients.
    trunc.zero_grad()
    model, a = trunc, trunc.arch_args
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    torch.manual_seed(11)
    e = model.layers[0](model.tok_embeddings(x), cos, sin)
    s = torch.randn_like(e) * a.state_init_std
    for i in range(7):
        if i == 5:
            s = s.detach()
        s = model.layers[2](model.layers[1](model.adapter(torch.cat([s, e], -1)), cos, sin), cos, sin)
    logits = model.output(model.norm(model.layers[3](model.recur_norm(s), cos, sin)))
    F.cross_entropy(logits.view(-1, 512), y.view(-1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_trunc[n], rtol=1e-5, atol=1e-7, msg=n)

    # k >= r: nothing is truncated; eval mode never truncates
    whole = tiny_model("three-part", backprop_depth=7).train()
    whole.load_state_dict(full.state_dict())
    _, g_whole = loss_and_grads(whole)
    assert all(torch.equal(g_whole[n], g_full[n]) for n in g_full)
    trunc.eval()
    c_trunc.take()
    trunc(x)
    assert c_trunc.take() == [True] * 7


# ---- attention on a CPU (architectures.kernels.causal_attention) ----------------------------------------------------


@pytest.mark.parametrize("T", [2, 17, 64, 128])
def test_causal_attention_is_the_fused_kernels_function(T):
    """The explicit CPU attention (bf16 inputs, chunked rows) computes what F.scaled_dot_product_attention does:
    outputs and gradients within bf16 rounding of the fused kernel's on the same bf16 inputs, and of float32 maths."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(5, 4, T, 16, generator=g) for _ in range(3))
    grad = torch.randn(5, 4, T, 16, generator=g)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
    halves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    fused = F.scaled_dot_product_attention(*halves, is_causal=True)
    fused_grads = torch.autograd.grad(fused, halves, grad.bfloat16())
    out = causal_attention(*halves)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), fused.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(torch.autograd.grad(out, halves, grad.bfloat16()), fused_grads):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="torch.compile on a CPU needs a C++ compiler",
)
@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_compiled_causal_attention_is_the_eager_function():
    """Under torch.compile the explicit CPU attention is written whole for inductor: outputs and gradients within
    bf16 rounding of the eager chunked kernel's (and it compiles without a graph break: fullgraph)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 4, 24, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(3, 4, 24, 16, generator=g).bfloat16()
    eager = causal_attention(q, k, v)
    compiled = torch.compile(causal_attention, fullgraph=True, dynamic=False)(q, k, v)
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled.float(), eager.float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(torch.autograd.grad(compiled, (q, k, v), grad), torch.autograd.grad(eager, (q, k, v), grad)):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("T", [1, 3])
def test_compiled_cached_attention_is_the_fused_function(T):
    """The decode path's attention over a static cache, written out under torch.compile, computes what the fused
    kernel does, grouped query heads and the mask included (aot_eager traces it as inductor would see it, without
    building C++)."""
    from architectures.blocks import cached_attention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, T, 8, generator=g)
    ck, cv = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    pos = torch.arange(4, 4 + T)  # the cache holds positions 0 .. 3 + T; the rest of its slots are not yet written
    mask = torch.arange(10)[None, :] <= pos[:, None]
    fused = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(cached_attention(q, ck, cv, mask), fused)
    compiled = torch.compile(cached_attention, backend="aot_eager", fullgraph=True)(q, ck, cv, mask)
    torch.testing.assert_close(compiled, fused, atol=1e-5, rtol=1e-5)


def test_causal_attention_keeps_the_fused_kernel_where_it_is_faster(monkeypatch):
    """float32, and bf16 past CPU_EXPLICIT_ATTENTION_MAX_T: PyTorch's fused kernel."""
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or a[0])
    for t in (torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, CPU_EXPLICIT_ATTENTION_MAX_T + 1, 8, dtype=torch.bfloat16)):
        causal_attention(t, t, t)
    assert calls == [{"dropout_p": 0.0, "is_causal": True}] * 2


# ---- the head's loss without logits (architectures.kernels.linear_cross_entropy) -------------------------------------


def _head_problem(N: int = 300, d: int = 24, V: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g).requires_grad_()
    w = (torch.randn(V, d, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -1  # ignored targets, scattered over the chunks
    return h, w, t


@pytest.mark.parametrize("block_rows", [None, 24])  # None: one block per chunk at V = 97; 24: several, one short
@pytest.mark.parametrize("chunk", [64, 128, 300, 1000])  # 300 % 64 != 0: a short last chunk
def test_linear_cross_entropy_is_the_cross_entropy_of_the_head(chunk, block_rows, monkeypatch):
    h, w, t = _head_problem()
    if block_rows:  # the CPU's cache-sized blocks of rows within a chunk
        monkeypatch.setattr(kernels, "CPU_LOSS_BLOCK_BYTES", 4 * w.shape[0] * block_rows)
    ref = F.cross_entropy(F.linear(h, w), t, ignore_index=-1)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    loss = linear_cross_entropy(h, w, t, chunk)
    gh, gw = torch.autograd.grad(loss, (h, w), retain_graph=True)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)
    gh2, _ = torch.autograd.grad(loss * 3.0, (h, w))  # a second backward, scaled: the saved gradients are intact
    torch.testing.assert_close(gh2, 3.0 * ref_gh)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk), ref)


def test_linear_cross_entropy_edge_cases():
    h, w, t = _head_problem(N=10)
    only_w = linear_cross_entropy(h.detach(), w, t)  # gradient for the weight alone
    (gw,) = torch.autograd.grad(only_w, (w,))
    (ref_gw,) = torch.autograd.grad(F.cross_entropy(F.linear(h.detach(), w), t, ignore_index=-1), (w,))
    torch.testing.assert_close(gw, ref_gw)
    ignored = torch.full_like(t, -1)
    assert torch.isnan(linear_cross_entropy(h, w, ignored)) and torch.isnan(
        F.cross_entropy(F.linear(h, w), ignored, ignore_index=-1)
    )


@pytest.mark.parametrize("block_rows", [None, 24])
def test_linear_cross_entropy_under_autocast_matches_autocast_autograd(block_rows, monkeypatch):
    """The dtype logic CUDA's bf16 autocast uses (matmuls in bf16, softmax in float32, float32 weight gradient),
    run on the CPU's bf16 autocast."""
    h, w, t = _head_problem(N=200, d=32, V=64)
    if block_rows:
        monkeypatch.setattr(kernels, "CPU_LOSS_BLOCK_BYTES", 4 * w.shape[0] * block_rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)
        loss = linear_cross_entropy(h, w, t, chunk=64)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gh, ref_gh, rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(gw, ref_gw, rtol=5e-2, atol=2e-3)


@pytest.mark.parametrize("into", [False, True])  # into: the softmax written into a given tensor
@pytest.mark.parametrize("check_tiny", [True, False])
def test_softmax_and_target_logp_is_exact_for_sure_and_unsure_rows(check_tiny, into):
    """Both ways (the CPU's log of the softmax entry, the GPU's log-softmax) give F.log_softmax's target entries,
    also for rows whose target lies hundreds of nats below the best logit (its softmax entry is 0 in float32)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    idx = torch.randint(0, 50, (6, 1), generator=g)
    logits[1, idx[1, 0]] = -400.0  # a softmax entry of exp(-400): 0 in float32
    logits[4, idx[4, 0]] = -75.0  # ~1e-33: subnormal-adjacent, below the threshold
    out = torch.full((8, 50), 7.0)[1:7] if into else None  # a view, as the loss's blocks are
    p, logp_t = softmax_and_target_logp(logits, idx, check_tiny=check_tiny, out=out)
    ref = F.log_softmax(logits, dim=-1)
    if into:
        assert p.data_ptr() == out.data_ptr()
    torch.testing.assert_close(p, ref.exp())
    torch.testing.assert_close(logp_t, ref.gather(1, idx).squeeze(1))
    assert torch.isfinite(logp_t).all() and logp_t[1] < -390


def test_linear_cross_entropy_without_ignored_targets():
    """With no target ignored, the CPU skips masking the gradient rows: the same loss and gradients."""
    h, w, t = _head_problem()
    t = t.clamp(min=0)
    ref = F.cross_entropy(F.linear(h, w), t)
    loss = linear_cross_entropy(h, w, t, 64)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("block_rows", [None, 10])  # None: one block; 10: three blocks of the 27 rows, one short
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_rms_norm_is_llama2c_norm(out_dtype, block_rows, monkeypatch):
    """kernels.rms_norm: forward bitwise llama2.c's float32 expression (rounded once to out_dtype), gradients within
    float32 rounding of autograd's through that expression."""
    if block_rows:
        monkeypatch.setattr(kernels, "CPU_NORM_BLOCK_BYTES", 4 * 40 * block_rows)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 9, 40, generator=g) * 3).requires_grad_()
    w = (torch.rand(40, generator=g) + 0.5).requires_grad_()
    ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    ref = ref if out_dtype is None else ref.to(out_dtype)
    out = rms_norm(x, w, 1e-5, out_dtype)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    grad = torch.randn(3, 9, 40, generator=g).to(ref.dtype)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w), grad)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(rms_norm(x, w.detach(), 1e-5, out_dtype), (x,), grad)  # the weight frozen
    torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)


def test_norms_that_feed_matmuls_write_the_autocast_dtype():
    """Under bf16 autocast a block's pre-norms and the final norm hand their matmuls bf16 (the values the matmul's
    own cast would make); a norm whose output is a residual stream (three-part's recurrent norm) stays float32."""
    from architectures.blocks import RMSNorm

    x = torch.randn(2, 5, 16)
    for feeds, want in ((True, torch.bfloat16), (False, torch.float32)):
        norm = RMSNorm(16, feeds_matmul=feeds)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = norm(x)
        assert out.dtype == want
        assert torch.equal(out, norm(x).to(want))  # outside autocast: float32, the same values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_the_gate_of_autograd(dtype):
    """The feed-forward gate with its one-tensor backward: bitwise what autograd computes for F.silu(a) * b."""
    g = torch.Generator().manual_seed(1)
    h13 = (torch.randn(3, 7, 2 * 24, generator=g) * 2).to(dtype).requires_grad_()
    grad = torch.randn(3, 7, 24, generator=g).to(dtype)
    a, b = h13.chunk(2, dim=-1)
    ref = F.silu(a) * b
    out = swiglu(h13)
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out, h13, grad)[0], torch.autograd.grad(ref, h13, grad)[0])
    with torch.no_grad():
        assert torch.equal(swiglu(h13), ref)


@pytest.mark.parametrize("arch", NAMES)
def test_loss_without_logits_equals_the_loss_of_the_logits(arch, tiny_model):
    """`return_logits=False` (training, validation) gives the same loss and gradients as the logits path."""
    model = tiny_model(arch).train()
    x, y = tokens(3, 20), tokens(3, 20, seed=1)
    y[0, :5] = -1

    def run(**kw):
        model.zero_grad()
        torch.manual_seed(5)  # three-part's s0
        out, loss = model(x, y, **kw)
        loss.backward()
        return out, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits, ref_loss, ref_grads = run()
    none, loss, grads = run(return_logits=False)
    assert logits is not None and none is None
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", NAMES)
def test_forward_on_cuda_matches_cpu(arch, tiny_model):
    model = tiny_model(arch, **NO_RANDOM_STATE.get(arch, {}))
    x, y = tokens(2, 16), tokens(2, 16, seed=1)
    with torch.no_grad():
        cpu_logits, cpu_loss = model(x, y)
        gpu = model.to("cuda")
        logits, loss = gpu(x.cuda(), y.cuda())
        torch.testing.assert_close(logits.cpu(), cpu_logits, rtol=1e-3, atol=1e-3)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the training precision on CUDA
            _, bf16_loss = gpu(x.cuda(), y.cuda())
    assert abs(bf16_loss.item() - cpu_loss.item()) < 0.05
    outs = generate(gpu, x[:, :4].tolist(), max_new_tokens=5, temperature=0.0)
    assert [len(o.tokens) for o in outs] == [5, 5]


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_under_compile_the_embedding_and_the_cpu_loss_run_eagerly(tiny_args, monkeypatch):
    """The embedding's backward and the CPU loss stay out of torch.compile's graphs (inductor's atomic adds would
    make compiled runs irreproducible; the loss's chunk loop is already the fast form): both run as plain eager
    calls between the graphs, and the step's loss and gradients are the eager step's."""
    calls: dict[str, list[bool]] = {"embed": [], "loss": []}
    chunked = kernels._chunked_cross_entropy

    def spy_loss(*a):
        calls["loss"].append(torch.compiler.is_compiling())
        return chunked(*a)

    monkeypatch.setattr(kernels, "_chunked_cross_entropy", spy_loss)
    torch.manual_seed(0)
    args = tiny_args("control")
    model = architectures.build("control", args)
    model.tok_embeddings.register_forward_hook(lambda *_: calls["embed"].append(torch.compiler.is_compiling()))
    x = tokens(2, 16, args.vocab_size)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing alone: what is left out of the graph
    _, got = compiled(x, targets=x, return_logits=False)
    got.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, want = model(x, targets=x, return_logits=False)
    want.backward()
    n = len(calls["embed"])
    assert n == 2 and calls["loss"], calls  # the compiled call's and the eager one's
    assert not any(calls["embed"] + calls["loss"]), calls
    torch.testing.assert_close(got, want)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.slow  # over 2 s on a 2-core CPU: out of the fast loop
def test_dynamo_loads_only_in_a_process_that_compiles():
    """torch._dynamo costs seconds to import: importing the architectures does not load it (a listing, an
    evaluation, a training run without compile never pay for it), and once it loads, the functions kept out of
    compiled graphs are made."""
    import subprocess
    import sys

    code = (
        "import sys, architectures\n"
        "from architectures import base, kernels\n"
        "print('torch._dynamo' in sys.modules, base._eager_embed is base._embed,\n"
        "      kernels._eager_linear_cross_entropy is kernels._linear_cross_entropy)\n"
        "import torch._dynamo\n"
        "print(base._eager_embed is base._embed,\n"
        "      kernels._eager_linear_cross_entropy is kernels._linear_cross_entropy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["False True True", "False False"]


@pytest.mark.parametrize("arch", architectures.names())
def test_build_shapes_counts_what_a_built_model_counts_and_initialises_nothing(arch, tiny_args):
    """Reports and estimates count every model of a grid on `build_shapes`: it must give the parameter report,
    FLOPs, depth and resolved arguments of a real build, without running an init (a model built right after it,
    outside, is initialised as always)."""
    args = tiny_args(arch)
    shapes = architectures.build_shapes(arch, args)
    torch.manual_seed(0)
    built = architectures.build(arch, args)
    assert shapes.param_report() == built.param_report()
    assert shapes.flops_per_token(32) == built.flops_per_token(32)
    assert shapes.effective_depth() == built.effective_depth() and shapes.arch_args == built.arch_args
    assert [(n, p.shape) for n, p in shapes.named_parameters()] == [(n, p.shape) for n, p in built.named_parameters()]
    torch.manual_seed(0)
    again = architectures.build(arch, args)  # the mode is gone: the same init, draw for draw
    for (n, p), q in zip(built.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n
    with torch.device("meta"):
        marker = torch.empty(())
    assert marker.is_meta and not torch.empty(()).is_meta  # no device or mode left behind


def test_build_shapes_skips_the_init_and_never_loads_the_compiler():
    """Counting a model must not pay for its init (a paper model's normal_ over millions of weights) nor import
    torch._dynamo (seconds; meta-device builds did, through Python decompositions of every op)."""
    import subprocess
    import sys

    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):  # below build_shapes' own mode: what it lets through
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    for arch in architectures.names():
        with Seen() as seen:
            architectures.build_shapes(arch, make_config("paper", arch).model)
        assert seen.names, "nothing reached the recording mode: it records nothing"
        inits = {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "zeros_", "ones_", "constant_"}
        assert not inits & set(seen.names), arch
    # An init below the nn.init API that redraws until its values are in bounds (trunc_normal_ calls normal_
    # directly) must end whatever the memory held: the fill it reaches gives defined values.
    code = (
        "import sys, torch, architectures\n"
        "from benchctl.core.config import make_config\n"
        "for a in architectures.names():\n"
        "    architectures.build_shapes(a, make_config('paper', a).model)\n"
        "t = torch.full((4096,), 100.0)\n"
        "with architectures._SkipInit():\n"
        "    torch.nn.init.trunc_normal_(t, a=-2.0, b=2.0)\n"
        "print('torch._dynamo' in sys.modules, bool((t.abs() <= 2).all()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False True"
