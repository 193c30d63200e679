"""Packed (oneDNN) GEMMs run at a bounded set of row counts: oneDNN keeps a compiled kernel for every
input shape it meets, so an engine whose batches took every row count grew without end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.engine.backends.linear import Linear, packing_supported, padded_rows


def test_padded_rows_hand_checked():
    assert [padded_rows(m) for m in (1, 5, 8, 9, 16, 17, 63, 64, 65, 129, 130, 513, 1025)] == [
        1, 5, 8, 16, 16, 24, 64, 64, 72, 144, 144, 576, 1152,
    ]  # fmt: skip


def test_padded_rows_cover_every_batch_with_few_shapes_and_little_padding():
    shapes = {padded_rows(m) for m in range(1, 2049)}
    assert len(shapes) <= 60  # 1..8, then ~8 per doubling
    for m in range(1, 2049):
        r = padded_rows(m)
        assert r >= m and (r - m <= 7 if m <= 64 else (r - m) / m <= 1 / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 9, 49, 64, 65, 130])
def test_padded_packed_linear_matches_plain(dtype, m):
    if not packing_supported(dtype):
        pytest.skip(f"no oneDNN packed linear for {dtype} here")
    g = torch.Generator().manual_seed(m)
    w, b = torch.randn(40, 24, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    x, r = torch.randn(m, 24, generator=g).to(dtype), torch.randn(m, 40, generator=g).to(dtype)
    lin = Linear(w, b, packed=True)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    y = lin(x, True)
    assert y.shape == (m, 40) and y.is_contiguous()
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    z = lin.add(x, r, True)
    assert z.shape == (m, 40)
    torch.testing.assert_close(z.float(), (r + F.linear(x, w, b)).float(), atol=tol, rtol=tol)
