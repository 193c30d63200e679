"""Grouped-query self-attention and the two ways a forward call runs it.

`CausalStep` (training: whole right-padded sequences, causal SDPA) and `CachedStep` (prefill chunks
and decode steps over a `KVCache`) are built once per forward call and shared by all layers, so the
per-call work (rope lookup, cache write indices, mask) happens once, not once per layer.

Query head h reads kv head h // G (G = heads / kv_heads), as HF's `repeat_kv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.config import ModelConfig
from tailrace.model.kv_cache import KVCache
from tailrace.model.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # As HF: Llama's attention_bias also covers o_proj; Qwen2's o_proj never has one.
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, cfg.hidden_size, bias=bias and cfg.model_type == "llama"
        )

    def forward(self, h: torch.Tensor, step: CausalStep | CachedStep, layer: int) -> torch.Tensor:
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        o = step.attend(q, k, v, layer)  # (B, T, H, D), possibly strided
        return self.o_proj(o.reshape(B, T, -1))


class CausalStep:
    """Training path: each sequence attends causally to itself."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # (B or 1, T, 1, D)

    def attend(self, q, k, v, layer):
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2)


class CachedStep:
    """Cached path: write this call's k/v into the cache rows, then attend over cache positions [0, S)
    with key_pos <= query_pos. The caller's contract is in `tailrace.model.decoder`."""

    __slots__ = ("cos", "sin", "cache", "widx", "rows", "S", "mask", "scale", "kernel")

    def __init__(
        self,
        positions: torch.Tensor,
        S: int,
        cache: KVCache,
        rows: slice | torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        scale: float,
    ):
        B, T = positions.shape
        dev = positions.device
        self.cos, self.sin, self.cache, self.S, self.scale = cos, sin, cache, S, scale  # cos/sin (B, T, 1, D)
        if isinstance(rows, slice):
            start, stop, stride = rows.indices(cache.num_rows)
            if stride != 1 or stop - start != B:
                raise ValueError(
                    f"rows={rows} must select {B} consecutive cache rows (one per sequence); "
                    f"the cache has {cache.num_rows}"
                )
            self.rows = slice(start, stop)
            row_ids = torch.arange(start, stop, device=dev)
        else:
            if rows.shape != (B,):
                raise ValueError(
                    f"rows has shape {tuple(rows.shape)}; pass one cache row id per sequence, ({B},)"
                )
            self.rows = row_ids = rows
        Hkv, L = cache.k[0].shape[1], cache.max_len
        # Flat index of each written k/v vector in cache.k[l].view(-1, D), ordered (b, t, kv_head).
        self.widx = (
            (row_ids[:, None, None] * Hkv + torch.arange(Hkv, device=dev)) * L + positions[:, :, None]
        ).reshape(-1)
        visible = (torch.arange(S, device=dev) <= positions[:, :, None]).unsqueeze(1)  # (B, 1, T, S)
        if T == 1:
            # Single-query attention as two batched matmuls beats CPU SDPA (measured); it takes the
            # mask as an additive bias. masked_fill_ -inf is safe: key 0 is always visible.
            self.mask = torch.zeros(visible.shape, dtype=cache.dtype, device=dev).masked_fill_(
                ~visible, -torch.inf
            )
            self.kernel = self._single_query
        else:
            self.mask, self.kernel = visible, self._sdpa

    def attend(self, q, k, v, layer):
        ck, cv = self.cache.k[layer], self.cache.v[layer]
        D = ck.shape[-1]
        ck.view(-1, D).index_copy_(0, self.widx, k.reshape(-1, D).to(ck.dtype))
        cv.view(-1, D).index_copy_(0, self.widx, v.reshape(-1, D).to(cv.dtype))
        if isinstance(self.rows, slice):  # views (B, Hkv, S, D): no copy
            kk, vv = ck[self.rows, :, : self.S], cv[self.rows, :, : self.S]
        else:  # gathers: a copy of B rows' first S positions
            kk, vv = (
                ck[:, :, : self.S].index_select(0, self.rows),
                cv[:, :, : self.S].index_select(0, self.rows),
            )
        return self.kernel(q, kk, vv)

    def _sdpa(self, q, kk, vv):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=self.mask, enable_gqa=True)
        return o.transpose(1, 2)

    def _single_query(self, q, kk, vv):
        B, _, H, D = q.shape  # q (B, 1, H, D) viewed as (B, Hkv, G, D)
        s = torch.matmul(q.view(B, kk.shape[1], -1, D) * self.scale, kk.transpose(-1, -2))  # (B, Hkv, G, S)
        p = torch.softmax(s.add_(self.mask).float(), dim=-1).to(vv.dtype)  # fp32 softmax, as HF eager
        return torch.matmul(p, vv).view(B, 1, H, D)
