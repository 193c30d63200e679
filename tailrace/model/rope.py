"""Rotary position embeddings, numerically as transformers 5.19 (`modeling_rope_utils.py`, Llama's
`rotate_half`): inverse frequencies per rope type, and a cos/sin table indexed by absolute position.

The table holds `cat(freqs, freqs).cos() * attention_scaling` computed in fp32 for positions
0..len-1, so looking a position up gives the same numbers HF computes on the fly. `sin` is stored with
its first half negated so that `rotate_half(x) * sin == cat(x2, x1) * sin_signed` (negation is exact).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.config import ModelConfig

_MIN_LEN = 256


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim/2,) fp32, always on CPU, attention_scaling applied to cos/sin)."""
    base, dim, rs = cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling or {}
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    pos_freqs = base**exps  # each pair's wavelength / 2 pi
    inv_freq = 1.0 / pos_freqs
    kind = cfg.rope_type
    if kind in ("default", "dynamic"):
        # dynamic NTK equals default up to max_position_embeddings; beyond it is rejected (rope_limit).
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rs), 1.0
    if kind == "yarn":
        return _yarn(cfg, rs, pos_freqs)
    if kind == "longrope":
        return _longrope(cfg, rs, pos_freqs)
    raise ValueError(f"rope_type={kind!r} is not supported")


def rope_limit(cfg: ModelConfig) -> tuple[int, str] | None:
    """(the position count a sequence must stay within, why), or None: unbounded. The lengths the config
    holds sequences to (`ModelConfig.held_to`: a sliding window, LongRoPE's short range), and dynamic
    NTK's range: its frequencies change with the sequence length past max_position_embeddings, which a
    position-indexed table and a KV cache cannot express, so it is supported only inside it."""
    limits = [(limit, f"the model's {what}: {why} (unsupported)") for limit, what, why in cfg.held_to()]
    if cfg.rope_type == "dynamic":
        limits.append((cfg.max_position_embeddings, f"max_position_embeddings={cfg.max_position_embeddings}, "
                       "where 'dynamic' RoPE changes with the sequence length (unsupported)"))  # fmt: skip
    return min(limits, default=None)


def rope_table(inv_freq: torch.Tensor, scale: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_signed: (length, rotary_dim) fp32."""
    pos = torch.arange(length, dtype=torch.int64, device=inv_freq.device).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]  # (L, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = sin.shape[-1] // 2
    sin[:, :half].neg_()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos, sin_signed broadcastable, e.g. (B, T, 1, R). Equals HF's
    `x * cos + rotate_half(x) * sin` over the first R dims (all of them but for a partial rotary), the
    rest as they are."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :R], cos, sin_signed), x[..., R:]), dim=-1)
    half = R // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin_signed


class Rotary(nn.Module):
    """The cos/sin table as non-persistent buffers (they follow `.to(device, dtype)`, as HF casts cos/sin
    to the activations' dtype, and stay out of state_dicts). Grown on demand in powers of two."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.limit, self.why = rope_limit(cfg) or (None, "")
        # Explicitly on the CPU, so that building under torch.device("meta") still yields real tables.
        self.inv_freq, self.scale = inv_freq_and_scale(cfg)
        cos, sin = rope_table(self.inv_freq, self.scale, self._length(min(cfg.context_limit, _MIN_LEN)))
        self.register_buffer("cos", cos, persistent=False)  # (L, R): R = rotary_dim
        self.register_buffer("sin", sin, persistent=False)  # (L, R), first half negated

    def prefix(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..T-1: (1, T, 1, R) views."""
        self.ensure(T)
        return self.cos[None, :T, None], self.sin[None, :T, None]

    def lookup(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions` (B, T) (all < end): (B, T, 1, R)."""
        self.ensure(end)
        return F.embedding(positions, self.cos)[:, :, None], F.embedding(positions, self.sin)[:, :, None]

    def ensure(self, end: int) -> None:
        if end > self.cos.shape[0]:
            with torch.inference_mode(False), torch.no_grad():  # normal tensors, usable in any mode
                cos, sin = rope_table(self.inv_freq.to(self.cos.device), self.scale, self._length(end))
                self.cos, self.sin = cos.to(self.cos.dtype), sin.to(self.sin.dtype)

    def _length(self, end: int) -> int:
        if self.limit is not None and end > self.limit:
            raise ValueError(f"position {end - 1} is beyond {self.why}; shorten the sequence")
        n = _MIN_LEN
        while n < end:
            n *= 2
        return n if self.limit is None else min(n, self.limit)


def _llama3(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, rs: dict, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    base, dim = cfg.rope_theta, cfg.rotary_dim
    factor = rs["factor"]
    orig = rs["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope(cfg: ModelConfig, rs: dict, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """LongRoPE within original_max_position_embeddings (`rope_limit`): the short factors divide each
    frequency; cos and sin are scaled by sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings /
    original (or the given factor), unless `attention_factor` is given."""
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or cfg.max_position_embeddings / orig
    scale = rs.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    short = torch.tensor(rs["short_factor"], dtype=torch.float32, device="cpu")
    return 1.0 / (short * pos_freqs), scale
