"""The C decode-attention kernels against softmax attention written out in torch, reading a paged cache
whose blocks lie at random places in the pool (blocks no row owns hold NaN: never read)."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import ckernel

KERNEL = ckernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"C kernel unavailable: {ckernel.unavailable()}")


def table_for(rows: int, L: int, bs: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """A block table (rows, ceil(L / bs)) int32 of distinct random blocks, and the pool's size (3 spare)."""
    W = -(-L // bs)
    n = rows * W + 3
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: rows * W]
    return perm.view(rows, W).to(torch.int32), n


def page(x: torch.Tensor, table: torch.Tensor, nblocks: int, bs: int) -> torch.Tensor:
    """x (rows, Hkv, L, D) laid out in a pool (nblocks, Hkv, bs, D) by `table`; unowned blocks NaN."""
    rows, Hkv, L, D = x.shape
    W = table.shape[1]
    pool = torch.full((nblocks, Hkv, bs, D), float("nan"), dtype=x.dtype)
    padded = torch.cat([x, x.new_zeros(rows, Hkv, W * bs - L, D)], dim=2)
    pool[table.long()] = padded.view(rows, Hkv, W, bs, D).transpose(1, 2)
    return pool


def unpage(pool: torch.Tensor, table: torch.Tensor, L: int) -> torch.Tensor:
    """`page`'s inverse: (rows, Hkv, L, D)."""
    rows, W = table.shape
    _, Hkv, bs, D = pool.shape
    return pool[table.long()].transpose(1, 2).reshape(rows, Hkv, W * bs, D)[:, :, :L]


def reference(q, k, v, pos, row0, scale):
    """q (B, Hkv, G, D); row b attends to k/v[row0 + b, h, :pos[b] + 1], in float64."""
    B, Hkv, G, D = q.shape
    out = torch.empty(B, Hkv, G, D, dtype=torch.float64)
    for b in range(B):
        n = int(pos[b]) + 1
        kk, vv = k[row0 + b, :, :n].double(), v[row0 + b, :, :n].double()  # (Hkv, n, D)
        p = torch.softmax(q[b].double() @ kk.transpose(1, 2) * scale, dim=-1)  # (Hkv, G, n)
        out[b] = p @ vv
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 32, 64, 128, 40])  # compiled-in sizes and the generic path
@pytest.mark.parametrize("G", [1, 3, 4, 7])  # the query heads of a kv head go in groups of up to 3
@pytest.mark.parametrize("bs", [16, 5])  # whole 8-position groups per block, and blocks that split them
def test_kernel_matches_softmax_attention(dtype, D, G, bs):
    g = torch.Generator().manual_seed(D * 10 + G)
    rows, Hkv, L, B, row0 = 7, 2, 50, 5, 2
    k = (torch.randn(rows, Hkv, L, D, generator=g) * 2).to(dtype)
    v = torch.randn(rows, Hkv, L, D, generator=g).to(dtype)
    q = torch.randn(B, Hkv, G, D, generator=g)
    pos = torch.tensor([0, 49, 13, 1, 30])  # a first token (attends to itself only) and a full row
    table, n = table_for(rows, L, bs)
    got = KERNEL.run(q, page(k, table, n, bs), page(v, table, n, bs), table, pos, row0, D**-0.5)
    want = reference(q, k.float(), v.float(), pos, row0, D**-0.5)
    assert (got.double() - want).abs().max() < 2e-6


@needs_kernel
def test_kernel_results_do_not_depend_on_the_block_size():
    """Positions are visited in order whatever the blocks (with blocks of whole 8-position groups, the
    same groups): a paged read gives the bits of an unpaged one (one block per row)."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 64, 64, generator=g), torch.randn(3, 2, 64, 64, generator=g)
    q, pos = torch.randn(3, 2, 3, 64, generator=g), torch.tensor([63, 20, 37])
    outs = []
    for bs in (64, 16, 8):
        table, n = table_for(3, 64, bs, seed=bs)
        outs.append(KERNEL.run(q, page(k, table, n, bs), page(v, table, n, bs), table, pos, 0, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_results_do_not_depend_on_how_query_heads_are_grouped(dtype):
    """The G heads of a kv head are computed in groups (3 + 3 + 1 for G = 7): each head's output is the
    bits of attending with that head alone (G = 1)."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 2, 40, 64, generator=g).to(dtype)
    v = torch.randn(3, 2, 40, 64, generator=g).to(dtype)
    q, pos = torch.randn(3, 2, 7, 64, generator=g), torch.tensor([39, 8, 21])
    table, n = table_for(3, 40, 16)
    kp, vp = page(k, table, n, 16), page(v, table, n, 16)
    whole = KERNEL.run(q, kp, vp, table, pos, 0, 0.125)
    for h in range(7):
        alone = KERNEL.run(q[:, :, h : h + 1].contiguous(), kp, vp, table, pos, 0, 0.125)
        assert torch.equal(whole[:, :, h : h + 1], alone)


