"""Grouped-query self-attention over whole sequences (the model's one forward: training, scoring, and
the reference the engine's backends are pinned to; cached decoding lives in `tailrace.engine`).

`CausalStep` (whole right-padded sequences, causal SDPA) is built once per forward call and shared by
all layers, so the RoPE lookup happens once, not once per layer.

Query head h reads kv head h // G (G = heads / kv_heads), as HF's `repeat_kv`.

On CPU in bf16/fp16, sequences of up to `EAGER_MAX_T` tokens attend eagerly (scores by one batched
matmul and softmax in fp32 with a cached causal mask, then a second matmul, as HF's "eager" attention)
instead of through SDPA: torch's CPU flash kernel ran reduced precision at 44-60% of a bf16 trainer
step at RL lengths (bench/trainer.py, 64 rows of the built-in model, 2026-12-02: 14.4k -> 25.6k tok/s at
64 tokens, 14.7k -> 22.1k at 128, 12.8k -> 18.1k at 160, 13.0k -> 14.0k at 192, 15.5k -> 10.7k at
256, where SDPA wins). fp32 SDPA is as fast as eager, and CUDA's flash kernels are not slow, so both
keep SDPA. The price is memory: autograd keeps the probabilities, ~6 x heads x T bytes a token and
layer, which the trainer's micro-batch budget counts (`trainer.memory.eager_attention_bytes`).
A windowed layer (Mistral v0.1, OLMo 3, Gemma) attends a window of queries at a time over the keys they
can reach, once a sequence is over two windows long (`windowed_attention`; SDPA under a window mask
computes every score: 2.1x slower at 1,024 tokens with a window of 128, bench/window.py --trainer).
`sdpa_only()` turns the eager path off: the warm starts' recipes were fixed before it existed, and the
cached default model is what they train through SDPA (eager attention rounds differently, and from
the same recipe would train another model: base accuracy 45.3% instead of 52.5% on 512 held-out
prompts).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.config import ModelConfig
from tailrace.model.rope import apply_rope


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalize in fp32, cast back to the input dtype, then scale by the weight.
    `scale_fp32` (OLMo2's): scale in fp32, then cast. `offset` (Gemma's 1): scale by offset + the weight,
    in fp32 (Gemma stores its norm weights as w - 1)."""

    def __init__(self, dim: int, eps: float, scale_fp32: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.scale_fp32, self.offset = eps, scale_fp32 or offset != 0.0, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.offset:
            return (n * (self.offset + self.weight.float())).to(x.dtype)
        return (self.weight * n).to(x.dtype) if self.scale_fp32 else self.weight * n.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: bool = True, window: int | None = None):
        """`rope`: whether q and k are rotated (SmolLM3 leaves some layers without: `cfg.rope_at`); `window`:
        the positions each token attends to, its own included (`cfg.window_at`; None: all before it)."""
        super().__init__()
        self.rope, self.window, self.softcap = rope, window, cfg.attn_logit_softcapping  # (Gemma 2's cap)
        self.scale = cfg.score_scale  # Granite's, Gemma's; None: 1/sqrt(head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm, self.qk_norm_wide = cfg.qk_norm, cfg.qk_norm_wide
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's q and k RMS-normalized over head_dim before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=cfg.norm_offset)
        elif cfg.qk_norm_wide:  # OLMo2, OLMoE: q and k RMS-normalized over all their heads at once
            fp32 = cfg.post_norms  # OLMo2's scale in fp32; OLMoE's as Llama's RMSNorm
            self.q_norm = RMSNorm(self.num_heads * self.head_dim, cfg.rms_norm_eps, scale_fp32=fp32)
            self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, cfg.rms_norm_eps, scale_fp32=fp32)

    def forward(self, h: torch.Tensor, step: CausalStep) -> torch.Tensor:
        B, T, _ = h.shape
        q, k = self.q_proj(h), self.k_proj(h)
        if self.qk_norm_wide:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
        o = step.attend(q, k, v, self.scale, self.window, self.softcap)  # (B, T, H, D), possibly strided
        return self.o_proj(o.reshape(B, T, -1))


EAGER_MAX_T = 192  # the longest sequence attended eagerly (see the module docstring)
_eager_on = True  # False inside sdpa_only()
_EAGER_DTYPES = (torch.bfloat16, torch.float16)
_masks: dict[tuple, torch.Tensor] = {}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU matmuls run in: autocast's under autocast (RoPE's fp32 tables make q and k fp32)."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else dtype


def attends_eagerly(T: int, dtype: torch.dtype, device: torch.device) -> bool:
    return _eager_on and device.type == "cpu" and T <= EAGER_MAX_T and _compute_dtype(dtype) in _EAGER_DTYPES


