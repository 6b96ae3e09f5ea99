"""The latent view's data: a recurrent model's state after each iteration, through the iteration hooks of
`architectures.base.BaseLM` (`prelude`, then `core_step` n times), reduced to what the report draws.

Kept apart from the engine: it needs the hooks only, not the inference engine.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def states(model: Any, x: torch.Tensor, seed: int) -> torch.Tensor:
    """The recurrent state of one window (1, T) before the first iteration and after each of the trained depth's
    iterations: (n + 1, T, d), in float32."""
    n = model.resolve_n_recur(None)
    rule = model.resolve_extrapolate(None)
    T = x.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    torch.manual_seed(seed)  # a random initial state (three-part) draws from the global RNG
    with torch.no_grad():
        s, ctx = model.prelude(model.embed(x), cos, sin, None)
        out = [s[0].float()]
        for t in range(n):
            s = model.core_step(s, ctx, t, cos, sin, None, rule)
            out.append(s[0].float())
    return torch.stack(out)


def trace_latents(model: Any, windows: torch.Tensor, n_tokens: int, seed: int) -> list[dict[str, Any]]:
    """For each window (N, T+1), at the trained depth: per position and iteration i = 1..n the relative change
    ||s_i - s_(i-1)|| / ||s_i||, and the states of `n_tokens` evenly spaced positions at iterations 0..n projected on
    the first two principal components of those states (centred; the share of variance each explains)."""
    out = []
    for w in windows:
        x = w[None, :-1]
        st = states(model, x, seed)  # (n+1, T, d)
        n, T = st.shape[0] - 1, st.shape[1]
        conv = (st[1:] - st[:-1]).norm(dim=-1) / st[1:].norm(dim=-1).clamp_min(1e-12)  # (n, T)
        k = min(n_tokens, T)
        positions = sorted({round(i * (T - 1) / max(k - 1, 1)) for i in range(k)})
        pts = st[:, positions].transpose(0, 1).reshape(-1, st.shape[-1]).double()  # (P * (n+1), d)
        centred = pts - pts.mean(0, keepdim=True)
        _, sv, vh = torch.linalg.svd(centred, full_matrices=False)
        xy = (centred @ vh[:2].T).reshape(len(positions), n + 1, -1)
        var = sv**2
        explained = (var[:2] / var.sum().clamp_min(1e-300)).tolist()
        out.append(
            {
                "n_recur": n,
                "tokens": T,
                "token_ids_json": json.dumps(x[0].tolist()),
                "convergence_json": json.dumps([[round(float(v), 6) for v in r] for r in conv]),
                "positions_json": json.dumps(positions),
                "pca_json": json.dumps([[[round(float(v), 5) for v in p[:2]] for p in traj] for traj in xy]),
                "explained": json.dumps([round(e, 5) for e in explained]),
            }
        )
    return out