@needs_kernel
def test_kernel_ignores_cache_beyond_each_rows_length():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 20, 32, generator=g), torch.randn(2, 1, 20, 32, generator=g)
    q, pos = torch.randn(2, 1, 2, 32, generator=g), torch.tensor([4, 11])
    table, n, bs = *table_for(2, 20, 4), 4
    a = KERNEL.run(q, page(k, table, n, bs), page(v, table, n, bs), table, pos, 0, 0.2)
    k[0, :, 5:], v[1, :, 12:] = float("nan"), 1e30  # garbage past each row's last position
    assert torch.equal(KERNEL.run(q, page(k, table, n, bs), page(v, table, n, bs), table, pos, 0, 0.2), a)


@needs_kernel
def test_kernel_rejects_positions_rows_and_blocks_outside_the_cache_and_bad_operands():
    table, n = table_for(2, 8, 4)
    k = v = torch.zeros(n, 1, 4, 16)
    q = torch.zeros(2, 1, 1, 16)
    for bad in (8, -1, 10**15):
        with pytest.raises(ValueError, match="position outside the block table"):
            KERNEL.run(q, k, v, table, torch.tensor([3, bad]), 0, 1.0)
    with pytest.raises(ValueError, match="row outside the block table"):
        KERNEL.run(q, k, v, table, torch.tensor([3, 4]), 1, 1.0)  # rows 1..3 of a 2-row table
    bad_table = table.clone()
    bad_table[1, 1] = n
    with pytest.raises(ValueError, match="block outside the cache"):
        KERNEL.run(q, k, v, bad_table, torch.tensor([3, 4]), 0, 1.0)
    with pytest.raises(ValueError, match="bad operands"):
        KERNEL.run(q.to(torch.bfloat16), k, v, table, torch.tensor([3, 4]), 0, 1.0)
    with pytest.raises(ValueError, match="bad operands"):
        KERNEL.run(q, k, v, table.long(), torch.tensor([3, 4]), 0, 1.0)


def layer_reference(qkv, cos_sin, k, v, row, pos, G, scale):
    """RoPE (the model's apply_rope), cache writes and attention written out in torch, token by token
    in order (a prefill piece's tokens see those before them); returns o (float64), k, v."""
    from tailrace.model.rope import apply_rope

    M = qkv.shape[0]
    rows, Hkv, L, D = k.shape
    H = Hkv * G
    x = qkv.view(M, H + 2 * Hkv, D)
    cs = cos_sin[pos]  # (M, 2, D)
    qk = apply_rope(x[:, None, : H + Hkv], cs[:, None, 0:1], cs[:, None, 1:2])[:, 0]  # in qkv's dtype
    k, v = k.clone(), v.clone()
    o = torch.empty(M, H * D, dtype=torch.float64)
    for t in range(M):
        r, p = int(row[t]), int(pos[t])
        k[r, :, p], v[r, :, p] = qk[t, H:], x[t, H + Hkv :]
        q = qk[t : t + 1, :H].float().reshape(1, Hkv, G, D)
        o[t] = reference(q, k[r : r + 1].float(), v[r : r + 1].float(), pos[t : t + 1], 0, scale).reshape(-1)
    return o, k, v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,G,bs", [(32, 2, 16), (16, 1, 3), (40, 3, 8), (64, 4, 16)])
