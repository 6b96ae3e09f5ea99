"""The shared llama2.c transformer block and its parts, written once.

Follows karpathy/llama2.c `model.py`: pre-norm RMSNorm (eps 1e-5, computed in float32), rotary position
embedding on adjacent pairs (theta 1e4), multi-head attention through `F.scaled_dot_product_attention`, SwiGLU
feed-forward `w2(silu(w1 x) * w3 x)`, no biases. Two additions, both inert by default:

- every projection can take a LoRA delta `(alpha / r) * B A x` passed in at call time (the relaxed recursive
  model keeps one set per pass and block, so the shared weights stay one module called in a loop);
- attention can read and extend a KV cache, one layer slot per block *call*, so recurrent models cache each pass.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def precompute_rope(head_dim: int, end: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (end, head_dim // 2), as in llama2.c `precompute_freqs_cis`."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... of x (B, T, H, hd) by position; cos/sin are (T, hd/2)."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    xr, xi = xf.unbind(-1)  # (B, T, H, hd/2)
    c = cos.view(1, cos.shape[0], 1, cos.shape[1])
    s = sin.view(1, sin.shape[0], 1, sin.shape[1])
    out = torch.stack((xr * c - xi * s, xr * s + xi * c), dim=-1).flatten(3)
    return out.type_as(x)


class LoRA(nn.Module):
    """A low-rank delta (alpha / r) * B @ A for one projection: A (r, in), B (out, r); B = 0 at init."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank

    def reset_parameters(self, init: str, std: float) -> None:
        if init == "kaiming":
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as PEFT does for lora_A
        else:
            nn.init.normal_(self.A, mean=0.0, std=std)
        nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scale


def project(layer: nn.Linear, x: torch.Tensor, lora: Mapping[str, LoRA] | None, name: str) -> torch.Tensor:
    y = layer(x)
    if lora is not None:
        y = y + lora[name](x)
    return y


class LayerCache:
    """Keys and values of one block call, preallocated to the model's context: (B, n_kv_heads, T_max, hd)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, T, D = k.shape
        if self.k is None or self.k.shape[0] != B:
            self.k = k.new_zeros(B, H, max_len, D)
            self.v = v.new_zeros(B, H, max_len, D)
        if pos + T > max_len:
            raise ValueError(f"KV cache overflow: position {pos + T} > context {max_len}")
        self.k[:, :, pos : pos + T] = k
        self.v[:, :, pos : pos + T] = v
        return self.k[:, :, : pos + T], self.v[:, :, : pos + T]


class KVCache:
    """A cache with one `LayerCache` per block call of the schedule (a recurrent model caches every pass).

    The model calls `begin()` before a forward; each block call then takes the next slot in order, so the same
    schedule always maps to the same slots. `advance(T)` moves the position after the forward.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.pos = 0
        self._slots: list[LayerCache] = []
        self._next = 0

    def begin(self) -> None:
        self._next = 0

    def next_layer(self) -> LayerCache:
        if self._next == len(self._slots):
            self._slots.append(LayerCache())
        slot = self._slots[self._next]
        self._next += 1
        return slot

    def advance(self, n: int) -> None:
        self.pos += n


class Attention(nn.Module):
    def __init__(self, args: Any):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.dropout = args.dropout
        self.resid_dropout = nn.Dropout(args.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: Mapping[str, LoRA] | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = project(self.wq, x, lora, "wq").view(B, T, self.n_heads, self.head_dim)
        k = project(self.wk, x, lora, "wk").view(B, T, self.n_kv_heads, self.head_dim)
        v = project(self.wv, x, lora, "wv").view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        pos = 0
        if cache is not None:
            pos = cache.pos
            k, v = cache.next_layer().update(k, v, pos, cache.max_len)  # (B, KV, pos+T, hd)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        if pos == 0:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=T > 1)
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:  # a chunk after a cached prefix: query i sees keys up to pos + i
            S = k.shape[2]
            mask = torch.arange(S, device=x.device)[None, :] <= (pos + torch.arange(T, device=x.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, d)
        return self.resid_dropout(project(self.wo, y, lora, "wo"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lora: Mapping[str, LoRA] | None = None) -> torch.Tensor:
        gate = F.silu(project(self.w1, x, lora, "w1")) * project(self.w3, x, lora, "w3")  # (B, T, h)
        return self.dropout(project(self.w2, gate, lora, "w2"))


class Block(nn.Module):
    """llama2.c TransformerBlock: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, layer_id: int, args: Any):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim, args.dropout)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: Mapping[str, LoRA] | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, lora, cache)
        return h + self.feed_forward(self.ffn_norm(h), lora)


def block_shapes(args: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of the seven projections of one block."""
    d, hd, h = args.dim, args.dim // args.n_heads, args.hidden_dim
    return {
        "wq": (d, args.n_heads * hd),
        "wk": (d, args.n_kv_heads * hd),
        "wv": (d, args.n_kv_heads * hd),
        "wo": (args.n_heads * hd, d),
        "w1": (d, h),
        "w2": (h, d),
        "w3": (d, h),
    }


def block_forward_flops(args: Any, seq_len: int, lora_rank: int = 0) -> float:
    """Forward FLOPs per token of one block call: 2 per multiply-add of every projection (plus its LoRA), and
    attention scores and values over the full seq_len x seq_len matrix (4 * T * H * hd), the convention of
    torch.utils.flop_counter for SDPA."""
    shapes = block_shapes(args)
    mm = sum(i * o for i, o in shapes.values())
    if lora_rank:
        mm += sum(lora_rank * (i + o) for i, o in shapes.values())
    attn = 4 * seq_len * args.n_heads * (args.dim // args.n_heads)
    return 2.0 * mm + attn
