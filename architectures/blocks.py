"""The shared llama2.c transformer block and its parts, written once.

Follows karpathy/llama2.c `model.py`: pre-norm RMSNorm (eps 1e-5, computed in float32), rotary position
embedding on adjacent pairs (theta 1e4), multi-head attention through `F.scaled_dot_product_attention`, SwiGLU
feed-forward `w2(silu(w1 x) * w3 x)`, no biases. Two additions, both inert by default:

- every projection can take a LoRA delta `(alpha / r) * B A x` passed in at call time (the relaxed recursive
  model keeps one set per pass and block, so the shared weights stay one module called in a loop);
- attention can read and extend a KV cache, one layer slot per block *call*, so recurrent models cache each pass.

Speed (the maths is llama2.c's, only the evaluation is arranged into fewer, larger kernels, each change measured
with `benchctl bench`): projections that read the same input run as one matmul over their concatenated
weights (wq|wk|wv, w1|w3; the parameters stay separate modules, so state dicts and FLOP counts are unchanged); RoPE
rotates q and k together as one complex multiply (the same products as llama2.c's cos/sin formula); LoRA deltas share
one matmul over the stacked A's and, in `LoRAProjection`, accumulate straight into the projection's output and input
gradient instead of through concatenations and full-size additions (the same matmuls, so the same FLOPs).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
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


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama2.c's rotation (x_r c - x_i s, x_r s + x_i c) of x (B, T, H, hd) in float32, as one complex multiply
    (x_r + i x_i)(c + i s): one kernel forward and one backward instead of a dozen elementwise ops and a stack."""
    B, T, H, hd = x.shape
    xf = x.float().reshape(B, T, H, hd // 2, 2)
    # inductor has no complex kernels: under torch.compile the written-out form is the one it fuses
    if x.device.type in ("cpu", "cuda") and not torch.compiler.is_compiling():
        freqs = torch.complex(cos, sin).view(1, T, 1, hd // 2)  # (1, T, 1, hd/2)
        out = torch.view_as_real(torch.view_as_complex(xf) * freqs).flatten(3)  # (B, T, H, hd)
    else:  # compiling, or devices without complex kernels (e.g. MPS): the same products, written out
        xr, xi = xf.unbind(-1)  # (B, T, H, hd/2)
        c, s = cos.view(1, T, 1, hd // 2), sin.view(1, T, 1, hd // 2)
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
    return project_group([layer], x, lora, [name])


def project_group(
    layers: list[nn.Linear], x: torch.Tensor, lora: Mapping[str, LoRA] | None, names: list[str]
) -> torch.Tensor:
    """The projections of one input x (..., in) as one matmul over their concatenated weights: (..., sum of outs).

    Concatenating the small weights (a copy of out x in floats) is far cheaper than reading x once per projection;
    the FLOPs are the same, and each weight keeps its own module and gradient.
    """
    w = torch.cat([m.weight for m in layers]) if len(layers) > 1 else layers[0].weight
    if lora is None:
        return F.linear(x, w)
    loras = [lora[n] for n in names]
    autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    # under torch.compile the plain form is better: inductor fuses the additions itself, and out= writes into views
    # would break the graph
    if len({m.scale for m in loras}) == 1 and not autocast and not torch.compiler.is_compiling():
        a = torch.cat([m.A for m in loras]) if len(loras) > 1 else loras[0].A
        y = LoRAProjection.apply(x.reshape(-1, x.shape[-1]), w, a, loras[0].scale, *[m.B for m in loras])
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


class LoRAProjection(torch.autograd.Function):
    """y = x W^T + [s u_1 B_1^T | ... | s u_n B_n^T] with u = x A^T, for n projections sharing x (N, in).

    W (O, in) and A (n r, in) are the group's stacked weights; B_j (o_j, r). Forward and backward run exactly the
    matmuls autograd would (the same FLOPs, counted the same way), but each low-rank product is accumulated straight
    into its slice of the output, and A's share of the input gradient straight into it (addmm with out=), instead of
    through concatenations and separate full-size additions.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, scale: float,
                *bs: torch.Tensor) -> torch.Tensor:
        r = bs[0].shape[1]
        u = torch.mm(x, a.t())  # (N, n r)
        if scale != 1.0:
            u.mul_(scale)
        y = torch.mm(x, w.t())  # (N, O)
        col = 0
        for j, b in enumerate(bs):
            ys = y[:, col : col + b.shape[0]]
            torch.addmm(ys, u[:, j * r : (j + 1) * r], b.t(), out=ys)  # ys += s u_j B_j^T
            col += b.shape[0]
        ctx.save_for_backward(x, w, a, u, *bs)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, a, u, *bs = ctx.saved_tensors
        r = bs[0].shape[1]
        gy = gy.contiguous()  # (N, O)
        du = torch.empty_like(u)  # d(x A^T), (N, n r)
        dbs = []
        col = 0
        for j, b in enumerate(bs):
            g = gy[:, col : col + b.shape[0]]  # (N, o_j)
            dbs.append(torch.mm(g.t(), u[:, j * r : (j + 1) * r]))  # (o_j, r); u carries the scale
            torch.mm(g, b, out=du[:, j * r : (j + 1) * r])
            col += b.shape[0]
        if ctx.scale != 1.0:
            du.mul_(ctx.scale)
        da = torch.mm(du.t(), x)  # (n r, in)
        dw = torch.mm(gy.t(), x)  # (O, in)
        dx = torch.mm(gy, w)  # (N, in)
        torch.addmm(dx, du, a, out=dx)  # dx += du A
        return (dx, dw, da, None, *dbs)


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

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (an index or boolean mask over B) in every slot, e.g. to drop sequences
        that finished generating."""
        for slot in self._slots:
            if slot.k is not None and slot.v is not None:
                slot.k, slot.v = slot.k[keep], slot.v[keep]


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
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = project_group([self.wq, self.wk, self.wv], x, lora, ["wq", "wk", "wv"])  # (B, T, (H + 2 KV) hd)
        # split (not slicing): its backward writes one gradient tensor instead of zero-filled copies to be summed
        qk, v = qkv.split([(H + KV) * hd, KV * hd], dim=-1)
        qk = rotate_pairs(qk.unflatten(-1, (H + KV, hd)), cos, sin)  # (B, T, H + KV, hd)
        q, k = qk.split([H, KV], dim=2)
        v = v.contiguous().unflatten(-1, (KV, hd))  # (B, T, KV, hd); a copy, so qkv is not kept alive for v
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
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d); a view when SDPA wrote (B, T, H, hd)
        return self.resid_dropout(project(self.wo, y, lora, "wo"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, lora: Mapping[str, LoRA] | None = None) -> torch.Tensor:
        h13 = project_group([self.w1, self.w3], x, lora, ["w1", "w3"])  # (B, T, 2h): w1 x | w3 x
        a, b = h13.chunk(2, dim=-1)
        gate = F.silu(a) * b  # (B, T, h)
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


# ---- the head and its loss ------------------------------------------------------------------------------------------

IGNORE_INDEX = -1  # targets equal to this are left out of the loss (llama2.c's ignore_index)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits h W^T (N, V) against targets (N,), without ever holding all the logits.

    The same function as `F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-1)`, evaluated `chunk`
    rows at a time. With gradients needed (training), each chunk's gradient is formed while its logits are in cache
    (softmax minus one-hot) and pushed through the head's two backward matmuls at once (`LinearCrossEntropy`): the same
    three matmuls autograd would run, but no (N, V) logits, log-softmax or gradient tensors written to memory and read
    back, and none held through the rest of the backward pass. h (N, d), weight (V, d), targets (N,) with -1 ignored.
    `chunk` rows per step: by default 8 MB of float32 logits (512 rows at V = 4096), at least 128 rows.
    """
    if chunk is None:
        chunk = max(128, (1 << 21) // weight.shape[0])
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(h, weight, targets, chunk)
    total, n_valid = _chunked_cross_entropy(h, weight, targets, chunk, None, None)
    return total / n_valid


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def _chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
    grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of counted targets); with grad_h (N, d) / grad_w (V, d) given, also fills them with the
    gradient of the *summed* loss (the caller scales by 1 / n_valid)."""
    cd = _compute_dtype(h)
    autocast_off = torch.autocast(h.device.type, enabled=False) if h.device.type in ("cpu", "cuda") else nullcontext()
    with autocast_off:  # the dtypes are chosen here, as autocast would (matmuls in cd, softmax in float32)
        hc_all, w = h.to(cd), weight.to(cd)
        valid = targets != IGNORE_INDEX
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        accumulate_w = grad_w is not None and grad_w.dtype == cd  # addmm_ needs one dtype
        for s in range(0, h.shape[0], chunk):
            hc, vc = hc_all[s : s + chunk], valid[s : s + chunk]
            idx = targets[s : s + chunk].clamp(min=0).unsqueeze(1)  # (n, 1); ignored rows point at 0, masked below
            logp = torch.log_softmax(torch.mm(hc, w.t()).float(), dim=-1)  # (n, V)
            total -= torch.where(vc, logp.gather(1, idx).squeeze(1), 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            p = logp.exp_()  # softmax, in place
            p.scatter_add_(1, idx, torch.where(vc, -1.0, 0.0).unsqueeze(1))
            p.mul_(vc.unsqueeze(1))  # ignored rows contribute nothing
            g = p.to(cd)
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[s : s + chunk])  # grad_h is allocated in cd
            if grad_w is not None:
                if accumulate_w:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w += g.t() @ hc
    return total, valid.sum()


class LinearCrossEntropy(torch.autograd.Function):
    """Forward of `linear_cross_entropy` that also computes its gradients (see there); backward only scales them."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty(h.shape, dtype=_compute_dtype(h), device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total, n_valid = _chunked_cross_entropy(h, weight, targets, chunk, grad_h, grad_w)
        inv = 1.0 / n_valid.float()  # nan loss when every target is ignored, as F.cross_entropy
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, inv) if t is not None))
        ctx.need = (need_h, need_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total * inv

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        scale = grad_out * saved.pop()  # d loss / d (summed loss) = grad_out / n_valid
        (need_h, need_w), (h_dtype, w_dtype) = ctx.need, ctx.dtypes
        # out of place: the saved gradients stay valid for a second backward (retain_graph)
        grad_h = (saved.pop(0) * scale).to(h_dtype) if need_h else None
        grad_w = (saved.pop(0) * scale).to(w_dtype) if need_w else None
        return grad_h, grad_w, None, None
