"""Three-part recurrent depth (prelude / recurrent core / coda), after Geiping et al. 2025 ("Huginn").

    e  = prelude(embedding)                      B1
    s0 ~ N(0, sigma^2)                           (B, T, d), fresh every forward
    r times:  s = core(W_ad [s ; e])             W_ad: 2d -> d, no bias; core = B2, B3
    s  = RMSNorm_rec(s)                          the extra d parameters (default; or an adapter bias)
    out = coda(s)                                B4

With r = 7 the effective depth is 1 + 7*2 + 1 = 16 and the unique parameters are the control's plus 2d^2 + d
(4,344,320 in the paper preset). The core can run any r >= 1 at test time: in the shared iteration API the
prelude is B1 plus the draw of s0, one iteration is the adapter and the core blocks, and the coda is the recurrent
norm and B4 (so the adaptive exit reads the coda's prediction after every iteration).

Options (off in "paper"): Huginn's sampled depth, tau ~ LogNormal(ln r_bar - sigma^2/2, sigma), r = Poisson(tau) + 1
with r_bar = n_recur, drawn per training forward; and truncated backprop through only the last k iterations
(`backprop_depth`; Huginn uses k = 8), the earlier ones run without building a graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from numpy.polynomial.hermite import hermgauss

from architectures import register
from architectures.base import ArchArgs, BaseLM
from architectures.blocks import RMSNorm, block_forward_flops


@dataclass(frozen=True, kw_only=True)
class ThreePartArgs(ArchArgs):
    n_prelude: int = 1  # blocks before the recurrent core
    n_coda: int = 1  # blocks after it
    state_init_std: float = 0.02  # sigma of the fresh initial state s0
    recur_sampling: Literal["fixed", "poisson-lognormal"] = "fixed"  # poisson-lognormal: Huginn's sampled depth
    recur_sigma: float = 0.5  # Huginn's lognormal sigma for sampled depth
    backprop_depth: int = 0  # 0 = backprop through every iteration; k > 0 = only the last k (Huginn k = 8)
    recur_out: Literal["norm", "bias"] = "norm"  # where the extra d parameters live: RMSNorm | adapter bias


@register("three-part", args=ThreePartArgs)
class ThreePart(BaseLM):
    label = "Three-part"
    description = "prelude / recurrent core with input injection / coda"
    draws_random_state = True  # s0 ~ N(0, sigma^2) per row, fresh every forward
    warm_startable = True  # s0 is drawn, the token enters every step through e

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 7

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        return None

    @classmethod
    def validate_args(cls, args: Any) -> None:
        a = cls.arch_args_of(args)
        if a.n_prelude < 0 or a.n_coda < 0 or a.n_prelude + a.n_coda >= args.n_layers:
            raise ValueError(
                f"model.n_prelude ({a.n_prelude}) + model.n_coda ({a.n_coda}) must leave at least one of "
                f"model.n_layers={args.n_layers} blocks for the recurrent core"
            )
        for key, ok, need in (
            ("state_init_std", a.state_init_std >= 0, ">= 0"),
            ("recur_sigma", a.recur_sigma > 0, "positive"),
            ("backprop_depth", a.backprop_depth >= 0, ">= 0 (0 = full)"),
        ):
            if not ok:
                raise ValueError(f"model.{key}: must be {need}, got {getattr(a, key)}")

    def build_extra(self, args: Any) -> None:
        a = self.arch_args
        self.adapter = nn.Linear(2 * args.dim, args.dim, bias=a.recur_out == "bias")  # W_ad: [s ; e] -> s
        self.recur_norm = RMSNorm(args.dim, eps=args.norm_eps) if a.recur_out == "norm" else None
        L = args.n_layers
        self._prelude = list(range(a.n_prelude))
        self._core = list(range(a.n_prelude, L - a.n_coda))
        self._coda = list(range(L - a.n_coda, L))

    def sample_n_recur(self) -> int:
        """Huginn's Poisson-lognormal depth, mean r_bar + 1 where r_bar = args.n_recur."""
        sigma = self.arch_args.recur_sigma
        mu = math.log(self.args.n_recur) - sigma**2 / 2
        tau = torch.empty(1).log_normal_(mean=mu, std=sigma)
        return int(torch.poisson(tau).item()) + 1

    def schedule(self, h, cos, sin, n_recur, cache):
        a = self.arch_args
        for i in self._prelude:
            h = self.layers[i](h, cos, sin, cache=cache)
        e = h  # (B, T, d)
        if self.training and a.recur_sampling == "poisson-lognormal":
            n_recur = self.sample_n_recur()
        s = torch.randn_like(e) * a.state_init_std  # s0, (B, T, d)
        k = a.backprop_depth if self.training else 0
        n_free = max(n_recur - k, 0) if k else 0  # iterations run without a graph
        with torch.no_grad():
            for _ in range(n_free):
                s = self._core_step(s, e, cos, sin, cache)
        for _ in range(n_recur - n_free):
            s = self._core_step(s, e, cos, sin, cache)
        if self.recur_norm is not None:
            s = self.recur_norm(s)
        for i in self._coda:
            s = self.layers[i](s, cos, sin, cache=cache)
        return s

    def _core_step(self, s, e, cos, sin, cache):
        s = self.adapter(torch.cat([s, e], dim=-1)).to(e.dtype)  # (B, T, 2d) -> (B, T, d), back in the residual dtype
        for i in self._core:
            s = self.layers[i](s, cos, sin, cache=cache)
        return s

    def prelude(self, h, cos, sin, cache):
        for i in self._prelude:
            h = self.layers[i](h, cos, sin, cache=cache)
        return torch.randn_like(h) * self.arch_args.state_init_std, h  # (s0, e)

    def core_step(self, s, ctx, t, cos, sin, cache, extrapolate):
        return self._core_step(s, ctx, cos, sin, cache)

    def coda(self, s, cos, sin, cache):
        if self.recur_norm is not None:
            s = self.recur_norm(s)
        for i in self._coda:
            s = self.layers[i](s, cos, sin, cache=cache)
        return s

    def components(self, n_recur):
        outer = [self.layers[i] for i in self._prelude + self._coda]
        core = [self.layers[i] for i in self._core]
        parts = [("blocks", outer, 1), ("blocks", core, n_recur), ("adapter", self.adapter, n_recur)]
        if self.recur_norm is not None:
            parts.append(("recurrent_norm", self.recur_norm, 1))
        return parts

    def depth_distribution(self, tail: float = 1e-12) -> list[tuple[int, float]]:
        """(r, P(r)) of the sampled training depth r = Poisson(tau) + 1, tau ~ LogNormal(ln r_bar - sigma^2/2, sigma),
        integrated over tau by Gauss-Hermite quadrature; r runs until the remaining mass is below `tail`."""
        sigma = self.arch_args.recur_sigma
        mu = math.log(self.args.n_recur) - sigma**2 / 2
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

    def flops_per_token(self, seq_len=None, n_recur=None, training=True):
        """With Huginn's sampled depth, training FLOPs are the expectation over the depth distribution (mean depth
        r_bar + 1, truncation applied per depth); otherwise, and for any given n_recur, the fixed-depth count."""
        if not (training and n_recur is None and self.arch_args.recur_sampling == "poisson-lognormal"):
            return super().flops_per_token(seq_len, n_recur, training)
        return float(
            sum(p * super(ThreePart, self).flops_per_token(seq_len, r, training) for r, p in self.depth_distribution())
        )

    def flop_terms(self, n_recur, seq_len):
        a = self.args
        blk = block_forward_flops(a, seq_len)
        step = 2.0 * (2 * a.dim) * a.dim + len(self._core) * blk  # adapter + core blocks
        k = self.arch_args.backprop_depth
        n_free = max(n_recur - k, 0) if k else 0
        outer = (len(self._prelude) + len(self._coda)) * blk
        return [(outer, True), (n_free * step, False), ((n_recur - n_free) * step, True)]
