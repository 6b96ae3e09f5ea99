"""The shared llama2.c transformer block and its parts, written once.

Follows karpathy/llama2.c `model.py`: pre-norm RMSNorm (eps 1e-5, computed in float32), rotary position
embedding on adjacent pairs (theta 1e4), multi-head attention through `F.scaled_dot_product_attention`, SwiGLU
feed-forward `w2(silu(w1 x) * w3 x)`, no biases. Two additions, both inert by default:

- every projection can take a LoRA delta `(alpha / r) * B A x` passed in at call time (the relaxed recursive
  model keeps one set per pass and block, so the shared weights stay one module called in a loop);
- attention can read and extend a KV cache, one layer slot per block *call*, so recurrent models cache each pass.

Speed (the maths is llama2.c's, only the evaluation is arranged into fewer, larger kernels, each change measured
with `benchctl bench`): on GPUs, projections that read the same input run as one matmul over their concatenated
weights (wq|wk|wv, w1|w3; the parameters stay separate modules, so state dicts and FLOP counts are unchanged) and RoPE
rotates q and k together; on a CPU each projection runs alone, as in llama2.c (see FeedForward for why). RoPE is one
complex multiply (the same products as llama2.c's cos/sin formula); LoRA deltas share one matmul over the stacked
A's; on a CPU, attention over short sequences runs as explicit matmuls. The hand-written
autograd kernels (the fused LoRA projection, RMSNorm, the feed-forward gate, CPU attention, the chunked head loss)
are in kernels.py; where this file calls them, the reference maths is next to them in kernels.py's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# The fast paths live in kernels.py; importable from here too, where the model code has always found them.
from architectures.kernels import (  # noqa: F401
    IGNORE_INDEX,
    LinearCrossEntropy,
    LoRAProjection,
    causal_attention,
    compute_dtype,
    linear_cross_entropy,
    lora_projection,
    rms_norm,
    swiglu,
)

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class RMSNorm(nn.Module):
    """llama2.c's RMSNorm, computed in float32. `feeds_matmul`: every use of the output is a matmul (a block's
    pre-norms, the final norm before the head), so under autocast the output is written in the autocast dtype the
    matmul would cast it to (the same values, one pass fewer each way); otherwise it keeps x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, feeds_matmul: bool = False):
        super().__init__()
        self.eps = eps
        self.feeds_matmul = feeds_matmul
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # x.float() is x: llama2.c's expression as one function (kernels.rms_norm)
            return rms_norm(x, self.weight, self.eps, compute_dtype(x) if self.feeds_matmul else None)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def precompute_rope(head_dim: int, end: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (end, head_dim // 2), as in llama2.c `precompute_freqs_cis`."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama2.c's rotation (x_r c - x_i s, x_r s + x_i c) of x (B, T, H, hd) in float32, as one complex multiply
    (x_r + i x_i)(c + i s): one kernel forward and one backward instead of a dozen elementwise ops and a stack.

    cos and sin are (T, hd/2), the positions every row shares, or (B, T, hd/2), positions per row (a block run over
    tokens gathered from their sequences, as a router that sends only some tokens through a block does)."""
    B, T, H, hd = x.shape
    xf = x.float().reshape(B, T, H, hd // 2, 2)
    rows = B if cos.dim() == 3 else 1
    # inductor has no complex kernels: under torch.compile the written-out form is the one it fuses
    if x.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling():
        freqs = torch.complex(cos, sin).view(rows, T, 1, hd // 2)  # (1 or B, T, 1, hd/2)
        out = torch.view_as_real(torch.view_as_complex(xf) * freqs).flatten(3)  # (B, T, H, hd)
    else:  # compiling, or devices without complex kernels (e.g. MPS): the same products, written out
        xr, xi = xf.unbind(-1)  # (B, T, H, hd/2)
        c, s = cos.view(rows, T, 1, hd // 2), sin.view(rows, T, 1, hd // 2)
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


def is_column_major(w: torch.Tensor) -> bool:
    """Whether a matrix is stored with its first dimension contiguous (its transpose is a contiguous tensor): the
    layout the decode path gives weights for inference."""
    return w.dim() == 2 and w.t().is_contiguous()


def project(layer: nn.Linear, x: torch.Tensor, lora: Mapping[str, LoRA] | None, name: str) -> torch.Tensor:
    return project_group([layer], x, lora, [name])


def project_group(
    layers: list[nn.Linear], x: torch.Tensor, lora: Mapping[str, LoRA] | None, names: list[str]
) -> torch.Tensor:
    """The projections of one input x (..., in) as one matmul over their concatenated weights: (..., sum of outs).

    Concatenating the small weights (a copy of out x in floats) is far cheaper than reading x once per projection;
    the FLOPs are the same, and each weight keeps its own module and gradient.
    """
    if len(layers) == 1:
        w = layers[0].weight
    elif not torch.compiler.is_compiling() and all(is_column_major(m.weight) for m in layers):
        # weights laid out for inference (column-major): joined as their transposes, so the joined weight keeps that
        # layout and the copy reads contiguous memory (inductor splits the product of a concatenation by itself)
        w = torch.cat([m.weight.t() for m in layers], dim=1).t()
    else:
        w = torch.cat([m.weight for m in layers])
    if lora is None:
        return F.linear(x, w)
    loras = [lora[n] for n in names]
    # under torch.compile the plain form is better: inductor fuses the additions itself, and out= writes into views
    # would break the graph
    if len({m.scale for m in loras}) == 1 and not torch.compiler.is_compiling():
        a = torch.cat([m.A for m in loras]) if len(loras) > 1 else loras[0].A
        bs: list[torch.Tensor] = [m.B for m in loras]
        if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
            # what autocast does for a linear layer, done before the fused function (whose out= products autocast
            # leaves alone): every operand in the autocast dtype; the casts' backward returns float32 gradients
            dt = torch.get_autocast_dtype(x.device.type)
            x, w, a, bs = x.to(dt), w.to(dt), a.to(dt), [b.to(dt) for b in bs]
        if torch.is_inference_mode_enabled():  # no gradient: the same products without the autograd Function
            y = lora_projection(x.reshape(-1, x.shape[-1]), w, a, loras[0].scale, *bs)[0]
        else:
            y = LoRAProjection.apply(x.reshape(-1, x.shape[-1]), w, a, loras[0].scale, *bs)
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w) + lora_delta(x, loras)  # plain autograd, the same maths


def lora_delta(x: torch.Tensor, loras: list[LoRA]) -> torch.Tensor:
    """sum_j of (alpha/r) B_j A_j x for LoRAs that share the input x (..., in), concatenated: (..., sum of outs).

    One matmul with the stacked A's (rank-r activations u, scaled there, where the tensor is r wide instead of out
    wide), then each B on its slice of u.
    """
    r = loras[0].A.shape[0]
    A = torch.cat([m.A for m in loras]) if len(loras) > 1 else loras[0].A
    u = F.linear(x, A)  # (..., n * r)
    parts = tuple(ui * m.scale if m.scale != 1.0 else ui for ui, m in zip(u.split(r, dim=-1), loras))
    outs = [F.linear(ui, m.B) for ui, m in zip(parts, loras)]
    return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


class LayerCache:
    """Keys and values of one block call, preallocated to the model's context: (B, n_kv_heads, T_max, hd)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, T, D = k.shape
        ck, cv = self.k, self.v
        if ck is None or cv is None or ck.shape[0] != B:
            ck = self.k = k.new_zeros(B, H, max_len, D)
            cv = self.v = v.new_zeros(B, H, max_len, D)
        if pos + T > max_len:
            raise ValueError(f"KV cache overflow: position {pos + T} > context {max_len}")
        ck[:, :, pos : pos + T] = k
        cv[:, :, pos : pos + T] = v
        return ck[:, :, : pos + T], cv[:, :, : pos + T]


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

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (an index or boolean mask over B) in every slot, e.g. to drop sequences
        that finished generating."""
        for slot in self._slots:
            if slot.k is not None and slot.v is not None:
                slot.k, slot.v = slot.k[keep], slot.v[keep]


class StaticKVCache:
    """A KV cache for the decode path: one preallocated (B, n_kv_heads, max_len, hd) key and value tensor per block
    call, written in place at the step's positions and read whole under a mask, so a decode step allocates nothing
    and keeps the same shapes from token to token (what lets `torch.compile` reuse one graph for every step).

    Used like `KVCache` (`begin` before each forward, one slot per block call in schedule order, `advance` after),
    except that `begin` takes the positions of the forward's tokens as a tensor: the step never reads a Python
    position, so nothing in it changes between tokens but tensor contents. Slots are created by the first forward
    (the prefill), which sees every block call the schedule makes.

    `span`, when set (by the decode loop, between steps), bounds what attention reads to the first `span` positions
    of every slot: positions past the last written one are masked anyway, and at a batch of 16 or more reading them
    is most of a decode step's attention (every row's whole cache streams through memory each step). The decode loop
    rounds it up to a multiple of `architectures.generate.SPAN_STEP`, so a compiled step sees few distinct lengths.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.pos = 0  # tokens cached so far (host-side bookkeeping; the step reads `positions` instead)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._next = 0
        self.positions: torch.Tensor | None = None  # (T,) positions of the current forward's tokens
        self.mask: torch.Tensor | None = None  # (T, max_len) True where a query may attend
        self._keys: torch.Tensor | None = None  # (max_len,) arange, made once
        self.span: int | None = None  # positions attention reads (None: all max_len)

    def begin(self, positions: torch.Tensor | None = None) -> None:
        self._next = 0
        if positions is not None:
            if self._keys is None or self._keys.device != positions.device:
                self._keys = torch.arange(self.max_len, device=positions.device)
            self.positions = positions
            self.mask = self._keys[None, :] <= positions[:, None]

    def reuses_kv(self) -> bool:
        """True when the next block call reads the keys and values already stored instead of writing its own (the
        block then computes only its queries and passes None to `write`). Never here; a cache with a KV-sharing
        strategy (`architectures.inference`) overrides it."""
        return False

    def write(self, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v (B, KV, T, hd) at this forward's positions in the next slot; returns that slot's keys and
        values (B, KV, S, hd) and the attention mask (T, S), S = `span` if set, else max_len."""
        if self.positions is None or self.mask is None:
            raise RuntimeError("StaticKVCache.begin(positions) must run before a forward")
        if k is None or v is None:
            raise ValueError("StaticKVCache stores the keys and values of every block call")
        i = self._next
        self._next += 1
        if i == len(self.k):
            B, H, _, D = k.shape
            self.k.append(k.new_zeros(B, H, self.max_len, D))
            self.v.append(v.new_zeros(B, H, self.max_len, D))
        ck, cv = self.k[i], self.v[i]
        ck.index_copy_(2, self.positions, k.to(ck.dtype))
        cv.index_copy_(2, self.positions, v.to(cv.dtype))
        if self.span is not None and self.span < self.max_len:
            S = self.span
            return ck[:, :, :S], cv[:, :, :S], self.mask[:, :S]
        return ck, cv, self.mask

    def advance(self, n: int) -> None:
        self.pos += n

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` in every slot (a copy: done when finished rows leave the batch)."""
        self.k = [t[keep] for t in self.k]
        self.v = [t[keep] for t in self.v]


AnyCache = KVCache | StaticKVCache


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
        cache: AnyCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if isinstance(cache, StaticKVCache) and cache.reuses_kv():  # this call reads stored keys and values only
            q = rotate_pairs(project(self.wq, x, lora, "wq").unflatten(-1, (H, hd)), cos, sin)
            return self.attend(q.transpose(1, 2), None, None, lora, cache)
        if x.device.type == "cpu":
            # three matmuls, as llama2.c (see FeedForward): each output whole, so no splits forward and no
            # concatenations backward, which on a CPU cost more than one wide matmul saves
            q = rotate_pairs(project(self.wq, x, lora, "wq").unflatten(-1, (H, hd)), cos, sin)  # (B, T, H, hd)
            k = rotate_pairs(project(self.wk, x, lora, "wk").unflatten(-1, (KV, hd)), cos, sin)
            v = project(self.wv, x, lora, "wv").unflatten(-1, (KV, hd))
        else:
            qkv = project_group([self.wq, self.wk, self.wv], x, lora, ["wq", "wk", "wv"])  # (B, T, (H + 2 KV) hd)
            # split (not slicing): its backward writes one gradient tensor instead of zero-filled copies to be summed
            qk, v = qkv.split([(H + KV) * hd, KV * hd], dim=-1)
            qk = rotate_pairs(qk.unflatten(-1, (H + KV, hd)), cos, sin)  # (B, T, H + KV, hd)
            q, k = qk.split([H, KV], dim=2)
            v = v.contiguous().unflatten(-1, (KV, hd))  # (B, T, KV, hd); a copy, so qkv is not kept alive for v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        return self.attend(q, k, v, lora, cache)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        lora: Mapping[str, LoRA] | None = None,
        cache: AnyCache | None = None,
    ) -> torch.Tensor:
        """Attention of rotated queries q (B, H, T, hd) over keys and values k, v (B, KV, T, hd), through `cache`
        when one is given, then the output projection: (B, T, dim). Blocks that make q, k, v their own way (e.g. with
        biases) share everything from here on. k and v are None when the cache says this call reuses stored entries
        (`StaticKVCache.reuses_kv`)."""
        B, T = q.shape[0], q.shape[2]
        if isinstance(cache, StaticKVCache):  # the decode path: whole preallocated slots under a mask
            ck, cv, mask = cache.write(k, v)
            y = cached_attention(q, ck, cv, mask)
            return self.resid_dropout(project(self.wo, y.transpose(1, 2).reshape(B, T, -1), lora, "wo"))
        if k is None or v is None:
            raise ValueError("keys and values are needed unless a StaticKVCache supplies them")
        pos = 0
        if cache is not None:
            pos = cache.pos
            k, v = cache.next_layer().update(k, v, pos, cache.max_len)  # (B, KV, pos+T, hd)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        if pos == 0:
            y = causal_attention(q, k, v, dropout_p)
        elif T == 1:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:  # a chunk after a cached prefix: query i sees keys up to pos + i
            S = k.shape[2]
            mask = torch.arange(S, device=q.device)[None, :] <= (pos + torch.arange(T, device=q.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d); a view when SDPA wrote (B, T, H, hd)
        return self.resid_dropout(project(self.wo, y, lora, "wo"))


def cached_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q (B, H, T, hd) over a static cache's whole keys and values (B, KV, S, hd) under `mask` (T, S):
    `F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=KV != H)`.

    Under torch.compile written out as two batched matmuls and a softmax: for the one query of a decode step the
    fused CPU kernel spends most of its time setting up (layout copies, buffers), while inductor fuses the scale,
    the mask and the softmax into one small kernel between the two matmuls. Eager keeps the fused kernel (one call
    instead of five)."""
    B, H, T, hd = q.shape
    KV = ck.shape[1]
    if not torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, enable_gqa=KV != H)
    # the H / KV query heads of a key head, and their T positions, as rows of one matmul against that head's keys
    qg = q.reshape(B, KV, (H // KV) * T, hd)
    scores = torch.matmul(qg * hd**-0.5, ck.transpose(-1, -2))  # (B, KV, (H / KV) T, S)
    scores = scores.masked_fill(~mask.repeat(H // KV, 1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(cv.dtype)
    return torch.matmul(probs, cv).reshape(B, H, T, hd)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lora: Mapping[str, LoRA] | None = None) -> torch.Tensor:
        if x.device.type == "cpu":
            # two matmuls, as llama2.c: the halves of one fused w1|w3 output are strided, and CPU elementwise kernels
            # run the gate markedly slower on strided halves than on whole tensors, while at the study's sizes two
            # matmuls of half the width cost no more than the one
            gate = F.silu(project(self.w1, x, lora, "w1")) * project(self.w3, x, lora, "w3")
        else:
            h13 = project_group([self.w1, self.w3], x, lora, ["w1", "w3"])  # (B, T, 2h): w1 x | w3 x
            gate = swiglu(h13)  # silu(w1 x) * w3 x: (B, T, h)
        return self.dropout(project(self.w2, gate, lora, "w2"))


class Block(nn.Module):
    """llama2.c TransformerBlock: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, layer_id: int, args: Any):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim, args.dropout)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps, feeds_matmul=True)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps, feeds_matmul=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: Mapping[str, LoRA] | None = None,
        cache: AnyCache | None = None,
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
