"""Grouped-query self-attention over whole sequences (the model's one forward: training, scoring, and
the reference the engine's backends are pinned to; cached decoding lives in `tailrace.engine`).

`CausalStep` (whole right-padded sequences, causal SDPA) is built once per forward call and shared by
all layers, so the RoPE lookup happens once, not once per layer.

Query head h reads kv head h // G (G = heads / kv_heads), as HF's `repeat_kv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.config import ModelConfig
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

    def forward(self, h: torch.Tensor, step: CausalStep) -> torch.Tensor:
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        o = step.attend(q, k, v)  # (B, T, H, D), possibly strided
        return self.o_proj(o.reshape(B, T, -1))


class CausalStep:
    """Each sequence attends causally to itself."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # (B or 1, T, 1, D)

    def attend(self, q, k, v):
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2)
