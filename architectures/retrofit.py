"""Weight surgery: a recurrent model's initial weights taken from a trained plain (non-recurrent) transformer.

Two published recipes, both pure tensor maps from the parent's state dict to the target's:

- Relaxed recursive transformers (Bae et al.): a looped model of L shared blocks run R times replaces a parent of
  L*R layers in the cycle layout, shared block l standing for parent layers l, l+L, l+2L, ... (pass p, block l is
  parent layer p*L + l). The shared weights come from `stepwise` (L parent layers picked at even intervals, first and
  last kept) or `average` (the mean of the layers a block replaces). The relaxed model's depth-wise LoRA at (pass p,
  block l) is initialised from the truncated SVD of the residual W_parent(p*L + l) - W_shared(l) at the LoRA's rank
  (`svd`), so at full rank every pass reproduces its parent layer's projections exactly, or left at B = 0 (`zero`),
  the plain looped model.
- Retrofitted recurrence (McLeish et al.): a prelude / core / coda model takes its prelude from the parent's first
  layers and its core and coda from the parent's last ones, dropping the middle (`select`); the input-injection
  adapter is new, see `select_state`.

The token embedding (tied with the head) and the final norm always come from the parent; anything the parent cannot
provide (FraiLT's iteration vectors, the recurrent norm) keeps the target model's own initialisation. Plain PyTorch,
no knowledge of benchctl.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from architectures.base import BaseLM
from architectures.blocks import PROJECTIONS

Tensor = torch.Tensor
StateDict = Mapping[str, Tensor]

INITS = ("stepwise", "average", "select")
LORA_INITS = ("svd", "zero")

# Every tensor of one block, relative to `layers.<i>.`: the seven projections and the two norms.
_PROJ_KEYS = {
    p: f"attention.{p}.weight" if p in ("wq", "wk", "wv", "wo") else f"feed_forward.{p}.weight" for p in PROJECTIONS
}
_NORM_KEYS = ("attention_norm.weight", "ffn_norm.weight")
BLOCK_KEYS = tuple(_PROJ_KEYS.values()) + _NORM_KEYS
_TRUNK_KEYS = ("tok_embeddings.weight", "output.weight", "norm.weight")


def n_parent_layers(parent: StateDict) -> int:
    """How many blocks the parent's state dict holds (`layers.<i>.` prefixes)."""
    found = {int(m.group(1)) for k in parent if (m := re.match(r"layers\.(\d+)\.", k))}
    if not found:
        raise ValueError("the parent state dict has no transformer layers (no 'layers.<i>.' keys)")
    return max(found) + 1


def stepwise_indices(n_parent: int, n_target: int) -> list[int]:
    """`n_target` parent layer indices at even intervals over 0..n_parent-1, always the first and the last."""
    if n_target > n_parent:
        raise ValueError(
            f"stepwise needs at least {n_target} parent layers (one per target block), the parent has {n_parent}"
        )
    if n_target == 1:
        return [0]
    return [round(i * (n_parent - 1) / (n_target - 1)) for i in range(n_target)]


def cycle_indices(n_blocks: int, n_passes: int, block: int) -> list[int]:
    """The parent layers shared block `block` stands for in the cycle layout: block, block+L, block+2L, ..."""
    return [p * n_blocks + block for p in range(n_passes)]


def block_tensors(parent: StateDict, layer: int) -> dict[str, Tensor]:
    """One parent block's tensors, keyed relative to its `layers.<i>.` prefix."""
    return {k: parent[f"layers.{layer}.{k}"] for k in BLOCK_KEYS}


def shared_blocks(parent: StateDict, n_blocks: int, n_passes: int, init: str) -> list[dict[str, Tensor]]:
    """The L shared blocks of a looped model (L = n_blocks, run n_passes times) from the parent's layers.

    `stepwise` copies whole parent layers (projections and norms) picked at even intervals; `average` makes each
    block's projections and norm gains the mean over the parent layers it replaces in the cycle layout, which needs
    a parent of exactly L * R layers.
    """
    n_parent = n_parent_layers(parent)
    if init == "stepwise":
        return [
            {k: v.clone() for k, v in block_tensors(parent, i).items()} for i in stepwise_indices(n_parent, n_blocks)
        ]
    if init == "average":
        _require_cycle(n_parent, n_blocks, n_passes, "average")
        out = []
        for b in range(n_blocks):
            layers = [block_tensors(parent, i) for i in cycle_indices(n_blocks, n_passes, b)]
            out.append(
                {k: torch.stack([t[k].float() for t in layers]).mean(0).to(layers[0][k].dtype) for k in BLOCK_KEYS}
            )
        return out
    raise ValueError(f"a looped model takes --init stepwise or average, got {init!r}")


