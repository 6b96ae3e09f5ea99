"""Mixture-of-Recursions (Bae et al. 2025, "Mixture-of-Recursions: Learning Dynamic Recursive Depths for Adaptive
Token-Level Computation"): a shared recursion block applied up to N_r times, with routers that decide, per token, how
many of those recursions it takes. The formulas follow the authors' released code (their expert-choice and
token-choice MoR layers); the code below is ours.

Layout ("Middle-Cycle", the paper's preferred sharing): the first block runs once, the middle blocks form the shared
recursion block, applied up to N_r = `model.n_recur` times (default 3), the last block runs once. In the tiny and
paper presets (4 blocks): B1, then (B2 B3) up to 3 times, then B4, at most 1 + 3*2 + 1 = 8 block applications per
token, the trained and largest depth.

Expert-choice routing (`mor_routing=expert`, the default). Recursion step r (1..N_r) has its own router
g_r(x) = alpha * sigmoid(w_r . x) over the tokens that took step r-1 (all tokens at r = 1); it keeps the top k_r of
them per sequence, k_r = floor(T * (N_r - r + 1) / N_r) (at least 1), sorted back into sequence order (hierarchical
filtering: a token that left never comes back). The kept tokens run through the recursion block as a shorter
sequence, attending only to each other (their own positions for the rotary embedding; this is the paper's
recursion-wise KV caching, the default: see "Keys and values" below), and the residual stream
is updated as the released code does, x[kept] += g_r * block(x[kept]). The router is trained by the auxiliary loss
(binary cross-entropy between its logits and "was in the top k", mean over the candidates; `aux/router_bce`) and
optionally a router z-loss (mean squared logsumexp of the logits; `mor_z_weight`, off by default as in the released
code's default). Top-k over the sequence is not causal: a later token changes which earlier tokens are kept. So the
training forward declares itself non-causal, and evaluation and generation use the causal rule the auxiliary loss
trains for: a candidate takes step r when sigmoid(w_r . x) >= 0.5, decided from its own state alone.

Token-choice routing (`mor_routing=token`). One router over the N_r depths, computed once on the state entering the
recursions: probabilities alpha * softmax(W x), the token's depth the top-1 (1..N_r), its weight g the winning
probability (run at a test-time depth n < N_r, a token that chose a deeper one ends at step n). Step r runs the
tokens whose depth is >= r (each sequence's such tokens, in order, as a shorter sequence); a token whose depth is r
ends with x_in + g * block(...) (the released code adds the weighted output to the state that entered the
recursions), the others carry the block's output to the next step. The balancing loss of the released
code, sum_i P_i f_i with P_i the mean router probability of depth i and f_i = N_r times the fraction of tokens that
chose it (`aux/balance`), keeps the depths in use; the optional z-loss applies as above. Every decision reads only the
token's own state, so the training forward is causal.

Keys and values (`mor_kv`), the paper's two ways for a recursion step's attention:
- `recursion` (recursion-wise KV caching, the default): step r's keys and values are those of the tokens routed to
  step r, computed at step r; its tokens attend only to each other.
- `share` (recursive KV sharing): the first recursion step computes every block's keys and values for its tokens
  (every token, in training: its capacity is the whole sequence), and every later step reuses them: its queries are
  those of the tokens routed to it, each attending to the first step's tokens at or before its own position, and its
  blocks' key and value projections are not applied.

Compute as spent. Each recursion step runs the block over the routed tokens only, padded (within a batch) to the
longest routed sequence; those padded sequences are what is counted (`add_compute`): per token of the input,
(n_r / T) block applications over n_r tokens, for the n_r tokens of the step's longest routed sequence, plus the
routers' matmuls. Under KV sharing the steps after the first count no key and value projections, and attention over
the first step's tokens. The analytic `flops_per_token` (every token through every step, recursion-wise) is the upper
bound.

Metrics (`arch/...`): the mean recursion depth, the fraction of tokens at each depth (`depth_frac_<k>`, 0..N_r), and,
for token-choice, the router's load imbalance (max over depths of N_r * fraction, 1 when balanced).

Adaptations to this harness, each stated:
- Blocks are the harness's llama2.c blocks (pre-norm RMSNorm, SwiGLU, RoPE); routers are bias-free linear maps
  initialised like every Linear here (N(0, 0.02)).
- The capacity schedule k_r = T (N_r - r + 1) / N_r (the paper's hierarchical filtering, every recursion dropping an
  equal share) is fixed; the released code's warm-up of the capacity factor and of the balancing loss is left out.
- The weights of the auxiliary losses are ours (the released layer returns the terms; their coefficients live in
  its training configuration): `mor_aux_weight` (expert BCE or token-choice balancing) 0.01, `mor_z_weight` 0.
- Under a KV cache (generation) the forward re-runs the recursions over the whole cached prefix, kept as token
  embeddings in one cache slot: the causal rules make every earlier token's result the same as before, so this gives
  the full forward's logits without per-step caches of ragged token sets (it spends more arithmetic than the
  paper's decoding with recursion-wise caches would, and generation's compute is not what a run records). `mor_kv`
  is thus the attention rule each option defines, in training and inference alike; their memory savings at decoding
  are not reproduced.
- Padding a routed sequence at its end is safe with causal attention (real tokens never attend to it); its outputs
  are discarded.

Unique parameters: the control's plus N_r * d (one router per step, expert-choice) or d * N_r (token-choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import StaticKVCache, rotate_pairs


@dataclass(frozen=True, kw_only=True)
class MoRArgs(ArchArgs):
    mor_routing: Literal["expert", "token"] = "expert"  # expert-choice (top-k per step) or token-choice (depth once)
    mor_alpha: float | None = None  # router output scale: None -> 0.1 (expert, sigmoid) or 1.0 (token, softmax)
    mor_aux_weight: float = 0.01  # weight of the router's auxiliary loss (expert: BCE on top-k; token: balancing)
    mor_z_weight: float = 0.0  # weight of the router z-loss (0: off)
    # keys and values a recursion step attends over: "recursion" (recursion-wise caching: those of the tokens routed
    # to the step, computed at the step) or "share" (recursive sharing: those the first step computed, every step)
    mor_kv: Literal["recursion", "share"] = "recursion"


@register("mor", args=MoRArgs)
class MoR(BaseLM):
    label = "MoR"
    description = "shared recursion block with per-token routed depth (Mixture-of-Recursions)"

    reports_stats = True
    adaptive_compute = True  # the routers decide each token's depth
    causal_training = False  # expert-choice's top-k; token-choice is causal, and the tests then check train mode too
    inference_rule = (
        "expert-choice: a token takes recursion step r when its step-r router says sigmoid(w_r . x) >= 0.5 (the rule "
        "its auxiliary loss trains for), decided from its own state; token-choice routes causally in training too"
    )

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 3

    @classmethod
    def resolve_arch_args(cls, arch_args: Any, trunk: Any = None) -> Any:
        if arch_args.mor_alpha is not None:
            return arch_args
        return replace(arch_args, mor_alpha=0.1 if arch_args.mor_routing == "expert" else 1.0)

    @classmethod
    def validate_args(cls, args: Any) -> None:
        a = cls.arch_args_of(args)
        if args.n_layers < 3:
            raise ValueError(
                f"model.n_layers={args.n_layers}: MoR needs a first and a last block around at least one shared one"
            )
        if a.mor_alpha is not None and not a.mor_alpha > 0:
            raise ValueError(f"model.mor_alpha: must be positive, got {a.mor_alpha}")
        for key in ("mor_aux_weight", "mor_z_weight"):
            if not getattr(a, key) >= 0:
                raise ValueError(f"model.{key}: must be >= 0, got {getattr(a, key)}")

    @property
    def alpha(self) -> float:
        a = self.arch_args
        return a.mor_alpha if a.mor_alpha is not None else (0.1 if a.mor_routing == "expert" else 1.0)

    @property
    def token_choice(self) -> bool:
        return self.arch_args.mor_routing == "token"

    router: nn.Module  # token-choice: a Linear over the depths; expert-choice: a ModuleList, one Linear per step

    def build_extra(self, args: Any) -> None:
        N = args.n_recur
        if self.arch_args.mor_routing == "token":
            self.router = nn.Linear(args.dim, N, bias=False)  # one router over the N_r depths
        else:
            self.router = nn.ModuleList(nn.Linear(args.dim, 1, bias=False) for _ in range(N))  # one per step
        self._core = list(range(1, args.n_layers - 1))

    # ---- the schedule ---------------------------------------------------------------------------------------------

    def schedule(self, h, cos, sin, n_recur, cache):
        if cache is None:
            return self._forward(h, cos, sin, n_recur)
        # generation: re-run over the whole prefix, kept as token embeddings in one cache slot (see the docstring)
        pos, T = cache.pos, h.shape[1]
        if isinstance(cache, StaticKVCache):  # the decode path's preallocated cache: the slot is written in place
            full = cache.write(h.unsqueeze(1), h.unsqueeze(1))[0][:, 0, : pos + T]  # (B, pos+T, d)
        else:
            full = cache.next_layer().update(h.unsqueeze(1), h.unsqueeze(1), pos, cache.max_len)[0][:, 0]
        out = self._forward(full, self.rope_cos[: pos + T], self.rope_sin[: pos + T], n_recur)
        return out[:, pos:]

    def _forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_recur: int) -> torch.Tensor:
        B, T, d = h.shape
        self._first_kv: _FirstKV | None = None  # recursive KV sharing: what the first recursion step computed
        h = self.layers[0](h, cos, sin)
        self._spent = self.block_flops(T)  # the first block, every token
        if self.token_choice:
            h, depth = self._token_choice(h, cos, sin, n_recur)
        else:
            h, depth = self._expert_choice(h, cos, sin, n_recur)
        h = self.layers[-1](h, cos, sin)
        self._spent += self.block_flops(T)
        self.add_compute(self._spent)
        self.add_metric("mean_depth", depth.float().mean())
        for k in range(n_recur + 1):
            self.add_metric(f"depth_frac_{k}", (depth == k).float().mean())
        return h

    def _run_core(
        self, x: torch.Tensor, idx: torch.Tensor, real: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The recursion block over the tokens `idx` (B, n) of each sequence (`real` marks the routed ones, the rest
        pad), in sequence order, as a sequence of their own: x (B, T, d) -> block output (B, n, d); positions for the
        rotary embedding are the tokens' own. Recursion-wise (the default) the tokens attend to each other; under
        recursive KV sharing the first step keeps every block's keys and values and the later steps attend to those."""
        B, n = idx.shape
        d = x.shape[-1]
        s = torch.gather(x, 1, idx[..., None].expand(B, n, d))
        c, sn = cos[idx], sin[idx]  # (B, n, hd/2): per-row positions
        blk = self.block_flops(n)
        if self.arch_args.mor_kv == "recursion":
            for i in self._core:
                s = self.layers[i](s, c, sn)
        elif self._first_kv is None:  # the first step: its keys and values are the ones every later step reads
            kv = []
            for i in self._core:
                s, k, v = _block_keeping_kv(self.layers[i], s, c, sn)
                kv.append((k, v))
            self._first_kv = _FirstKV(kv=kv, pos=idx, real=real)
        else:
            first = self._first_kv
            # each query attends to the first step's tokens at or before its position; a padding row (its output
            # discarded) to all of them, so that no row of the softmax is empty
            mask = ((first.pos[:, None, :] <= idx[:, :, None]) & first.real[:, None, :]) | ~real[:, :, None]
            for i, (k, v) in zip(self._core, first.kv, strict=True):
                s = _block_on_shared_kv(self.layers[i], s, c, sn, k, v, mask[:, None])
            a, hd = self.args, self.args.dim // self.args.n_heads
            # no key and value projections; attention over the first step's n_1 tokens instead of these n
            blk += 4.0 * (first.pos.shape[1] - n) * a.n_heads * hd - 2.0 * 2 * a.dim * a.n_kv_heads * hd
        self._spent += (n / x.shape[1]) * len(self._core) * blk
        return s

    @staticmethod
    def _pack(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's True positions first, in order, then its others: (indices (B, n), real (B, n)) with n the
        largest row count; `real` marks the routed tokens, the rest pad the row at its end."""
        B, T = mask.shape
        pos = torch.arange(T, device=mask.device).expand(B, T)
        order = torch.argsort(torch.where(mask, pos, pos + T), dim=1)  # routed tokens first, each group in order
        n = int(mask.sum(1).max()) if mask.numel() else 0
        idx = order[:, :n]
        return idx, torch.gather(mask, 1, idx)

    def _expert_choice(self, h, cos, sin, n_recur):
        B, T, d = h.shape
        routers = self.router
        assert isinstance(routers, nn.ModuleList)
        cand = torch.arange(T, device=h.device).expand(B, T)  # (B, n_c): the tokens that took the previous step
        cand_real = torch.ones(B, T, dtype=torch.bool, device=h.device)
        depth = torch.zeros(B, T, dtype=torch.long, device=h.device)
        bce = h.new_zeros((), dtype=torch.float32)
        z = h.new_zeros((), dtype=torch.float32)
        for r in range(n_recur):
            n_c = cand.shape[1]
            if n_c == 0:
                break
            x_c = torch.gather(h, 1, cand[..., None].expand(B, n_c, d))
            logits = routers[r](x_c).squeeze(-1).float()  # (B, n_c)
            self._spent += 2.0 * d * n_c / T
            probs = torch.sigmoid(logits) * self.alpha
            if self.training:
                k = min(n_c, max(1, math.floor(T * (n_recur - r) / n_recur)))
                top = torch.topk(probs, k, dim=1, sorted=False).indices
                keep = torch.zeros_like(cand_real).scatter(1, top, True)  # (B, n_c)
                bce = bce + F.binary_cross_entropy_with_logits(logits, keep.float())
                if self.arch_args.mor_z_weight > 0:  # logsumexp over one logit is the logit itself
                    z = z + (logits**2).mean()
            else:  # the causal rule
                keep = (torch.sigmoid(logits) >= 0.5) & cand_real
            local, real = self._pack(keep)  # positions within the candidates
            if local.shape[1] == 0:
                break
            sel = torch.gather(cand, 1, local)  # (B, n): positions in the sequence
            out = self._run_core(h, sel, real, cos, sin)
            w = torch.gather(probs, 1, local) * real  # padding adds nothing
            h = h.scatter_add(1, sel[..., None].expand_as(out), (w[..., None] * out).to(h.dtype))
            depth = depth + torch.zeros_like(depth).scatter(1, sel, real.long())
            cand, cand_real = sel, real
        if self.training:
            self.add_aux_loss("router_bce", bce, self.arch_args.mor_aux_weight)
            if self.arch_args.mor_z_weight > 0:
                self.add_aux_loss("router_z", z, self.arch_args.mor_z_weight)
        return h, depth

    def _token_choice(self, h, cos, sin, n_recur):
        B, T, d = h.shape
        logits = self.router(h).float()  # (B, T, N_r)
        self._spent += 2.0 * d * n_recur
        probs = F.softmax(logits, dim=-1) * self.alpha
        choice = probs.argmax(dim=-1)  # (B, T): depth - 1
        g = torch.gather(probs, -1, choice[..., None]).squeeze(-1)  # (B, T)
        depth = (choice + 1).clamp(max=n_recur)  # below the trained depth (a test-time n_recur) deeper tokens end at n
        final = h
        x = h
        for r in range(n_recur):
            idx, real = self._pack(depth > r)
            if idx.shape[1] == 0:
                break
            out = self._run_core(x, idx, real, cos, sin)
            ends = real & (torch.gather(depth, 1, idx) == r + 1)  # tokens whose last step this is
            w = (torch.gather(g, 1, idx) * ends)[..., None]
            final = final.scatter_add(1, idx[..., None].expand_as(out), (w * out).to(h.dtype))
            at = idx[..., None].expand_as(out)
            x = x.scatter(1, at, torch.where(real[..., None], out, torch.gather(x, 1, at)))  # padding unchanged
        N = probs.shape[-1]
        frac = torch.stack([(choice == i).float().mean() for i in range(N)])  # (N_r,)
        if self.training:
            balance = (probs.mean(dim=(0, 1)) * N * frac).sum()
            self.add_aux_loss("balance", balance, self.arch_args.mor_aux_weight)
            if self.arch_args.mor_z_weight > 0:
                self.add_aux_loss(
                    "router_z", (torch.logsumexp(logits, dim=-1) ** 2).mean(), self.arch_args.mor_z_weight
                )
        self.add_metric("router_imbalance", (N * frac).max())
        return final, depth

    # ---- accounting -------------------------------------------------------------------------------------------------

    def components(self, n_recur):
        outer = [self.layers[0], self.layers[-1]]
        core = [self.layers[i] for i in self._core]
        # each router is applied to a token at most once (token-choice: once; expert-choice: router r at step r)
        return [("blocks", outer, 1), ("blocks", core, n_recur), ("router", self.router, 1)]

    def flop_terms(self, n_recur, seq_len):
        d = self.args.dim
        blk = self.block_flops(seq_len)
        router = 2.0 * d * n_recur  # token-choice: one d x N_r map; expert-choice: N_r maps d x 1, every token at most
        return [((2 + n_recur * len(self._core)) * blk + router, True)]


@dataclass
class _FirstKV:
    """Recursive KV sharing: per block of the recursion, the keys and values (B, KV, n_1, hd) the first recursion step
    computed for its tokens, their positions in the sequence (B, n_1) and which of them are routed, not padding."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    pos: torch.Tensor
    real: torch.Tensor


def _qkv(block: Any, s: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    att = block.attention
    H, KV, hd = att.n_heads, att.n_kv_heads, att.head_dim
    xn = block.attention_norm(s)
    q = rotate_pairs(att.wq(xn).unflatten(-1, (H, hd)), cos, sin).transpose(1, 2)  # (B, H, n, hd)
    return xn, q, att, KV, hd


def _block_keeping_kv(block: Any, s: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`block(s)` (causal over the sequence s), also returning the rotated keys and the values it attended over."""
    xn, q, att, KV, hd = _qkv(block, s, cos, sin)
    k = rotate_pairs(att.wk(xn).unflatten(-1, (KV, hd)), cos, sin).transpose(1, 2)  # (B, KV, n, hd)
    v = att.wv(xn).unflatten(-1, (KV, hd)).transpose(1, 2)
    h = s + att.attend(q, k, v)
    return h + block.feed_forward(block.ffn_norm(h)), k, v


def _block_on_shared_kv(
    block: Any,
    s: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """`block(s)` with its queries attending over given keys and values (B, KV, n_1, hd) under `mask` (B, 1, n, n_1)
    instead of its own: the block's key and value projections are not used."""
    B, n, _ = s.shape
    _, q, att, KV, _ = _qkv(block, s, cos, sin)
    if KV != att.n_heads:
        k, v = k.repeat_interleave(att.n_heads // KV, dim=1), v.repeat_interleave(att.n_heads // KV, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=att.dropout if att.training else 0.0)
    h = s + att.resid_dropout(att.wo(y.transpose(1, 2).reshape(B, n, -1)))
    return h + block.feed_forward(block.ffn_norm(h))