@pytest.mark.parametrize("qk_norm", [False, "qwen3", "gemma3"])
def test_fused_layer_matches_rope_cache_write_and_attention(dtype, D, G, bs, qk_norm):
    """qk_norm: Qwen3's q/k norms in the call (weights in the layer's dtype), or Gemma 3's (fp32 weights,
    1 + w, scaled in fp32 then rounded), against the torch backend's `norm_qk` before RoPE."""
    from tailrace.engine.backends.weights import norm_qk
    from tailrace.model.rope import rope_table

    g = torch.Generator().manual_seed(D + G)
    rows, Hkv, L = 6, 2, 40
    k = torch.randn(rows, Hkv, L, D, generator=g).to(dtype)
    v = torch.randn(rows, Hkv, L, D, generator=g).to(dtype)
    # four decode rows (a first token, a full row), then a prefill piece of 5 tokens in row 0 at 3..7
    row = torch.tensor([1, 2, 3, 4, 0, 0, 0, 0, 0])
    pos = torch.tensor([0, 39, 17, 5, 3, 4, 5, 6, 7])
    qkv = torch.randn(len(row), (G + 2) * Hkv * D, generator=g).to(dtype)
    cos, sin = rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 1.0, 48)  # >= W bs
    cos_sin = torch.stack((cos, sin), dim=1).to(dtype)
    norms, eps = 1 + 0.3 * torch.randn((G + 1) * Hkv, D, generator=g), 1e-6
    norms = norms if qk_norm == "gemma3" else norms.to(dtype)
    normed = norm_qk(qkv.clone(), norms, D, eps) if qk_norm else qkv
    want_o, want_k, want_v = layer_reference(normed, cos_sin, k, v, row, pos, G, D**-0.5)
    table, n = table_for(rows, L, bs)
    pk, pv = page(k, table, n, bs), page(v, table, n, bs)
    got = KERNEL.layer(qkv, cos_sin, pk, pv, table, row, pos, G, D**-0.5, norms if qk_norm else None, eps)
    k, v = unpage(pk, table, L), unpage(pv, table, L)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(k, want_k, atol=1e-6) and torch.equal(v, want_v)
        assert (got.double() - want_o).abs().max() < 2e-6
    else:  # here RoPE is computed in fp32 and rounded once (torch's bf16 ops round each product)
        _, exact_k, _ = layer_reference(
            normed.float(), cos_sin.float(), k.float(), v.float(), row, pos, G, 1.0
        )
        rounded = exact_k.to(dtype).float()
        assert ((k.float() - rounded).abs() <= rounded.abs() * 2**-8).all()  # within one bf16 step
        assert torch.equal(v, want_v)
        assert (got.double() - want_o).abs().max() < 0.05


@needs_kernel
def test_fused_layer_rejects_a_bad_position_row_or_block_before_writing_anything():
    table, n = table_for(2, 8, 4)
    k, v = torch.zeros(n, 1, 4, 16), torch.zeros(n, 1, 4, 16)
    qkv, cos_sin = torch.ones(2, 3 * 16), torch.ones(8, 2, 16)
    with pytest.raises(ValueError, match="position outside the block table"):
        KERNEL.layer(qkv, cos_sin, k, v, table, torch.tensor([0, 1]), torch.tensor([3, 8]), 1, 1.0)
    with pytest.raises(ValueError, match="row outside the block table"):
        KERNEL.layer(qkv, cos_sin, k, v, table, torch.tensor([0, 2]), torch.tensor([3, 4]), 1, 1.0)
    bad_table = table.clone()
    bad_table[1, 0] = -1
    with pytest.raises(ValueError, match="block outside the cache"):
        KERNEL.layer(qkv, cos_sin, k, v, bad_table, torch.tensor([0, 1]), torch.tensor([3, 4]), 1, 1.0)
    assert not k.any() and not v.any()  # the valid token was not written either
    with pytest.raises(ValueError, match="bad operands"):
        KERNEL.layer(
            qkv.to(torch.bfloat16), cos_sin, k, v, table, torch.tensor([0, 1]), torch.tensor([3, 4]), 1, 1.0
        )
    for norms in (torch.ones(1, 16), torch.ones(2, 16, dtype=torch.bfloat16)):  # (H + Hkv, D), qkv's dtype
        with pytest.raises(ValueError, match="qk_norm"):
            KERNEL.layer(qkv, cos_sin, k, v, table, torch.tensor([0, 1]), torch.tensor([3, 4]), 1, 1.0, norms)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_and_silu_mul_match_torch(dtype):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 40, generator=g) * 3).to(dtype)
    gu = (torch.randn(9, 2 * 24, generator=g) * 4).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # e^-g clamped both ways
    w = (1 + 0.3 * torch.randn(40, generator=g)).to(dtype)
    want_rms = (F.rms_norm(x, (40,), eps=1e-6) * w).float()  # the torch backend's (HF's) roundings
    want_act = F.silu(gu[:, :24].float()) * gu[:, 24:].float()
    got_rms, got_act = KERNEL.rms(x, 1e-6, w), KERNEL.silu_mul(gu)
    assert got_rms.dtype == got_act.dtype == dtype and got_act.shape == (9, 24)
    tol = 2e-6 if dtype == torch.float32 else 2**-8  # fp32 rounding / one bf16 step
    assert ((got_rms.float() - want_rms).abs() <= want_rms.abs() * tol + 1e-6).all()
    assert ((got_act.float() - want_act).abs() <= want_act.abs() * tol + 1e-6).all()
    # OLMo2's RMSNorm: times the weight in fp32, then rounded once (HF's Olmo2RMSNorm)
    want_32 = (w.float() * F.rms_norm(x.float(), (40,), eps=1e-6)).to(dtype).float()
    got_32 = KERNEL.rms(x, 1e-6, w, scale_fp32=True)
    assert got_32.dtype == dtype and ((got_32.float() - want_32).abs() <= want_32.abs() * tol + 1e-6).all()
    # Gemma's: times 1 + w in fp32 (an fp32 weight for either dtype), rounded once (HF's Gemma3RMSNorm)
    w1 = 1 + 0.3 * torch.randn(40, generator=g)
    want_g = (F.rms_norm(x.float(), (40,), eps=1e-6) * w1).to(dtype).float()
    got_g = KERNEL.rms(x, 1e-6, w1, scale_fp32=True)
    assert got_g.dtype == dtype and ((got_g.float() - want_g).abs() <= want_g.abs() * tol + 1e-6).all()
    # Gemma's GeGLU: gelu with the tanh approximation, as transformers' gelu_pytorch_tanh
    want_gelu = F.gelu(gu[:, :24].float(), approximate="tanh") * gu[:, 24:].float()
    got_gelu = KERNEL.silu_mul(gu, gelu=True)
    assert ((got_gelu.float() - want_gelu).abs() <= want_gelu.abs() * tol + 1e-5).all()
    for bad_x, bad_w in ((x.t(), w), (x, w[:20]), (x, w.double())):  # not contiguous; a weight's size, dtype
        with pytest.raises(ValueError, match="bad operand"):
            KERNEL.rms(bad_x, 1e-6, bad_w)


