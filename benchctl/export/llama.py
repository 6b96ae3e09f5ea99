"""A trained model as a plain Llama: one stack of blocks with fp32 weights, the form both export formats write.

An architecture that can leave benchctl as a Llama says so with `export_formats` and gives its schedule as a plain
stack of block calls, `unrolled(n_recur, extrapolate)` -> [(block, LoRA set or None)]. The control is its blocks
once each; the relaxed model is its shared blocks once per pass, each call with that pass's LoRA, which merges into
the call's own copy of the weights: W + (alpha / r) B A (the forward adds (alpha / r) B A x to W x, so the merged
matrix gives the same product). Weights keep benchctl's (llama2.c's) layout here, interleaved RoPE included; each
writer converts to its format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from architectures.blocks import PROJECTIONS


@dataclass(frozen=True)
class LlamaShape:
    """What a Llama reader needs to know besides the tensors."""

    dim: int
    hidden_dim: int
    n_layers: int  # block calls, unrolled
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class LlamaWeights:
    """fp32 tensors in llama2.c's naming: `layers[i]` has wq wk wv wo w1 w2 w3 attention_norm ffn_norm."""

    shape: LlamaShape
    embedding: torch.Tensor  # (vocab, dim), tied with the output head
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor  # (dim,)

    def n_params(self) -> int:
        """Parameters of the exported model (the tied embedding once)."""
        return self.embedding.numel() + self.norm.numel() + sum(t.numel() for la in self.layers for t in la.values())


def export_formats(model_or_cls: Any) -> tuple[str, ...]:
    """The formats an architecture declares it can be exported to (none unless it says so)."""
    return tuple(getattr(model_or_cls, "export_formats", ()))


@torch.no_grad()
def llama_weights(model: Any, n_recur: int | None = None, extrapolate: str | None = None) -> LlamaWeights:
    """The model as a plain Llama stack, LoRA merged per call; `model` must declare an export format."""
    a = model.args
    calls = model.unrolled(n_recur, extrapolate)
    layers = []
    for block, lora in calls:
        mods = {
            "wq": block.attention.wq,
            "wk": block.attention.wk,
            "wv": block.attention.wv,
            "wo": block.attention.wo,
            "w1": block.feed_forward.w1,
            "w2": block.feed_forward.w2,
            "w3": block.feed_forward.w3,
        }
        layer = {}
        for name in PROJECTIONS:
            w = mods[name].weight.detach().float().clone()
            if lora is not None:
                adapter = lora[name]
                w += adapter.scale * (adapter.B.detach().float() @ adapter.A.detach().float())  # (out, r) @ (r, in)
            layer[name] = w
        layer["attention_norm"] = block.attention_norm.weight.detach().float().clone()
        layer["ffn_norm"] = block.ffn_norm.weight.detach().float().clone()
        layers.append(layer)
    shape = LlamaShape(
        dim=a.dim,
        hidden_dim=a.hidden_dim,
        n_layers=len(layers),
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        vocab_size=a.vocab_size,
        max_seq_len=a.max_seq_len,
        norm_eps=float(a.norm_eps),
        rope_theta=float(a.rope_theta),
    )
    return LlamaWeights(
        shape=shape,
        embedding=model.tok_embeddings.weight.detach().float().clone(),
        layers=layers,
        norm=model.norm.weight.detach().float().clone(),
    )
