"""Universal Transformer with Adaptive Computation Time (Dehghani et al. 2019, "Universal Transformers"; the halting
mechanism of Graves 2016, "Adaptive Computation Time for Recurrent Neural Networks").

One shared step is applied up to N times (N = `model.n_recur`, the trained and largest depth, default 4); every token
decides, per step, how much longer it ponders:

    s_0 = embedding
    step n = 1..N, for every token t:
        x     = s_{n-1} + E_step[n]                 the step ("time") signal
        p_n   = sigmoid(w_h . x + b_h)              the halting unit, one scalar per token
        a token still running halts at step n once  sum_{m<=n} p_m > 1 - eps,  or at n = N,
        and then uses its remainder R = 1 - sum_{m<n} p_m in place of p_n
        w_n   = p_n while running, R at the halting step, 0 afterwards
        s_n   = blocks(x)                           B1..B(n_layers), shared by every step
        out   = s_n * w_n + out * (1 - w_n)         `act_type=basic` (the Universal Transformer's code)
              | out + s_n * w_n                     `act_type=accumulated` (Graves's sum_n p_n s_n)
    loss = cross-entropy(head(norm(out))) + tau * mean_t (N(t) + R(t))   the ponder cost, an auxiliary loss

N(t) is the number of steps token t took (its ponder time is N(t) + R(t)). The loop stops as soon as every token of
the batch has halted (the reference code's `while_loop` condition), so a forward runs max_t N(t) steps, never more
than N; that is the compute it reports (`add_compute`), and it is what the run's training FLOPs count. Every token is
transformed at every step the loop runs (a halted token's state keeps being updated, only its output is frozen), as
in the reference code, so the arithmetic is dense: the spent compute is the number of steps the batch needed, not the
mean of N(t). The analytic `flops_per_token` is the upper bound, N steps.

Causality: the training forward is causal. A token's halting and state read only itself and earlier positions
(causal attention), its output stops changing once it halts, and the loop runs at least as long as it runs, so a
later token can make the loop longer but never changes an earlier token's output. Under a KV cache (generation) all N
steps always run, so every forward fills the same cache slots; the extra steps only move states whose outputs are
frozen, which gives the same logits as the early-stopping forward.

Adaptations to this harness, each stated:
- The shared step is the trunk's `n_layers` llama2.c blocks (pre-norm RMSNorm, SwiGLU, RoPE), one pass over them per
  step, as the harness's other looped models; the paper's step is one attention + transition layer. The trained depth
  is N = 4 steps by default (16 block applications at most in the tiny and paper presets with 4 blocks).
- Positions come from RoPE inside every block, not a sinusoid added at each step. The step signal is a learned
  vector per step (the reference code's `learned` step timing signal), initialised to zero so that the model starts as
  the plain looped one; a sinusoid of the reference code's scale (~1 per coordinate) would swamp llama2.c's
  embeddings (std 0.02).
- Halting-unit initialisation follows the reference code: bias `act_bias_init` = 1.0 (p ~ 0.73 at the start, so every
  token halts at step 2 until training says otherwise), weights N(0, 0.02) like every Linear here.
- Defaults from the reference code's adaptive Universal Transformer: eps = 0.01, tau = 0.01.
- At step N a token still running halts with its remainder (Graves); the reference code instead ends the loop with
  such tokens' weights summing to less than one.
- Padding is never present (fixed windows), so every position ponders and counts in the ponder cost.

Unique parameters: the control's plus N*d (step signals) + d + 1 (halting unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from architectures import register
from architectures.base import ArchArgs, BaseLM


@dataclass(frozen=True, kw_only=True)
class UTACTArgs(ArchArgs):
    act_type: Literal["basic", "accumulated"] = "basic"  # how the halting weights combine the step states
    act_epsilon: float = 0.01  # halt once the cumulative halting probability exceeds 1 - eps
    act_tau: float = 0.01  # weight of the ponder cost mean(N + R) in the training loss
    act_bias_init: float = 1.0  # initial bias of the halting unit


@register("ut-act", args=UTACTArgs)
class UTACT(BaseLM):
    label = "UT-ACT"
    description = "shared blocks applied until each token halts (Universal Transformer with ACT)"

    reports_stats = True
    adaptive_compute = True  # halting decides each token's depth

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        return 4

    @classmethod
    def validate_args(cls, args: Any) -> None:
        a = cls.arch_args_of(args)
        if not 0.0 < a.act_epsilon < 1.0:
            raise ValueError(f"model.act_epsilon: must be in (0, 1), got {a.act_epsilon}")
        if not a.act_tau >= 0.0:
            raise ValueError(f"model.act_tau: must be >= 0, got {a.act_tau}")

    def build_extra(self, args: Any) -> None:
        self.step_emb = nn.Parameter(torch.zeros(args.n_recur, args.dim))  # E_step: (N, d)
        self.halt = nn.Linear(args.dim, 1)  # the halting unit

    def init_extra(self, args: Any) -> None:
        nn.init.zeros_(self.step_emb)
        nn.init.constant_(self.halt.bias, self.arch_args.act_bias_init)

    def schedule(self, h, cos, sin, n_recur, cache):
        a = self.arch_args
        B, T, _ = h.shape
        threshold = 1.0 - a.act_epsilon
        halting = h.new_zeros(B, T, dtype=torch.float32)  # cumulative halting probability
        remainders = torch.zeros_like(halting)
        n_updates = torch.zeros_like(halting)
        out = torch.zeros_like(h)
        state = h
        steps = 0
        for n in range(n_recur):
            if cache is None and n > 0 and not bool(((halting < threshold) & (n_updates < n_recur)).any()):
                break  # every token has halted: the rest would change no output
            x = state + self.step_emb[n]
            p = torch.sigmoid(self.halt(x).squeeze(-1).float())  # (B, T)
            running = (halting < 1.0).float()
            reached = halting + p * running
            last = n == n_recur - 1  # at the last step every token still running halts
            new_halted = (reached > threshold).float() * running if not last else running
            running = (reached <= threshold).float() * running if not last else torch.zeros_like(running)
            halting = halting + p * running
            remainders = remainders + new_halted * (1.0 - halting)
            halting = halting + new_halted * remainders
            n_updates = n_updates + running + new_halted
            w = (p * running + new_halted * remainders).unsqueeze(-1).to(h.dtype)  # (B, T, 1)
            state = x
            for layer in self.layers:
                state = layer(state, cos, sin, cache=cache)
            out = state * w + out * (1 - w) if a.act_type == "basic" else out + state * w
            steps += 1
        ponder = (n_updates + remainders).mean()
        self.add_aux_loss("ponder", ponder, a.act_tau)
        self.add_metric("ponder_time", ponder.detach())
        self.add_metric("mean_depth", n_updates.mean().detach())
        self.add_metric("steps_run", steps)
        for k in range(1, n_recur + 1):  # the depth distribution: fraction of tokens that took k steps
            self.add_metric(f"depth_frac_{k}", (n_updates == k).float().mean().detach())
        self.add_compute(steps * self._step_flops(T))
        return out

    def _step_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one step: the halting unit and a pass over the blocks."""
        return 2.0 * self.args.dim + len(self.layers) * self.block_flops(seq_len)

    def components(self, n_recur):
        return [
            ("blocks", self.layers, n_recur),
            ("step_encoding", self.step_emb, 1),
            ("halting_unit", self.halt, n_recur),
        ]

    def flop_terms(self, n_recur, seq_len):
        return [(n_recur * self._step_flops(seq_len), True)]