def _require_cycle(n_parent: int, n_blocks: int, n_passes: int, what: str) -> None:
    if n_parent != n_blocks * n_passes:
        raise ValueError(
            f"{what} maps parent layer p*L + l to pass p of block l, so it needs a parent of "
            f"L x R = {n_blocks} x {n_passes} = {n_blocks * n_passes} layers; the parent has {n_parent}"
        )


def svd_lora(residual: Tensor, rank: int, scale: float) -> tuple[Tensor, Tensor]:
    """(A (rank, in), B (out, rank)) with scale * B @ A the best rank-`rank` approximation of `residual` (out, in).

    The singular values are split evenly between the two factors (A = sqrt(S) Vh, B = U sqrt(S) / scale), so neither
    starts much larger than the other; ranks beyond min(out, in) are zero rows/columns, which at full rank makes the
    approximation exact.
    """
    out_f, in_f = residual.shape
    U, S, Vh = torch.linalg.svd(residual.double(), full_matrices=False)
    k = min(rank, S.numel())
    root = S[:k].sqrt()
    A = torch.zeros(rank, in_f, dtype=torch.float64)
    B = torch.zeros(out_f, rank, dtype=torch.float64)
    A[:k] = root[:, None] * Vh[:k]
    B[:, :k] = U[:, :k] * root[None, :] / scale
    return A.to(residual.dtype), B.to(residual.dtype)


def check_shapes(parent: StateDict, target: StateDict) -> None:
    """Refuse a parent whose trunk or block tensors differ in shape from the target's, naming both shapes."""
    for key in _TRUNK_KEYS + tuple(f"layers.0.{k}" for k in BLOCK_KEYS):
        if key not in parent or key not in target:
            continue
        if tuple(parent[key].shape) != tuple(target[key].shape):
            raise ValueError(
                f"the parent's {key} has shape {tuple(parent[key].shape)} but the target's is "
                f"{tuple(target[key].shape)}: the two models differ in width (model.dim / hidden_dim / heads / vocab)"
            )


def _base(parent: StateDict, target: BaseLM) -> dict[str, Tensor]:
    """The target's own state dict with the trunk (embedding, tied head, final norm) taken from the parent."""
    out = {k: v.detach().clone() for k, v in target.state_dict().items()}
    check_shapes(parent, out)
    for key in _TRUNK_KEYS:
        if key in out:
            out[key] = parent[key].detach().clone()
    return out


def _put_block(out: dict[str, Tensor], index: int, tensors: Mapping[str, Tensor]) -> None:
    for k, v in tensors.items():
        out[f"layers.{index}.{k}"] = v.detach().clone().to(out[f"layers.{index}.{k}"].dtype)


