"""The sampler alone: exact distributions, filters, greedy, min_new_tokens, seeded batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tailrace.engine import ckernel
from tailrace.engine.rows import TOP_P_OFF
from tailrace.engine.sampler import SampleFlags, gumbel_noise, sample, seed_key, vocab_salt

ALL_ON = SampleFlags(any_sampled=True, any_filter=True, any_min_new=True)


def _args(B, V, *, temperature=1.0, top_k=0, top_p=1.0, keys=None, index=None, stop=(), min_new=0):
    greedy = temperature == 0
    return dict(
        inv_temp=torch.full((B,), 1.0 if greedy else 1.0 / temperature),
        noise_scale=torch.full((B,), 0.0 if greedy else 1.0),
        top_k=torch.full((B,), V if greedy or not top_k else top_k, dtype=torch.int64),
        top_p=torch.full((B,), TOP_P_OFF if greedy or top_p >= 1 else top_p),
        key=torch.full((B,), seed_key(1), dtype=torch.int64) if keys is None else keys,
        index=torch.arange(B, dtype=torch.int64) if index is None else index,
        salt=vocab_salt(V),
        stop_mask=torch.zeros(B, V, dtype=torch.bool).index_fill_(
            1, torch.tensor(stop, dtype=torch.int64), True
        )
        if stop
        else torch.zeros(B, V, dtype=torch.bool),
        min_new=torch.full((B,), min_new, dtype=torch.int64),
    )


def _target(z: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Reference: temperature, then top-k, then the smallest top-p nucleus, renormalized (float64)."""
    zt = [x / temperature for x in z]
    order = sorted(range(len(z)), key=lambda i: -zt[i])[: top_k or len(z)]
    m = max(zt[i] for i in order)
    w = {i: math.exp(zt[i] - m) for i in order}
    tot = sum(w.values())
    keep, mass = [], 0.0
    for i in order:
        keep.append(i)
        mass += w[i] / tot
        if mass >= top_p:
            break
    tot = sum(w[i] for i in keep)
    return {i: w[i] / tot for i in keep}


def _chi2_critical(df: int, z: float = 4.753) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 4.753 is the normal 1 - 1e-6 quantile."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_frequencies_match_target_distribution():
    """Chi-square goodness of fit of 40,000 draws per case against the filtered, renormalized target.

    Each case fails by chance with probability about 1e-6 (critical value at the 1 - 1e-6 quantile,
    Wilson-Hilferty approximation); the four cases together below 1e-5."""
    z = [2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4]
    N, V = 40_000, len(z)
    logits = torch.tensor(z).expand(N, V)
    keys = torch.tensor([seed_key(s) for s in range(N // 100)], dtype=torch.int64).repeat_interleave(100)
    index = torch.arange(N, dtype=torch.int64) % 100
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.6)):
        tokens, lps = sample(
            logits,
            flags=ALL_ON,
            **_args(N, V, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys, index=index),
        )
        target = _target(z, temperature, top_k, top_p)
        counts = torch.bincount(tokens, minlength=V).tolist()
        assert all(counts[i] == 0 for i in range(V) if i not in target), "sampled a filtered token"
        chi2 = sum((counts[i] - N * p) ** 2 / (N * p) for i, p in target.items())
        assert chi2 < _chi2_critical(len(target) - 1), (temperature, top_k, top_p, counts, chi2)
        # the reported logprob is the log of the target probability of the sampled token
        ref = torch.tensor([math.log(target[t]) for t in tokens[:200].tolist()])
        assert torch.allclose(lps[:200], ref.float(), atol=1e-5)


def test_noise_is_finite_for_every_hash_value():
    """Every 23-bit value maps strictly inside (0, 1): the top one used to round to u = 1 (24 bits), a
    +inf noise that made its vocab entry win whatever the logits (0.3% of draws at V = 49152)."""
    from tailrace.engine.sampler import gumbel_of_bits

    hashed = (torch.arange(1 << 23, dtype=torch.int64) << 9) | 0x1FF  # every bit pattern the noise reads
    g = gumbel_of_bits(hashed)
    assert torch.isfinite(g).all()
    assert -2.82 < float(g.min()) and float(g.max()) < 16.65
    assert float(gumbel_of_bits(torch.tensor([0xFFFFFFFF]))) == float(g.max())


def test_uniforms_are_uniform():
    """The hashed uniforms behind the noise: 64 equal bins of 256,000 values; chi-square fails by
    chance with probability about 1e-6."""
    keys = torch.tensor([seed_key(s) for s in range(2000)], dtype=torch.int64)
    g = gumbel_noise(keys, torch.arange(2000, dtype=torch.int64) % 7, vocab_salt(128))
    u = torch.exp(-torch.exp(-g.double())).flatten()  # Gumbel CDF maps back to the uniform
    counts = torch.histc(u, bins=64, min=0, max=1)
    e = u.numel() / 64
    assert float(((counts - e) ** 2 / e).sum()) < _chi2_critical(63)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    B=st.integers(1, 6),
    V=st.integers(2, 24),
    top_k=st.integers(0, 24),
    top_p=st.floats(0.05, 1.0),
    temperature=st.floats(0.2, 2.0),
)
def test_samples_lie_in_allowed_set(seed, B, V, top_k, top_p, temperature):
    g = torch.Generator().manual_seed(seed % 2**31)
    logits = torch.randn(B, V, generator=g, dtype=torch.float64).float() * 3
    a = _args(
        B,
        V,
        temperature=temperature,
        top_k=min(top_k, V),
        top_p=top_p,
        keys=torch.randint(0, 2**32, (B,), generator=g),
        index=torch.randint(0, 1000, (B,), generator=g),
    )
    for row in logits.tolist():  # skip nuclei whose edge is within float32 rounding of top_p
        zt = sorted((x / temperature for x in row), reverse=True)[: min(top_k, V) or V]
        w = [math.exp(x - zt[0]) for x in zt]
        cum = [sum(w[: i + 1]) / sum(w) for i in range(len(w))]
        assume(all(abs(c - top_p) > 1e-4 for c in cum))
    tokens, lps = sample(logits, flags=ALL_ON, **a)
    for row, t, lp in zip(logits.tolist(), tokens.tolist(), lps.tolist()):
        target = _target(row, temperature, min(top_k, V), top_p)
        assert t in target
        assert abs(lp - math.log(target[t])) < 1e-4


