"""Phi-3's fused projections: its checkpoints store each layer's q, k and v as one `qkv_proj` matrix
(rows q, then k, then v) and gate and up as one `gate_up_proj` (gate's rows, then up's), where this
decoder (and its kernels, and LoRA's targets) keep Llama's separate projections. The weights are split
on load and fused on save, so a checkpoint round-trips to the layout transformers and vLLM read.
"""

from __future__ import annotations

import torch

from tailrace.config.train import FUSED_TARGETS, fused_module
from tailrace.model.config import ModelConfig

# fused projection -> (its parent module, the projections it stacks, in row order)
GROUPS = {
    name: ("self_attn" if name == "qkv_proj" else "mlp", parts) for name, parts in FUSED_TARGETS.items()
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


# -- LoRA adapters in PEFT's files ----------------------------------------------------------------------
#
# PEFT adapts a fused model's fused modules: a Phi-3 adapter has one `qkv_proj` A (r, in) and B (q+k+v, r).
# tailrace's adapters keep one (A, B) per separate projection. Where every layer's parts share one A (an
# adapter PEFT trained, by an external trainer or as train.lora.init) `save_peft` writes PEFT's own form;
# otherwise each group block-diagonally: A the parts' A stacked (n r, in), B each part's B in its own rows
# and its own r columns (zero elsewhere; a part without an adapter is zero in both), rank n r and alpha
# n alpha by `rank_pattern` / `alpha_pattern` (the same scale alpha / r). Either is the same update, exactly.

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def fuse_adapter(weights: Weights, cfg: ModelConfig, rank: int) -> tuple[Weights, dict[str, int]]:
    """(`weights` keyed by the fused modules PEFT adapts, separate projections outside a group as they
    are; each fused module's rank over `rank`: 1 in PEFT's own form, n block-diagonally)."""
    rows = widths(cfg)
    out = {site: ab for site, ab in weights.items() if not _group_of(site[1])}
    layers = sorted({i for i, t in weights if _group_of(t)})
    wide = {}
    for name, (_, parts) in GROUPS.items():
        sites = [[weights.get((i, p)) for p in parts] for i in layers]
        sites = [s for s in sites if any(s)]
        if sites:
            shared = all(all(ab is not None and torch.equal(ab[0], s[0][0]) for ab in s) for s in sites)
            wide[name] = 1 if shared else len(parts)
    for i in layers:
        for name, (_, parts) in GROUPS.items():
            present = [p for p in parts if (i, p) in weights]
            if not present:
                continue
            if wide[name] == 1:  # one A for the fused module, each part's B in its rows
                out[i, name] = (weights[i, parts[0]][0], torch.cat([weights[i, p][1] for p in parts]))
                continue
            a0, b0 = weights[i, present[0]]
            a = a0.new_zeros(len(parts) * rank, a0.shape[1])
            b = b0.new_zeros(sum(rows[p] for p in parts), len(parts) * rank)
            top = 0
            for j, p in enumerate(parts):
                if (i, p) in weights:
                    a[j * rank : (j + 1) * rank] = weights[i, p][0]
                    b[top : top + rows[p], j * rank : (j + 1) * rank] = weights[i, p][1]
                top += rows[p]
            out[i, name] = (a, b)
    return out, wide


def split_adapter(weights: Weights, cfg: ModelConfig, rank: int, source: str) -> Weights:
    """`weights` with each fused module's adapter split into its parts' own: PEFT's (rank r: each part
    keeps the one A and its rows of B) or `fuse_adapter`'s (rank n r: each part its block; a part whose
    block is zero had no adapter). Raises ValueError naming what does not fit."""
    rows = widths(cfg)
    out = {}
    for (i, t), (a, b) in weights.items():
        if t not in GROUPS:
            out[i, t] = (a, b)
            continue
        parts = GROUPS[t][1]
        heights = [rows[p] for p in parts]
        if b.shape[0] != sum(heights) or a.shape[0] not in (rank, len(parts) * rank):
            raise ValueError(
                f"{source}: layer {i} {t} has A {tuple(a.shape)} and B {tuple(b.shape)}; a rank-{rank} adapter of "
                f"this base needs B of {sum(heights)} rows and rank {rank} (PEFT's) or {len(parts) * rank} "
                "(tailrace's, block-diagonal)"
            )
        for j, (p, bp) in enumerate(zip(parts, torch.split(b, heights))):
            if a.shape[0] == rank:
                out[i, p] = (a.clone(), bp.clone())
                continue
            cols = slice(j * rank, (j + 1) * rank)
            outside = torch.cat([bp[:, : cols.start], bp[:, cols.stop :]], dim=1)
            if outside.any():
                raise ValueError(
                    f"{source}: layer {i} {t}'s rank-{a.shape[0]} adapter is not block-diagonal ({p}'s rows "
                    f"reach past its columns); only PEFT's rank-{rank} or tailrace's own layout splits exactly"
                )
            if a[cols].any() or bp[:, cols].any():
                out[i, p] = (a[cols].clone(), bp[:, cols].clone())
    return out


def _group_of(target: str) -> str | None:
    """The fused module that stacks `target`, or None."""
    name = fused_module(target)
    return name if name != target else None


def rank_factor(cfg: ModelConfig) -> int:
    """How much wider than the adapter's rank `save_peft`'s files are on `cfg`'s family (3 on Phi-3: q, k, v)."""
    return max(len(parts) for _, parts in GROUPS.values()) if fused(cfg) else 1
