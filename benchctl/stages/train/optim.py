"""The optimizer a run trains with (`train.optimizer`): AdamW, or Muon for the hidden matrices with AdamW beside it.

AdamW follows llama2.c `configure_optimizers`: weight decay on every >=2-D tensor (matrices, embeddings, LoRA, depth
encodings), none on norms and biases.

Muon (PyTorch's own `torch.optim.Muon`) orthogonalises each update of a 2-D matrix by Newton-Schulz iterations, which
only makes sense for the hidden layers' matrices: its documentation asks for a standard optimizer on everything
else. So the projections of the blocks, the LoRA factors and the input-injection adapter (the weights of
`nn.Linear` modules and `A`/`B` of LoRA modules, the tied head excepted) go to Muon; the tied embedding/head, norm
gains, biases and per-pass depth encodings go to AdamW with the recipe's own groups. Muon's learning rate is
adjusted per matrix shape the Moonshot way ("match_rms_adamw"), which its documentation says lets it reuse AdamW's
learning rate and weight decay, so the run's schedule drives both halves unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from architectures.blocks import LoRA


def adamw(params: list[nn.Parameter], cfg: Any, device: torch.device) -> torch.optim.AdamW:
    """AdamW, two groups: decay on >=2-D tensors, none on the rest. Fused kernel on CUDA and CPU: one kernel per
    tensor instead of a dozen (on CPU the foreach path is a Python-level loop of per-op kernels, slower even than
    the plain loop; measured with `benchctl bench`); elsewhere PyTorch's default."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra: dict[str, Any] = {"fused": True} if device.type in ("cuda", "cpu") else {}
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), **extra)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the hidden layers: every `nn.Linear` weight and LoRA factor, except the (tied) output head."""
    head = getattr(model, "output", None)
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            cands = [module.weight]
        elif isinstance(module, LoRA):
            cands = [module.A, module.B]
        else:
            continue
        for p in cands:
            if p.requires_grad and p.dim() == 2 and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    if head is not None:
        tied = {id(p) for p in head.parameters()}
        out = [p for p in out if id(p) not in tied]
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices and AdamW on everything else, stepped together as one optimizer.

    `param_groups` lists both optimizers' groups (the trainer sets each group's learning rate every step), and the
    state dict holds both states under their own keys, so a checkpoint resumes both exactly.
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw_: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw_
        # the two children own the state; this wrapper only forwards (no Optimizer.__init__: it would re-group)
        self.defaults = {}
        self.state = {}  # type: ignore[assignment]

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])

    def __repr__(self) -> str:
        return f"MuonAdamW(muon={len(self.muon.param_groups[0]['params'])} matrices, adamw={self.adamw!r})"


def make_optimizer(model: nn.Module, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """The run's optimizer over the model's trainable parameters, as `train.optimizer` says."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.train.optimizer == "adamw":
        return adamw(params, cfg, device)
    hidden = hidden_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in ids]
    muon = torch.optim.Muon(
        hidden, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    return MuonAdamW(muon, adamw(rest, cfg, device))