def looped_state(parent: StateDict, target: BaseLM, init: str, lora_init: str = "svd") -> dict[str, Tensor]:
    """A looped target's state dict (control, FraiLT, relaxed: `target.layers` shared over `n_recur` passes).

    For the relaxed model (a `lora[t][l][proj]` set per pass and block), `lora_init="svd"` sets each LoRA from the
    truncated SVD of W_parent(t*L + l) - W_shared(l) at the LoRA's rank, which needs the cycle layout's L x R parent
    layers; `"zero"` sets B = 0 (A keeps the target's own draw), so the model starts as the plain looped one.
    """
    if lora_init not in LORA_INITS:
        raise ValueError(f"lora init must be one of {', '.join(LORA_INITS)}, got {lora_init!r}")
    args = target.args
    L, R = args.n_layers, args.n_recur
    out = _base(parent, target)
    shared = shared_blocks(parent, L, R, init)
    for b, tensors in enumerate(shared):
        _put_block(out, b, tensors)
    lora = getattr(target, "lora", None)  # the relaxed model's lora[t][b][proj]; other looped models have none
    if lora is None:
        return out
    if lora_init == "svd":
        _require_cycle(n_parent_layers(parent), L, R, "SVD LoRA init")
    for t in range(R):
        for b in range(L):
            for proj, rel in _PROJ_KEYS.items():
                prefix = f"lora.{t}.{b}.{proj}"
                if lora_init == "zero":
                    out[f"{prefix}.B"] = torch.zeros_like(out[f"{prefix}.B"])
                    continue
                residual = parent[f"layers.{parent_layer_of(L, t, b)}.{rel}"].float() - shared[b][rel].float()
                rank = out[f"{prefix}.A"].shape[0]
                A, B = svd_lora(residual, rank, lora[t][b][proj].scale)
                out[f"{prefix}.A"], out[f"{prefix}.B"] = A.to(out[f"{prefix}.A"].dtype), B.to(out[f"{prefix}.B"].dtype)
    return out


def select_state(parent: StateDict, target: BaseLM) -> dict[str, Tensor]:
    """A prelude / core / coda target's state dict by selection (McLeish et al.).

    With P prelude, C core and K coda blocks and a parent of N >= P + C + K layers: the prelude is parent layers
    0..P-1, the core parent layers N-K-C..N-K-1 and the coda parent layers N-K..N-1; the middle layers are dropped.
    The adapter, which maps [s ; e] (2d) to the core's input (d), is set to W_ad = [0 | I]: it ignores the state and
    passes the prelude output e through, so the first core iteration computes core(e), exactly the parent's path
    from its prelude layers straight into its last ones (an adapter bias, when the target has one, starts at zero).
    The recurrent norm keeps the target's initialisation (unit gains).
    """
    a = target.arch_args
    n_layers = target.args.n_layers
    P, K = a.n_prelude, a.n_coda
    C = n_layers - P - K
    N = n_parent_layers(parent)
    if N < n_layers:
        raise ValueError(
            f"select needs at least {n_layers} parent layers ({P} prelude + {C} core + {K} coda "
            f"blocks), the parent has {N}"
        )
    out = _base(parent, target)
    picks = list(range(P)) + list(range(N - K - C, N))
    for b, layer in enumerate(picks):
        _put_block(out, b, block_tensors(parent, layer))
    d = target.args.dim
    w = torch.zeros_like(out["adapter.weight"])  # (d, 2d): columns [:d] read s, [d:] read e
    w[:, d:] = torch.eye(d, dtype=w.dtype)
    out["adapter.weight"] = w
    if "adapter.bias" in out:
        out["adapter.bias"] = torch.zeros_like(out["adapter.bias"])
    return out


def retrofit_state(
    parent: StateDict | nn.Module, target: BaseLM, init: str, lora_init: str = "svd"
) -> dict[str, Tensor]:
    """The target model's initial state dict built from the parent's: `select` for a model with an input-injection
    adapter (three-part), `stepwise` or `average` for looped ones. `target` is a freshly built model of the target
    architecture: it supplies the shapes, the recurrence and the init of whatever the parent cannot provide."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    parent = as_state_dict(parent)
    has_adapter = hasattr(target, "adapter")
    if init == "select":
        if not has_adapter:
            raise ValueError(
                f"select builds a prelude / core / coda model; {type(target).__name__} is a looped "
                "model: use stepwise or average"
            )
        return select_state(parent, target)
    if has_adapter:
        raise ValueError(f"{type(target).__name__} is a prelude / core / coda model: use select, not {init}")
    return looped_state(parent, target, init, lora_init)


def describe(init: str, lora_init: str | None) -> str:
    """The init method as one recorded word: "average+svd", "stepwise+zero", "select"."""
    return f"{init}+{lora_init}" if lora_init else init


def parent_layer_of(n_blocks: int, pass_index: int, block: int) -> int:
    """The parent layer that (pass, block) stands for in the cycle layout."""
    return pass_index * n_blocks + block


def as_state_dict(obj: Any) -> dict[str, Tensor]:
    """A module's state dict, or a state dict as given."""
    return obj.state_dict() if isinstance(obj, nn.Module) else dict(obj)