def test_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(logits, flags=ALL_ON, **_args(5, 30, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(lps, torch.log_softmax(logits, -1).max(-1).values)
    # the flags that skip unused work give the same answer
    t2, l2 = sample(logits, flags=SampleFlags(any_sampled=False), **_args(5, 30, temperature=0.0))
    assert t2.tolist() == tokens.tolist() and torch.equal(l2, lps)


def test_min_new_tokens_bans_stop_tokens_only_before_the_threshold():
    V = 10
    logits = torch.zeros(4, V)
    logits[:, 3] = 50.0  # the stop token dominates
    index = torch.tensor([0, 2, 3, 7])
    tokens, lps = sample(
        logits, flags=ALL_ON, **_args(4, V, temperature=0.0, stop=(3,), min_new=3, index=index)
    )
    assert [t != 3 for t in tokens.tolist()] == [True, True, False, False]
    assert torch.isfinite(lps).all()


def test_noise_depends_only_on_key_index_and_vocab():
    """Batch invariance at the source: a row's noise is the same in any batch, at any row."""
    salt = vocab_salt(50)
    keys = torch.tensor([seed_key(s) for s in (3, 4, 5)], dtype=torch.int64)
    idx = torch.tensor([0, 9, 4])
    full = gumbel_noise(keys, idx, salt)
    for i in range(3):
        assert torch.equal(gumbel_noise(keys[i : i + 1], idx[i : i + 1], salt)[0], full[i])
    assert not torch.equal(gumbel_noise(keys[:1], idx[:1] + 1, salt), full[:1])
    assert seed_key(7) == seed_key(7 + 2**64) and seed_key(7) != seed_key(8)


def test_with_the_kernel_a_row_samples_alike_whatever_shares_its_batch():
    """Rows without filters or bans go through the kernel's draw even in a batch where other rows need
    torch ops (top-k, stop bans): token and logprob bit-identical to the same row sampled alone."""
    kernel = ckernel.load()
    if kernel is None:
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")
    B, V = 6, 50
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(3))
    mixed = _args(B, V)
    mixed["top_k"][1] = 5  # a filtered row
    mixed["top_p"][2] = 0.8  # another
    mixed["stop_mask"][3, 7] = True  # a row banning a stop token
    mixed["min_new"][3] = 99
    flags = SampleFlags(
        any_sampled=True, any_greedy=False, any_tempered=False, any_filter=True, any_min_new=True
    )
    tok, lp = sample(logits, flags=flags, kernel=kernel, **mixed)
    for b in (0, 4, 5):
        alone = {k: v[b : b + 1] if k != "salt" else v for k, v in _args(B, V).items()}
        t1, l1 = sample(logits[b : b + 1], flags=SampleFlags(any_greedy=False), kernel=kernel, **alone)
        assert tok[b] == t1[0] and lp[b] == l1[0]
    # the special rows: what the torch ops alone give them
    t2, l2 = sample(logits, flags=flags, kernel=None, **mixed)
    assert torch.equal(tok, t2)
    assert torch.allclose(lp, l2, atol=1e-5)
