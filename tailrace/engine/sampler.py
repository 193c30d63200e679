"""Batched, seeded, batch-invariant sampling: logits (B, V) -> token ids and their logprobs.

Every row samples by the Gumbel-max trick: argmax(z + g) with g ~ Gumbel(0, 1) i.i.d. per vocab entry
is an exact draw from softmax(z). The noise g is a pure function of (request key, token index, vocab
id) -- a counter-based hash evaluated with integer tensor ops -- so a request draws the same noise
whatever else is in the batch, whichever row it sits in, and whether it was resumed after an abort.
No torch.Generator and no per-row Python.

What a row's logprob means (the distribution it was sampled from):
  * temperature > 0: log_softmax of logits / temperature after the top-k / top-p filter (filtered
    tokens removed, the rest renormalized);
  * temperature 0 (greedy): argmax of the raw logits, and the logprob under the *untempered,
    unfiltered* softmax of the logits (a greedy choice has no sampling distribution of its own).
Top-k is applied before top-p (as Hugging Face orders its warpers); tokens tied with the cut-off
value are kept. Stop tokens are masked out while a row has fewer than its min_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF
# Multipliers of a xorshift-multiply finalizer. Both are odd and < 2**31, so products of 32-bit values
# stay below 2**63 and int64 tensor arithmetic never overflows (no reliance on wrap-around).
_C1, _C2 = 0x21F0AAAD, 0x735A2D97
_IDX_STEP, _VOCAB_SALT = 0x2545F491, 0x6A09E667


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of int64 tensors holding values in [0, 2**32); returns a new tensor."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    x ^= x >> 15
    return x


def _mix32_int(x: int) -> int:
    """`mix32` on one Python int."""
    x ^= x >> 16
    x = (x * _C1) & M32
    x ^= x >> 15
    x = (x * _C2) & M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """A request seed of any size -> the 32-bit key its noise is hashed from (host side, once)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return _mix32_int(_mix32_int((s >> 32) ^ 0x9E3779B9) ^ (s & M32))


def vocab_salt(vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(V,) int64: a distinct 32-bit salt per vocab id, mixed into each row's hash."""
    return mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _VOCAB_SALT)


def gumbel_noise(key: torch.Tensor, index: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (B, V) float32 for rows with 32-bit `key` (B,) at token `index` (B,).

    u = hash(key, index, vocab id) read as a uniform in (0, 1), g = -log(-log(u)). The three parts enter
    one finalizer as key + index * odd + salt[vocab] (mod 2**32). u = (23 bits + 0.5) / 2**23 is exact in
    float32 and strictly inside (0, 1), so g is finite: in [-2.81, 16.64]. (With 24 bits the top value's
    u rounds to 1.0 and its g is +inf: that vocab entry wins whatever the logits, in V / 2**24 of all
    draws, 0.3% of the tokens of a 49k vocabulary.)"""
    row = key + index * _IDX_STEP  # (B,)
    return gumbel_of_bits(mix32((row[:, None] + salt[None, :]) & M32))


def gumbel_of_bits(hashed: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise float32 from 32-bit hash values (int64 tensor in [0, 2**32)): their top 23
    bits as u = (bits + 0.5) / 2**23, then -log(-log(u))."""
    u = ((hashed >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return u.log_().neg_().log_().neg_()


@dataclass
class SampleFlags:
    """Host-side facts about the rows being sampled, so unused features cost nothing."""

    any_sampled: bool = True  # some row has temperature > 0
    any_greedy: bool = True  # some row has temperature 0
    any_tempered: bool = True  # some row has a temperature other than 0 and 1
    any_filter: bool = False  # some row has top-k or top-p on
    any_min_new: bool = False  # some row may still be below min_new_tokens and has stop ids
    any_plain: bool = True  # some row has neither a filter nor min_new_tokens with stop ids


def sample(
    logits: torch.Tensor,
    *,
    inv_temp: torch.Tensor,
    noise_scale: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    key: torch.Tensor,
    index: torch.Tensor,
    salt: torch.Tensor,
    stop_mask: torch.Tensor | None = None,
    min_new: torch.Tensor | None = None,
    flags: SampleFlags = SampleFlags(),
    kernel=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens (B,) int64, logprobs (B,) float32).

    logits (B, V) any float dtype; inv_temp (B,) float32 (1/temperature, 1 for greedy rows);
    noise_scale (B,) float32 (1 sampled, 0 greedy); top_k (B,) int64 (V = off); top_p (B,) float32
    (> 1 = off); key/index (B,) int64; stop_mask (B, V) bool and min_new (B,) int64: stop tokens are
    banned while index < min_new. Greedy rows must have top_k = V and top_p > 1.

    `kernel` (the engine's CPU kernels, `ckernel.Kernels`): the noise comes from it, and the whole
    draw of every row without a filter or a ban (min_new > 0) does (one call instead of ~25 small ops);
    the tokens are the same either way, as both add the same noise to the same tempered logits, and a
    row's logprob then depends on its own parameters only, never on which rows share its batch."""
    banning = flags.any_min_new and stop_mask is not None
    plain = None
    if kernel is not None and (flags.any_plain or not (flags.any_filter or banning)):
        lg = logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()
        plain = kernel.sample(lg.contiguous(), inv_temp, noise_scale, key, index, salt)  # bf16 read as is
        if not flags.any_filter and not banning:
            return plain
    z = logits.float()
    if banning:
        ban = stop_mask & (index < min_new)[:, None]
        z = z.masked_fill(ban, float("-inf"))
    if flags.any_tempered:
        z = z * inv_temp[:, None]
    if flags.any_filter:
        z = _filter_top_k_top_p(z, top_k, top_p)
    logp = torch.log_softmax(z, dim=-1)
    if flags.any_sampled:
        noise = gumbel_noise(key, index, salt) if kernel is None else kernel.gumbel(key, index, salt)
        if flags.any_greedy:
            noise.mul_(noise_scale[:, None])
        tokens = (z + noise).argmax(dim=-1)  # = argmax of logp + noise: they differ by a per-row constant
    else:
        tokens = z.argmax(dim=-1)
    lp = logp.gather(1, tokens[:, None]).squeeze(1)
    if plain is None:
        return tokens, lp
    special = (top_k < logits.shape[1]) | (top_p <= 1.0)
    if banning:
        special |= min_new > 0
    return torch.where(special, tokens, plain[0]), torch.where(special, lp, plain[1])


def _filter_top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the top_k largest entries, then the smallest prefix (by value) whose
    renormalized mass reaches top_p; everything else becomes -inf. Done as one cut-off value per row."""
    V = z.shape[-1]
    sorted_z, _ = z.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(V, device=z.device)
    keep_k = ranks[None, :] < top_k[:, None]
    probs = torch.softmax(sorted_z.masked_fill(~keep_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = keep_k & (mass_before < top_p[:, None])  # the first entry is always kept
    n_keep = keep.sum(dim=-1).clamp_(min=1)  # (B,)
    cutoff = sorted_z.gather(1, (n_keep - 1)[:, None])  # (B, 1)
    return z.masked_fill(z < cutoff, float("-inf"))
