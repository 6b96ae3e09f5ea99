"""Weight surgery from a trained plain transformer into the recurrent models (architectures/retrofit.py)."""

from __future__ import annotations

import pytest
import torch

import architectures
from architectures import retrofit as rf
from benchctl.core.config import make_config


def _model(arch: str, **over):
    cfg = make_config("tiny", arch, 0, {k: str(v) for k, v in over.items()})
    torch.manual_seed(1)
    return architectures.build(arch, cfg.model).eval()


def _parent(n_layers: int = 16, equal_norms: bool = False):
    """A 'trained' control: random weights everywhere, including the norm gains (unit gains would hide mistakes)."""
    parent = _model("control", **{"model.n_layers": n_layers})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in parent.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        if equal_norms:
            for layer in parent.layers:
                layer.attention_norm.weight.copy_(parent.layers[0].attention_norm.weight)
                layer.ffn_norm.weight.copy_(parent.layers[0].ffn_norm.weight)
    return parent


def _load(target, state):
    target.load_state_dict(state)
    return target


def test_svd_at_full_rank_reproduces_every_parent_layer_and_its_forward():
    parent = _parent(equal_norms=True)
    # tiny: dim 32, so rank 32 = min(in, out) of every projection is full rank
    target = _model("relaxed", **{"model.lora_rank": 32})
    state = rf.retrofit_state(parent.state_dict(), target, "average", "svd")
    _load(target, state)
    L, R = target.args.n_layers, target.args.n_recur
    for t in range(R):
        for b in range(L):
            src = parent.layers[t * L + b]
            for proj, rel in rf._PROJ_KEYS.items():
                shared = dict(target.layers[b].named_parameters())[rel]
                lora = target.lora[t][b][proj]
                effective = shared + lora.scale * lora.B @ lora.A
                want = dict(src.named_parameters())[rel]
                torch.testing.assert_close(effective, want, atol=1e-5, rtol=1e-4)
    tokens = torch.randint(0, target.args.vocab_size, (2, 16))
    with torch.no_grad():
        lp, _ = parent(tokens)
        lt, _ = target(tokens)
    torch.testing.assert_close(lt, lp, atol=1e-4, rtol=1e-4)


def test_lower_rank_svd_is_closer_to_the_parent_than_zero_lora():
    parent = _parent(equal_norms=True)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        ref = parent(tokens)[0]
    errs = {}
    for label, rank, init in (("zero", 4, "zero"), ("r4", 4, "svd"), ("r16", 16, "svd")):
        target = _model("relaxed", **{"model.lora_rank": rank})
        _load(target, rf.retrofit_state(parent.state_dict(), target, "average", init))
        with torch.no_grad():
            errs[label] = float((target(tokens)[0] - ref).abs().mean())
    assert errs["r16"] < errs["r4"] < errs["zero"]


def test_average_is_the_mean_of_the_replaced_layers_and_trunk_is_the_parents():
    parent = _parent()
    target = _model("frailt")
    state = rf.retrofit_state(parent, target, "average")
    L, R = target.args.n_layers, target.args.n_recur
    for b in range(L):
        for rel in rf.BLOCK_KEYS:  # projections and norm gains alike
            want = torch.stack([parent.state_dict()[f"layers.{p * L + b}.{rel}"] for p in range(R)]).mean(0)
            torch.testing.assert_close(state[f"layers.{b}.{rel}"], want)
    for key in ("tok_embeddings.weight", "output.weight", "norm.weight"):
        assert torch.equal(state[key], parent.state_dict()[key])
    assert torch.equal(state["iter_emb"], target.state_dict()["iter_emb"])  # FraiLT's own init kept
    _load(target, state)
    assert target.tok_embeddings.weight is target.output.weight  # still tied after loading


def test_stepwise_picks_first_and_last_at_even_intervals():
    assert rf.stepwise_indices(16, 4) == [0, 5, 10, 15]
    assert rf.stepwise_indices(8, 4) == [0, 2, 5, 7]
    assert rf.stepwise_indices(4, 4) == [0, 1, 2, 3]
    parent = _parent()
    target = _model("relaxed")
    state = rf.retrofit_state(parent, target, "stepwise", "zero")
    for b, src in enumerate([0, 5, 10, 15]):
        for rel in rf.BLOCK_KEYS:
            assert torch.equal(state[f"layers.{b}.{rel}"], parent.state_dict()[f"layers.{src}.{rel}"])
    assert all(not state[k].any() for k in state if k.startswith("lora.") and k.endswith(".B"))
    # with B = 0 the relaxed model runs as the plain looped model of the stepwise blocks
    tokens = torch.randint(0, 512, (1, 8))
    _load(target, state)
    looped = _model("frailt")
    _load(looped, rf.retrofit_state(parent, looped, "stepwise"))
    with torch.no_grad():
        torch.testing.assert_close(target(tokens)[0], looped(tokens)[0])


def test_select_takes_first_and_last_layers_and_first_iteration_passes_e_through():
    parent = _parent()
    target = _model("three-part", **{"model.n_recur": 1, "model.state_init_std": 0.0})
    state = rf.retrofit_state(parent, target, "select")
    for b, src in enumerate([0, 13, 14, 15]):  # prelude = layer 0, core = 13, 14, coda = 15
        for rel in rf.BLOCK_KEYS:
            assert torch.equal(state[f"layers.{b}.{rel}"], parent.state_dict()[f"layers.{src}.{rel}"])
    _load(target, state)
    e = torch.randn(2, 5, target.args.dim)
    s = torch.randn(2, 5, target.args.dim)
    torch.testing.assert_close(target.adapter(torch.cat([s, e], -1)), e)


@pytest.mark.parametrize(
    "arch, init, lora, n_layers, needle",
    [
        ("relaxed", "average", "svd", 8, "L x R = 4 x 4 = 16 layers; the parent has 8"),
        ("relaxed", "stepwise", "svd", 8, "L x R = 4 x 4 = 16 layers; the parent has 8"),
        ("frailt", "stepwise", "zero", 3, "at least 4 parent layers (one per target block), the parent has 3"),
        ("three-part", "select", "svd", 3, "at least 4 parent layers"),
        ("three-part", "average", "svd", 16, "use select"),
        ("frailt", "select", "svd", 16, "use stepwise or average"),
    ],
)
def test_impossible_surgery_names_both_shapes(arch, init, lora, n_layers, needle):
    parent = _parent(n_layers)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rf.retrofit_state(parent, _model(arch), init, lora)


def test_width_mismatch_names_both_shapes():
    parent = _model("control", **{"model.n_layers": 16, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 4})
    with pytest.raises(ValueError, match=r"\(512, 64\) but the target's is \(512, 32\)"):
        rf.retrofit_state(parent, _model("relaxed"), "average", "svd")
