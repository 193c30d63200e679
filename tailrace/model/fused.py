"""Phi-3's fused projections: its checkpoints store each layer's q, k and v as one `qkv_proj` matrix
(rows q, then k, then v) and gate and up as one `gate_up_proj` (gate's rows, then up's), where this
decoder (and its kernels, and LoRA's targets) keep Llama's separate projections. The weights are split
on load and fused on save, so a checkpoint round-trips to the layout transformers and vLLM read.
"""

from __future__ import annotations

import torch

from tailrace.model.config import ModelConfig

# fused projection -> (its parent module, the projections it stacks, in row order)
GROUPS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
}
FUSED_FAMILIES = ("phi3",)


def fused(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s family stores its projections fused."""
    return cfg.model_type in FUSED_FAMILIES


def widths(cfg: ModelConfig) -> dict[str, int]:
    """Each separate projection's output rows."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}


def split(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint's state with its fused weights split into the separate projections (unchanged for a
    family that stores them apart). A fused weight of the wrong height is left for the loader to name."""
    if not fused(cfg):
        return state
    rows = widths(cfg)
    out = {}
    for name, t in state.items():
        parent, fused_name, parts = _fused_key(name)
        if parts is None or t.shape[0] != sum(rows[p] for p in parts):
            out[name] = t
            continue
        for p, piece in zip(parts, torch.split(t, [rows[p] for p in parts])):
            out[name.replace(f"{parent}.{fused_name}.", f"{parent}.{p}.")] = piece
    return out


def join(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` with each fused group's separate projections stacked back into the fused weight."""
    if not fused(cfg):
        return state
    out = dict(state)
    for name in [n for n in state if ".self_attn.q_proj." in n or ".mlp.gate_proj." in n]:
        for fused_name, (parent, parts) in GROUPS.items():
            first = f".{parent}.{parts[0]}."
            if first in name:
                keys = [name.replace(first, f".{parent}.{p}.") for p in parts]
                out[name.replace(first, f".{parent}.{fused_name}.")] = torch.cat([out.pop(k) for k in keys])
    return out


def _fused_key(name: str) -> tuple[str, str, tuple[str, ...] | None]:
    for fused_name, (parent, parts) in GROUPS.items():
        if f".{parent}.{fused_name}." in name:
            return parent, fused_name, parts
    return "", "", None
