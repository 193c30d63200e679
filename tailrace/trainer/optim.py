"""The optimizer over the policy's flat parameter buffer (see tailrace/model/flat.py)."""

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
