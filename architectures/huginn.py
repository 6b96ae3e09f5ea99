"""Huginn: the recurrent-depth transformer as Geiping et al. 2025 ("Scaling up Test-Time Compute with Latent
Reasoning: A Recurrent Depth Approach") released it, beside the study's simplified `three-part`.

    e  = prelude(sqrt(d) * embedding)               P sandwich blocks
    s0 ~ TruncNormal(0, sigma^2, +-3 sigma)         (B, T, d), fresh every forward (training and inference)
    r times:  s = core(W_ad [s ; e])                W_ad: 2d -> d, no bias; core = R sandwich blocks
    out = coda(ln_f(s))                             C sandwich blocks; ln_f is the final norm, applied twice
    logits = head(ln_f(out))                        tied embedding

A sandwich block normalises both the input and the output of each sublayer:
    h = n2(x + attn(n1(x)));  out = n4(h + mlp(n3(h)))
with learned per-head biases on the queries and keys (zero at init). Training draws the depth per step, Huginn's
"poisson-lognormal-filling" sampler: tau ~ LogNormal(ln r_bar - sigma^2/2, sigma) with sigma = 1/2,
r = Poisson(tau) + 1 (mean r_bar + 1), and backpropagates through only the last k = min(r, k_bar) iterations
(the first r - k run without building a graph). Inference runs r_bar iterations, or any depth asked for
(`n_recur`, unbounded); the per-token zero-shot exit and depth sweeps are the shared iteration API (`iterate`):
the prelude is the scaled embedding, the prelude blocks and the draw of s0, one iteration is the adapter and the core
blocks, the coda is ln_f and the coda blocks.

Trained depth: r_bar = model.n_recur = 7 (1 + 7*2 + 1 = 16 block applications at evaluation, the study's effective
depth; training samples r with mean 8), k_bar = 2. Huginn trains r_bar = 32 with k_bar = 8, a quarter; "auto"
(None) keeps that ratio, k_bar = max(1, round(r_bar / 4)), and 0 backpropagates through every iteration.
With the default 1 + 2 + 1 split of the four unique blocks the unique parameters are the control's plus the adapter
(2d^2), two more norms and the query/key biases in each block (4d per block): 4,348,160 in the paper preset (+3.2%),
within 10% of the control at every preset.

Adaptations to this harness (Huginn is a 3.5B model: 2 + 4 + 2 blocks of width 5280, r_bar = 32, 800B tokens):
- width, heads, vocabulary, context and the four unique blocks are the preset's; the default split puts one block in
  the prelude, two in the core and one in the coda (Huginn: 2 / 4 / 2), as in `three-part`;
- the sublayers are this package's llama2.c attention (RoPE theta and norm eps of the trunk, not Huginn's 50,000 and
  1e-6) and SwiGLU feed-forward, with the sandwich norms and query/key biases added around them;
- initialisation is the harness's llama2.c scheme for every architecture (N(0, 0.02), w3 and wo scaled by the
  unique blocks), not Huginn's truncated-normal "takase" init (std sqrt(2 / 5d), output projections scaled by the
  expected depth). The initial state keeps Huginn's scale: its std sqrt(2 / 5d) times the embedding scale sqrt(d)
  is sqrt(2/5), truncated at 3 sigma (`state_std`), the scale of the sandwich-normed states it stands in for;
- the depth is drawn from torch's global generator (Huginn seeds a generator with the step number, for exact
  restarts); the harness seeds the global generator per run, so training stays reproducible;
- Huginn's other sampling schemes, test-time noise and KV-cache compression strategies are left out; `fixed` trains
  at r_bar every step (still truncating to the last k_bar) and is what the tests use to count FLOPs exactly;
- under a KV cache every new token draws its own s0, so cached and re-encoded generations are two draws of the same
  model, equal only with `state_std=0`.
The training FLOPs per token with sampled depth are the expectation over the depth distribution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from numpy.polynomial.hermite import hermgauss

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import (
    AnyCache,
    Attention,
    Block,
    LoRA,
    RMSNorm,
    StaticKVCache,
    block_forward_flops,
    project,
    rotate_pairs,
)
from architectures.kernels import rms_norm

SAMPLER_SIGMA = 0.5  # Huginn's lognormal sigma (hard-coded in its sampler)
BACKPROP_SHARE = 8 / 32  # Huginn's k_bar / r_bar, the "auto" truncation


@dataclass(frozen=True, kw_only=True)
class HuginnArgs(ArchArgs):
    n_layers_in_prelude: int = 1  # sandwich blocks before the recurrent core (Huginn: 2)
    n_layers_in_coda: int = 1  # sandwich blocks after it (Huginn: 2)
    sampling_scheme: Literal["poisson-lognormal-filling", "fixed"] = "poisson-lognormal-filling"
    mean_backprop_depth: int | None = None  # k_bar; None ("auto") = max(1, round(n_recur / 4)); 0 = no truncation
    state_std: float = math.sqrt(2 / 5)  # std of the truncated-normal initial state s0
    embed_scale: bool = True  # multiply the embeddings by sqrt(d) on the way in
    qk_bias: bool = True  # learned per-head biases on queries and keys


class QKBiasAttention(Attention):
    """The block's attention with Huginn's learned biases added to the queries and keys before the rotation."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.q_bias = nn.Parameter(torch.zeros(self.n_heads * self.head_dim))
        self.k_bias = nn.Parameter(torch.zeros(self.n_kv_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: Mapping[str, LoRA] | None = None,
        cache: AnyCache | None = None,
    ) -> torch.Tensor:
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if isinstance(cache, StaticKVCache) and cache.reuses_kv():  # this call reads stored keys and values only
            q = project(self.wq, x, lora, "wq")
            q = rotate_pairs((q + self.q_bias).to(q.dtype).unflatten(-1, (H, hd)), cos, sin).transpose(1, 2)
            return self.attend(q, None, None, lora, cache)
        q, k = project(self.wq, x, lora, "wq"), project(self.wk, x, lora, "wk")
        q, k = (q + self.q_bias).to(q.dtype), (k + self.k_bias).to(k.dtype)  # stay in the autocast dtype
        q = rotate_pairs(q.unflatten(-1, (H, hd)), cos, sin).transpose(1, 2)  # (B, H, T, hd)
        k = rotate_pairs(k.unflatten(-1, (KV, hd)), cos, sin).transpose(1, 2)  # (B, KV, T, hd)
        v = project(self.wv, x, lora, "wv").unflatten(-1, (KV, hd)).transpose(1, 2)
        return self.attend(q, k, v, lora, cache)


class SandwichBlock(Block):
    """Huginn's block: h = n2(x + attn(n1(x))), out = n4(h + mlp(n3(h))). n1 and n3 are the llama2.c block's
    attention_norm and ffn_norm; n2 and n4 normalise the residual stream itself."""

    def __init__(self, layer_id: int, args: Any, qk_bias: bool):
        super().__init__(layer_id, args)
        if qk_bias:
            self.attention = QKBiasAttention(args)
        self.attention_out_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_out_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: Mapping[str, LoRA] | None = None,
        cache: AnyCache | None = None,
    ) -> torch.Tensor:
        h = self.attention_out_norm(x + self.attention(self.attention_norm(x), cos, sin, lora, cache))
        return self.ffn_out_norm(h + self.feed_forward(self.ffn_norm(h), lora))