def test_no_compiler_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "_state", {})
    assert ckernel.load() is None
    assert "no C compiler" in ckernel.unavailable() and "CC" in ckernel.unavailable()
    from tailrace.engine import TailraceEngine
    from tests.engine.engine_helpers import tiny_model

    assert TailraceEngine(tiny_model(), num_slots=1, max_context=32).backend == "bmm"
    with pytest.raises(RuntimeError, match="attention='bmm'"):
        TailraceEngine(tiny_model(), num_slots=1, max_context=32, attention="kernel")


def test_build_is_cached_per_machine(monkeypatch, tmp_path):
    if KERNEL is None:
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "_state", {})
    assert ckernel.load() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind


@needs_kernel
def test_gumbel_noise_is_the_samplers_hash():
    from tailrace.engine.sampler import gumbel_noise, vocab_salt

    g = torch.Generator().manual_seed(3)
    ints = torch.randint(0, 2**32, (9, 6), generator=g, dtype=torch.int64)  # strided columns, as RowState's
    key, index, salt = ints[:, 3], ints[:, 2] % 5000, vocab_salt(301)
    got, want = KERNEL.gumbel(key, index, salt), gumbel_noise(key, index, salt)
    assert got.shape == (9, 301) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_draw_is_the_torch_paths_token_and_logprob():
    from tailrace.engine.sampler import SampleFlags, sample, vocab_salt

    g = torch.Generator().manual_seed(4)
    B, V = 16, 257
    logits = torch.randn(B, V, generator=g) * 3
    floats = torch.tensor([[1.0, 1.0, 2.0], [1 / 0.7, 1.0, 2.0], [1.0, 0.0, 2.0], [1 / 1.5, 1.0, 2.0]] * 4)
    inv_temp, noise = floats[:, 0], floats[:, 1]  # row 2 mod 4 is greedy
    key, index, salt = torch.arange(B) * 7919 + 3, torch.arange(B) * 3, vocab_salt(V)
    args = dict(
        inv_temp=inv_temp,
        noise_scale=noise,
        top_k=torch.full((B,), V),
        top_p=torch.full((B,), 2.0),
        key=key,
        index=index,
        salt=salt,
    )
    fast = sample(logits, **args, flags=SampleFlags(), kernel=KERNEL)  # one C call
    torch_path = sample(
        logits, **args, flags=SampleFlags(any_filter=True, any_plain=False), kernel=KERNEL
    )  # torch ops, C noise (any_plain=False: no row is drawn by the C call)
    assert torch.equal(fast[0], torch_path[0])
    assert torch.allclose(fast[1], torch_path[1], atol=1e-5)
    z = logits * inv_temp[:, None]
    assert torch.equal(fast[0][2::4], z[2::4].argmax(-1))  # greedy rows
    want_lp = torch.log_softmax(z, -1).gather(1, fast[0][:, None]).squeeze(1)
    assert torch.allclose(fast[1], want_lp, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("spread", [0.1, 3.0, 40.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_draw_skips_only_noise_that_cannot_win(spread, dtype):
    """The draw computes the noise only of 16-entry chunks that could reach the best noisy value so far;
    whatever the logits' spread (wide: almost every chunk skipped), it is the token of the full noise
    (the torch path with the kernel's noise), bf16 logits read as their fp32 values."""
    from tailrace.engine.sampler import SampleFlags, sample, vocab_salt

    g = torch.Generator().manual_seed(5)
    B, V = 512, 4099  # not a multiple of 16: a scalar tail
    logits = (torch.randn(B, V, generator=g) * spread).to(dtype)
    logits[3, 100:116] = logits[3].max()  # ties at the top: the first one wins
    ones = torch.ones(B)
    args = dict(
        inv_temp=ones.clone(),
        noise_scale=ones.clone(),
        top_k=torch.full((B,), V),
        top_p=torch.full((B,), 2.0),
        key=torch.arange(B) * 104729 + 11,
        index=torch.arange(B) % 5,
        salt=vocab_salt(V),
    )
    fast = sample(logits, **args, flags=SampleFlags(), kernel=KERNEL)
    full = sample(logits.float(), **args, flags=SampleFlags(any_filter=True, any_plain=False), kernel=KERNEL)
    assert torch.equal(fast[0], full[0])
    assert torch.allclose(fast[1], full[1], atol=1e-5)
    as_fp32 = KERNEL.sample(
        logits.float(), args["inv_temp"], args["noise_scale"], args["key"], args["index"], args["salt"]
    )
    assert torch.equal(fast[0], as_fp32[0]) and torch.equal(fast[1], as_fp32[1])


@needs_kernel
def test_every_noise_value_stays_within_its_buckets_bound():
    """The draw skips a chunk when no entry can reach the best value even with its bucket's bound: over
    all 2^23 bit patterns, each pattern's noise is at most its bucket's bound, and the bound is tight
    (within 0.01 of the bucket's largest noise)."""
    bits = torch.arange(1 << 23, dtype=torch.int32)
    g, bound = KERNEL.gumbel_of_bits(bits)
    assert bool((g <= bound).all())
    top = g.view(-1, 1 << 11).max(1).values  # 4096 buckets of 2^11 patterns
    gap = bound.view(-1, 1 << 11)[:, 0] - top
    assert bool((gap > 0).all()) and float(gap.max()) < 0.01


@needs_kernel
def test_kernel_noise_stays_within_its_bound():
    """The kernel's noise (polynomial logarithms) is finite and below 16.7 (the exact noise's largest
    value, 16.64, plus the logarithms' error)."""
    from tailrace.engine.sampler import vocab_salt

    B, V = 64, 1 << 16
    g = KERNEL.gumbel(
        torch.arange(B, dtype=torch.int64) * 7919, torch.zeros(B, dtype=torch.int64), vocab_salt(V)
    )
    assert torch.isfinite(g).all() and float(g.max()) < 16.7


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_kernel_adds_each_rows_own_adapter_terms(dtype):
    """Rows of 3 adapters and of none (slot -1), two segments (q and k of a fused projection) of
    different ranks, widths not multiples of the kernel's column block: y + the per-row reference."""
    g = torch.Generator().manual_seed(0)
    M, K, S, R = 13, 40, 3, 6
    cols, ranks = torch.tensor([0, 37, 58]), torch.tensor([0, 3, 6])
    N = int(cols[-1])
    x = torch.randn(M, K, generator=g).to(dtype)
    a = torch.randn(S, R, K, generator=g).to(dtype)
    bt = torch.randn(S, R, N, generator=g).to(dtype)
    y = torch.randn(M, N, generator=g).to(dtype)
    slot = torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 2, 2, 0, 1, 0], dtype=torch.int32)
    want = y.float().clone()
    for m, s in enumerate(slot.tolist()):
        if s < 0:
            continue
        u = a[s].float() @ x[m].float()  # (R,)
        for lo, hi, r0, r1 in [(0, 37, 0, 3), (37, 58, 3, 6)]:
            want[m, lo:hi] += u[r0:r1] @ bt[s, r0:r1, lo:hi].float()
    out = y.clone()
    KERNEL.lora(x, a, bt, slot, out, cols, ranks)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(out.float(), want.to(dtype).float(), atol=tol, rtol=tol)
    assert torch.equal(out[2], y[2]) and torch.equal(out[6], y[6])  # no adapter: untouched
    with pytest.raises(ValueError, match="slot outside"):
        KERNEL.lora(x, a, bt, torch.full((M,), 3, dtype=torch.int32), out, cols, ranks)
