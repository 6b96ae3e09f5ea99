"""shared-cycle: the three orders of Takase & Kiyono 2021, and the schedule they produce."""

from __future__ import annotations

import pytest
import torch

from architectures.shared_cycle import layer_order


def test_orders_follow_the_paper():
    assert layer_order("sequence", 3, 2) == [0, 0, 1, 1, 2, 2]
    assert layer_order("cycle", 3, 2) == [0, 1, 2, 0, 1, 2]
    assert layer_order("cycle-rev", 3, 2) == [0, 1, 2, 2, 1, 0]  # the paper's M = 3, N = 6 example
    assert layer_order("cycle-rev", 4, 4) == [0, 1, 2, 3] * 3 + [3, 2, 1, 0]
    for order in ("sequence", "cycle", "cycle-rev"):  # one pass is the plain stack
        assert layer_order(order, 4, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="model.share_order"):
        layer_order("rev", 4, 2)


@pytest.mark.parametrize("order", ["sequence", "cycle", "cycle-rev"])
def test_schedule_runs_the_blocks_in_order(order, tiny_model):
    model = tiny_model("shared-cycle", share_order=order)
    x = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    with torch.no_grad():
        h = model.tok_embeddings(x)
        for b in layer_order(order, 4, 4):
            h = model.layers[b](h, cos, sin)
        ref = model.output(model.norm(h))
        torch.testing.assert_close(model(x)[0], ref)
        assert model.effective_depth() == 16
        # a shallower forward recomputes the order for that depth; one pass is the control's stack
        torch.testing.assert_close(model(x, n_recur=1)[0], model.output(model.norm(_stack(model, x, cos, sin))))


def _stack(model, x, cos, sin):
    h = model.tok_embeddings(x)
    for layer in model.layers:
        h = layer(h, cos, sin)
    return h


def test_config_checks_the_order():
    from benchctl.core.config import make_config
    from benchctl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model.share_order"):
        make_config("tiny", "shared-cycle", overrides={"model.share_order": "reverse"})
