"""The C kernels' GEMMs (kernels/gemm.c), bf16 and fp32: exact where the fp32 sum is exact, the same for
a row whatever the batch around it, and serving the engine's linears only where they can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.engine import ckernel
from tailrace.engine.backends.linear import Linear, kernel_gemm_serves

K = ckernel.load()
needs_gemm = pytest.mark.skipif(
    K is None or torch.bfloat16 not in K.gemm_dtypes, reason="no C compiler or no AVX-512 BF16 here"
)
needs_f32 = pytest.mark.skipif(
    K is None or torch.float32 not in K.gemm_dtypes, reason="no C compiler or no AVX-512 here"
)


def _ints(*shape, g, lo=-4, hi=5) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=g).to(torch.bfloat16)


def test_pack_lays_out_panels_of_48_columns_with_k_in_pairs():
    w = torch.arange(50 * 4, dtype=torch.float32).view(50, 4).to(torch.bfloat16)
    p = ckernel.Kernels.pack(w)
    assert p.shape == (2, 2, 48, 2)
    assert p[0, 1, 3].tolist() == [w[3, 2].item(), w[3, 3].item()]  # column 3, k pair 1
    assert p[1, 0, 1].tolist() == [w[49, 0].item(), w[49, 1].item()]  # column 49 = panel 1, column 1
    assert p[1, :, 2:].abs().sum() == 0  # columns 50.. are zero
    with pytest.raises(ValueError, match="even number of columns"):
        ckernel.Kernels.pack(torch.zeros(4, 3, dtype=torch.bfloat16))
    f = ckernel.Kernels.pack(w.float()[:, :3])  # fp32: k single, any K
    assert f.shape == (2, 3, 48) and f[1, 2, 1] == w[49, 2].float() and f[1, :, 2:].abs().sum() == 0


@needs_gemm
@pytest.mark.parametrize("M", [1, 7, 8, 9, 33])
@pytest.mark.parametrize("N", [1, 16, 47, 48, 49, 100])
@pytest.mark.parametrize("k", [2, 6, 576])
def test_gemm_equals_the_exact_product_where_fp32_sums_are_exact(M, N, k):
    """Small integers: every product and partial sum is exact in fp32, so the result is the exact value
    rounded to bf16 once, whatever the order of accumulation, bit for bit."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + k)
    x, w = _ints(M, k, g=g), _ints(N, k, g=g)
    b, r = _ints(N, g=g).float(), _ints(M, N, g=g)
    exact = x.double() @ w.double().T
    p = K.pack(w)
    assert torch.equal(K.gemm(x, p, N), exact.to(torch.bfloat16))
    assert torch.equal(K.gemm(x, p, N, b, r), (exact + b.double() + r.double()).to(torch.bfloat16))


@needs_f32
@pytest.mark.parametrize("M", [1, 8, 9, 33])
@pytest.mark.parametrize("N", [1, 47, 49, 100])
@pytest.mark.parametrize("k", [1, 5, 576])
def test_fp32_gemm_equals_the_exact_product_where_fp32_sums_are_exact(M, N, k):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + k)
    x, w = _ints(M, k, g=g).float(), _ints(N, k, g=g).float()
    b, r = _ints(N, g=g).float(), _ints(M, N, g=g).float()
    exact = x.double() @ w.double().T
    p = K.pack(w)
    assert torch.equal(K.gemm(x, p, N), exact.float())
    assert torch.equal(K.gemm(x, p, N, b, r), (exact + b.double() + r.double()).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch_around_it(dtype):
    """Each output is one dot product accumulated in a fixed order, whatever the rows beside it: a
    request's activations, and so its tokens, do not change with the batch it decodes in."""
    if K is None or dtype not in K.gemm_dtypes:
        pytest.skip(f"no C GEMM for {dtype} here")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 200, generator=g).to(dtype), torch.randn(130, 200, generator=g).to(dtype)
    p = K.pack(w)
    whole = K.gemm(x, p, 130)
    for lo, hi in ((0, 1), (5, 6), (3, 12), (8, 16), (30, 37)):
        assert torch.equal(K.gemm(x[lo:hi].contiguous(), p, 130), whole[lo:hi])