@contextlib.contextmanager
def sdpa_only() -> Iterator[None]:
    """Every sequence attends through SDPA inside the block (see the module docstring)."""
    global _eager_on
    was, _eager_on = _eager_on, False
    try:
        yield
    finally:
        _eager_on = was


def causal_mask(T: int, dtype: torch.dtype, device: torch.device, window: int | None = None) -> torch.Tensor:
    """(T, T): 0 where query i sees key j (j <= i, and i - j < `window` where given), -inf elsewhere; in
    torch.bool (SDPA's attn_mask), True where it sees and False elsewhere. Cached per shape."""
    seen = _window_mask(T, T, 0, window, device)
    if dtype == torch.bool:
        return seen
    key = (T, dtype, device, window)
    m = _masks.get(key)
    if m is None:
        m = _masks[key] = torch.zeros(T, T, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    return m


def eager_attention(
    q, k, v, scale: float | None = None, window: int | None = None, softcap: float | None = None
):
    """q (B, T, H, D), k and v (B, T, KV, D) -> (B, T, H, D), causal (within the last `window` positions
    where given), grouped as `repeat_kv`; scores scaled by `scale` (None: 1/sqrt(D)), then capped by
    softcap tanh(s / softcap) where given (Gemma 2's, before the mask)."""
    B, T, H, D = q.shape
    KV = k.shape[2]
    qg = q.permute(0, 2, 1, 3).unflatten(1, (KV, H // KV))  # (B, KV, G, T, D): head h = kv * G + g
    kt, vt = k.permute(0, 2, 3, 1).unsqueeze(2), v.permute(0, 2, 1, 3).unsqueeze(2)  # (B, KV, 1, D|T, T|D)
    low = _compute_dtype(q.dtype)
    with torch.autocast("cpu", enabled=False):
        s = torch.matmul(qg.float(), kt.float()) * (D**-0.5 if scale is None else scale)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s + causal_mask(T, torch.float32, q.device, window)
    o = torch.matmul(torch.softmax(s, dim=-1).to(low), vt)  # (B, KV, G, T, D)
    return o.flatten(1, 2).transpose(1, 2)


WINDOW_CHUNKS = 2  # past this many windows a sequence attends window by window (`windowed_attention`)


def windowed_attention(q, k, v, scale: float | None, window: int):
    """Causal attention within the last `window` positions, one window of queries at a time, each SDPA
    call over the keys those queries can reach (at most 2 window - 1): q (B, T, H, D), k and v
    (B, T, KV, D) -> (B, T, H, D). A whole-sequence SDPA under a window mask computes every score and
    masks it; this computes about T x 2 window of them."""
    T, outs = q.shape[1], []
    for s in range(0, T, window):
        e, k0 = min(T, s + window), max(0, s - window + 1)
        o = F.scaled_dot_product_attention(
            q[:, s:e].transpose(1, 2),
            k[:, k0:e].transpose(1, 2),
            v[:, k0:e].transpose(1, 2),
            attn_mask=_window_mask(e - s, e - k0, s - k0, window, q.device),
            enable_gqa=True,
            scale=scale,
        )
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


def _window_mask(n: int, m: int, offset: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(n, m) bool: query i (at offset + i among the m keys) sees key j when j <= offset + i and, with a
    `window`, offset + i - j < window; cached per shape."""
    key = ("seen", n, m, offset, window, device)
    mask = _masks.get(key)
    if mask is None:
        i, j = torch.arange(n, device=device)[:, None] + offset, torch.arange(m, device=device)[None, :]
        mask = j <= i
        if window is not None:
            mask &= j > i - window
        _masks[key] = mask
    return mask


class CausalStep:
    """Each sequence attends causally to itself."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # (B or 1, T, 1, D)

    def attend(self, q, k, v, scale=None, window: int | None = None, softcap: float | None = None):
        """`scale`: the scores' (None: 1/sqrt(D); Granite's attention_multiplier, Gemma's); `window`: each
        query attends to its last this many positions, its own included (None: to all before it);
        `softcap`: Gemma 2's cap on the scores, which SDPA cannot apply (they attend eagerly, at any length)."""
        T = q.shape[1]
        if softcap is not None or attends_eagerly(T, q.dtype, q.device):
            return eager_attention(q, k, v, scale, None if window is None or window >= T else window, softcap)
        if window is not None and T > WINDOW_CHUNKS * window:
            return windowed_attention(q, k, v, scale, window)
        windowed = window is not None and window < T
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=causal_mask(T, torch.bool, q.device, window) if windowed else None,
            is_causal=not windowed,
            enable_gqa=True,
            scale=scale,
        )
        return o.transpose(1, 2)
