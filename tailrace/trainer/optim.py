"""The optimizer over the policy's flat parameter buffer (see tailrace/model/flat.py), and the
data-parallel ranks' sum of its gradients."""

from __future__ import annotations

import torch
from torch import nn


def build_adamw(
    model: nn.Module, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains and biases are not shrunk toward zero)."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def all_reduce_grads(params: list[nn.Parameter]) -> None:
    """Sum every rank's gradients of `params` (one flat all-reduce; a missing gradient counts as 0)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    o = 0
    for p, g in zip(params, grads):
        p.grad = flat[o : o + g.numel()].view_as(g).clone()
        o += g.numel()