@needs_gemm
def test_gemm_rounds_once_to_nearest_even():
    """1 + 2^-8 is halfway between two bf16 values: nearest even gives 1.0; 1 + 3 * 2^-8 gives 1 + 2^-6.
    A second rounding (or truncation) would give other values."""
    x = torch.tensor([[1.0, 2.0**-8], [1.0, 3 * 2.0**-8]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    y = K.gemm(x, K.pack(w), 1)
    assert y.flatten().tolist() == [1.0, 1.0 + 2.0**-6]


@needs_gemm
def test_gemm_close_to_fp32_on_random_values():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 576, generator=g).bfloat16(), torch.randn(960, 576, generator=g).bfloat16()
    y = K.gemm(x, K.pack(w), 960)
    ref = x.float() @ w.float().T
    torch.testing.assert_close(y.float(), ref, atol=0.3, rtol=1 / 128)  # bf16's own rounding


@needs_gemm
def test_gemm_rejects_operands_it_cannot_read():
    w = torch.zeros(48, 8, dtype=torch.bfloat16)
    p = K.pack(w)
    with pytest.raises(ValueError, match="gemm: bad operands"):
        K.gemm(torch.zeros(2, 8), p, 48)  # fp32 input, bf16 weight
    with pytest.raises(ValueError, match="gemm: bad operands"):
        K.gemm(torch.zeros(2, 6, dtype=torch.bfloat16), p, 48)  # K disagrees with the packing
    with pytest.raises(ValueError, match="gemm: bad operands"):
        K.gemm(torch.zeros(2, 8, dtype=torch.bfloat16), p, 48, r=torch.zeros(2, 47, dtype=torch.bfloat16))


@needs_gemm
@pytest.mark.parametrize("bias", [False, True])
def test_linear_on_the_kernel_gemm_matches_plain_linear(bias):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(100, 64, generator=g).bfloat16()
    b = torch.randn(100, generator=g).bfloat16() if bias else None
    x, r = torch.randn(9, 64, generator=g).bfloat16(), torch.randn(9, 100, generator=g).bfloat16()
    lin = Linear(w, b, packed=True, kernel=K)
    assert lin.k is K and lin.p is None  # no oneDNN copy kept beside the kernel's
    tol = dict(atol=0.1, rtol=1 / 64)
    torch.testing.assert_close(lin(x, True).float(), F.linear(x, w, b).float(), **tol)
    torch.testing.assert_close(lin.add(x, r, False).float(), (F.linear(x, w, b) + r).float(), **tol)


@needs_gemm
def test_the_kernel_gemm_serves_its_dtypes_and_even_bf16_widths_on_one_thread():
    bf = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert kernel_gemm_serves(K, bf)
    assert kernel_gemm_serves(K, torch.zeros(4, 7)) == (torch.float32 in K.gemm_dtypes)
    assert not kernel_gemm_serves(K, bf.half())
    assert not kernel_gemm_serves(K, torch.zeros(4, 7, dtype=torch.bfloat16))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not kernel_gemm_serves(K, bf)
        assert Linear(bf, None, packed=False, kernel=K).k is None
    finally:
        torch.set_num_threads(n)


@needs_gemm
@pytest.mark.parametrize("M", [1, 8, 9])
@pytest.mark.parametrize("N", [5, 48, 100])
def test_int8_gemm_equals_the_exact_product_where_fp32_sums_are_exact(M, N):
    """Small integer activations and int8 weights with power-of-two column scales: every product, sum
    and scaling is exact in fp32, so the result is the exact value rounded to bf16 once."""
    g = torch.Generator().manual_seed(M * 100 + N)
    x = _ints(M, 64, g=g)
    q = torch.randint(-127, 128, (N, 64), generator=g, dtype=torch.int8)
    scale = 2.0 ** torch.randint(-8, 0, (N,), generator=g).float()
    b, r = _ints(N, g=g).float(), _ints(M, N, g=g)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    p = K.pack_i8(q)
    assert torch.equal(K.gemm_i8(x, p, scale), exact.to(torch.bfloat16))
    assert torch.equal(K.gemm_i8(x, p, scale, b, r), (exact + b.double() + r.double()).to(torch.bfloat16))


@needs_gemm
def test_an_int8_linear_runs_the_rounded_weights_on_every_path():
    """int8: on the kernels' int8 GEMM (bf16, one thread) and on the plain path alike, the weights are
    W rounded to int8 per output row; the two paths agree to bf16's rounding."""
    from tailrace.engine.backends.linear import rtn_int8

    g = torch.Generator().manual_seed(4)
    w = torch.randn(100, 64, generator=g).bfloat16()
    x, r = torch.randn(9, 64, generator=g).bfloat16(), torch.randn(9, 100, generator=g).bfloat16()
    fast, plain = Linear(w, None, True, kernel=K, int8=True), Linear(w, None, True, int8=True)
    assert fast.ks is not None and plain.ks is None
    q, scale = rtn_int8(w)
    assert q.abs().max() <= 127 and torch.equal(plain.w, (q.float() * scale[:, None]).bfloat16())
    tol = dict(atol=0.1, rtol=1 / 64)
    torch.testing.assert_close(fast(x, True).float(), plain(x, True).float(), **tol)
    torch.testing.assert_close(fast.add(x, r, True).float(), plain.add(x, r, True).float(), **tol)
    assert Linear(w.float(), None, True, kernel=K, int8=True).ks is None  # fp32: no int8 GEMM
