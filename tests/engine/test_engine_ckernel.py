"""The C decode-attention kernel against softmax attention written out in torch."""
from __future__ import annotations

import pytest
import torch

from tailrace.engine import ckernel

KERNEL = ckernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"C kernel unavailable: {ckernel.unavailable()}")


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
@pytest.mark.parametrize("G", [1, 3])
def test_kernel_matches_softmax_attention(dtype, D, G):
    g = torch.Generator().manual_seed(D * 10 + G)
    rows, Hkv, L, B, row0 = 7, 2, 50, 5, 2
    k = (torch.randn(rows, Hkv, L, D, generator=g) * 2).to(dtype)
    v = torch.randn(rows, Hkv, L, D, generator=g).to(dtype)
    q = torch.randn(B, Hkv, G, D, generator=g)
    pos = torch.tensor([0, 49, 13, 1, 30])  # a first token (attends to itself only) and a full row
    got = KERNEL.run(q, k, v, pos, row0, D ** -0.5)
    want = reference(q, k.float(), v.float(), pos, row0, D ** -0.5)
    assert (got.double() - want).abs().max() < 2e-6


@needs_kernel
def test_kernel_ignores_cache_beyond_each_rows_length():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 20, 32, generator=g), torch.randn(2, 1, 20, 32, generator=g)
    q, pos = torch.randn(2, 1, 2, 32, generator=g), torch.tensor([4, 11])
    a = KERNEL.run(q, k, v, pos, 0, 0.2)
    k[0, :, 5:], v[1, :, 12:] = float("nan"), 1e30  # garbage past each row's last position
    assert torch.equal(KERNEL.run(q, k, v, pos, 0, 0.2), a)


@needs_kernel
def test_kernel_rejects_positions_outside_the_cache_and_bad_operands():
    k = v = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(2, 1, 1, 16)
    for bad in (8, -1, 10 ** 15):  # the next row's position is only prefetched from, then checked
        with pytest.raises(ValueError, match="position outside the cache"):
            KERNEL.run(q, k, v, torch.tensor([3, bad]), 0, 1.0)
    with pytest.raises(ValueError, match="bad operands"):
        KERNEL.run(q, k, v, torch.tensor([3, 4]), 1, 1.0)  # rows 1..3 of a 2-row cache
    with pytest.raises(ValueError, match="bad operands"):
        KERNEL.run(q.to(torch.bfloat16), k, v, torch.tensor([3, 4]), 0, 1.0)


def test_no_compiler_falls_back_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "_state", {})
    assert ckernel.load() is None
    assert "no C compiler" in ckernel.unavailable() and "CC" in ckernel.unavailable()
    from tests.engine.engine_helpers import tiny_model
    from tailrace.engine.runner import Runner
    assert Runner(tiny_model(), 32).attention == "bmm"
    with pytest.raises(RuntimeError, match="attention='bmm'"):
        Runner(tiny_model(), 32, "kernel")


def test_build_is_cached_per_machine(monkeypatch, tmp_path):
    if KERNEL is None:
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")
    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "_state", {})
    assert ckernel.load() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary left behind