def poisson_lognormal_pmf(mean: float, sigma: float, tail: float = 1e-12) -> list[tuple[int, float]]:
    """(r, P(r)) of r = Poisson(tau) + 1, tau ~ LogNormal(ln mean - sigma^2/2, sigma), integrated over tau by
    Gauss-Hermite quadrature; r runs until the remaining mass is below `tail`."""
    mu = math.log(mean) - sigma**2 / 2
    nodes, weights = hermgauss(80)
    taus = [math.exp(mu + math.sqrt(2.0) * sigma * float(x)) for x in nodes]
    ws = [float(w) / math.sqrt(math.pi) for w in weights]
    out, mass, j = [], 0.0, 0
    while mass < 1.0 - tail and j < 100_000:
        p = sum(w * math.exp(j * math.log(t) - t - math.lgamma(j + 1)) for t, w in zip(taus, ws))
        out.append((j + 1, p))
        mass += p
        j += 1
    return out


@register("huginn", args=HuginnArgs)
class Huginn(BaseLM):
    label = "Huginn"
    description = "recurrent depth as released: sandwich blocks, random state, sampled depth, truncated backprop"
    draws_random_state = True  # the initial state is drawn per row, fresh every forward
    warm_startable = True  # s0 is drawn, the token enters every step through e

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 7

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None

    @classmethod
    def backprop_depth(cls, arch_args: HuginnArgs, n_recur: int) -> int:
        k = arch_args.mean_backprop_depth
        return max(1, round(n_recur * BACKPROP_SHARE)) if k is None else k

    @classmethod
    def resolve_arch_args(cls, arch_args: HuginnArgs, trunk: Any = None) -> HuginnArgs:
        if arch_args.mean_backprop_depth is not None or trunk is None:
            return arch_args
        n = trunk.n_recur if getattr(trunk, "n_recur", None) is not None else cls.default_n_recur(trunk)
        return dataclasses.replace(arch_args, mean_backprop_depth=cls.backprop_depth(arch_args, n))

    @classmethod
    def validate_args(cls, args: Any) -> None:
        a = cls.arch_args_of(args)
        P, C = a.n_layers_in_prelude, a.n_layers_in_coda
        if P < 0 or C < 0 or P + C >= args.n_layers:
            raise ValueError(
                f"model.n_layers_in_prelude ({P}) + model.n_layers_in_coda ({C}) must leave at least one of "
                f"model.n_layers={args.n_layers} blocks for the recurrent core"
            )
        if a.mean_backprop_depth is not None and a.mean_backprop_depth < 0:
            raise ValueError(f"model.mean_backprop_depth: must be >= 0 (0 = full), got {a.mean_backprop_depth}")
        if not a.state_std >= 0:
            raise ValueError(f"model.state_std: must be >= 0, got {a.state_std}")

    def build_extra(self, args: Any) -> None:
        a = self.arch_args = self.resolve_arch_args(self.arch_args, args)
        self.layers = nn.ModuleList(SandwichBlock(i, args, a.qk_bias) for i in range(args.n_layers))
        self.adapter = nn.Linear(2 * args.dim, args.dim, bias=False)  # W_ad: [s ; e] -> s
        L = args.n_layers
        self._prelude = list(range(a.n_layers_in_prelude))
        self._core = list(range(a.n_layers_in_prelude, L - a.n_layers_in_coda))
        self._coda = list(range(L - a.n_layers_in_coda, L))
        self._k = self.backprop_depth(a, args.n_recur)
        self._emb_scale = math.sqrt(args.dim) if a.embed_scale else 1.0

    # ---- the recurrence -----------------------------------------------------------------------------------------

    def sample_n_recur(self) -> int:
        """Huginn's training depth r = Poisson(tau) + 1, tau ~ LogNormal(ln r_bar - sigma^2/2, sigma)."""
        mu = math.log(self.args.n_recur) - SAMPLER_SIGMA**2 / 2
        tau = torch.empty(1).log_normal_(mean=mu, std=SAMPLER_SIGMA)
        return int(torch.poisson(tau).item()) + 1

    def initial_state(self, e: torch.Tensor) -> torch.Tensor:
        s = torch.empty_like(e)
        std = self.arch_args.state_std
        if std == 0:
            return s.zero_()
        return nn.init.trunc_normal_(s, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def prelude(self, h, cos, sin, cache):
        if self._emb_scale != 1.0:
            h = h * self._emb_scale
        for i in self._prelude:
            h = self.layers[i](h, cos, sin, cache=cache)
        return self.initial_state(h), h  # (s0, e)

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        s = self.adapter(torch.cat([s, ctx], dim=-1)).to(ctx.dtype)  # (B, T, 2d) -> (B, T, d), residual dtype
        for i in self._core:
            s = self.layers[i](s, cos, sin, cache=cache)
        return s

    def coda(self, s, cos, sin, cache):
        s = self.final_norm_of_state(s)
        for i in self._coda:
            s = self.layers[i](s, cos, sin, cache=cache)
        return s

    def final_norm_of_state(self, s: torch.Tensor) -> torch.Tensor:
        """ln_f on the recurrent state (Huginn normalises the core's output with the final norm's weights). Its
        output feeds a residual stream, so it keeps the state's dtype (the model's `norm` writes the autocast
        dtype, for the head's matmul)."""
        w, eps = self.norm.weight, self.norm.eps
        if s.dtype == torch.float32:
            return rms_norm(s, w, eps, None)
        sf = s.float()
        return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).type_as(s) * w

    def schedule(self, h, cos, sin, n_recur, cache):
        s, e = self.prelude(h, cos, sin, cache)
        if self.training and self.arch_args.sampling_scheme != "fixed":
            n_recur = self.sample_n_recur()
        n_free = self._free_iterations(n_recur) if self.training else 0
        with torch.no_grad():
            for t in range(n_free):
                s = self.core_step(s, e, t, cos, sin, cache, None)
        for t in range(n_free, n_recur):
            s = self.core_step(s, e, t, cos, sin, cache, None)
        return self.coda(s, cos, sin, cache)

    def _free_iterations(self, n_recur: int) -> int:
        """Iterations run without a graph: all but the last k_bar (none when k_bar = 0)."""
        return max(n_recur - self._k, 0) if self._k else 0

    # ---- accounting ---------------------------------------------------------------------------------------------

    def components(self, n_recur):
        outer = [self.layers[i] for i in self._prelude + self._coda]
        core = [self.layers[i] for i in self._core]
        return [("blocks", outer, 1), ("blocks", core, n_recur), ("adapter", self.adapter, n_recur)]

    def depth_distribution(self, tail: float = 1e-12) -> list[tuple[int, float]]:
        """(r, P(r)) of the sampled training depth."""
        return poisson_lognormal_pmf(self.args.n_recur, SAMPLER_SIGMA, tail)

    def flops_per_token(self, seq_len=None, n_recur=None, training=True):
        """With sampled depth, training FLOPs are the expectation over the depth distribution (truncation applied
        per depth); with `fixed`, at evaluation and for any given n_recur, the count at that depth."""
        if not (training and n_recur is None and self.arch_args.sampling_scheme != "fixed"):
            return super().flops_per_token(seq_len, n_recur, training)
        return float(
            sum(p * super(Huginn, self).flops_per_token(seq_len, r, training) for r, p in self.depth_distribution())
        )

    def flop_terms(self, n_recur, seq_len):
        a = self.args
        blk = block_forward_flops(a, seq_len)
        step = 2.0 * (2 * a.dim) * a.dim + len(self._core) * blk  # adapter + core blocks
        n_free = self._free_iterations(n_recur)
        outer = (len(self._prelude) + len(self._coda)) * blk
        return [(outer, True), (n_free * step, False), ((n_recur - n_free) * step, True)]
