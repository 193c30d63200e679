"""`tailrace sim calibrate`'s fits recover known constants from points made by their own forms."""

import numpy as np
import pytest

from tailrace.calibrate.fit import default_shape, fit_decode, fit_train
from tailrace.config import ArchConfig


@pytest.mark.parametrize("dtype_bytes", [4, 2])
def test_decode_fit_recovers_the_roofline_it_was_made_from(dtype_bytes):
    shape = default_shape(ArchConfig())
    overhead, per_seq, bw, rate = 4e-4, 6e-6, 10**10.3, 10**9.7  # bw and rate on the fit's log grid
    W, kv = shape.weight_bytes_read(1, dtype_bytes), shape.kv_bytes_per_token(dtype_bytes)
    rows = []
    for B in (1, 4, 16, 32, 64):
        for ctx_per in (20, 100, 200):
            ctx = B * ctx_per
            roof = max(
                (W + kv * ctx) / bw,
                (2.0 * shape.matmul_params * B + shape.attn_flops_per_context_token * ctx) / rate,
            )
            rows.append((B, ctx, overhead + per_seq * B + roof))
    fit = fit_decode(rows, shape, dtype_bytes)
    assert fit["rel_err_median"] < 1e-6
    assert fit["overhead_s"] == pytest.approx(overhead, rel=1e-3) and fit["per_seq_s"] == pytest.approx(
        per_seq, rel=1e-3
    )
    assert fit["flops_per_s"] == pytest.approx(rate, rel=1e-3)


def test_train_fit_recovers_overhead_and_rate():
    flops = np.array([1e8, 8e8, 1.6e9, 3.2e9])
    rows = [(0, f, 0.05 + f / 2e9) for f in flops]
    fit = fit_train(rows)
    assert fit["overhead_s"] == pytest.approx(0.05) and fit["flops_per_s"] == pytest.approx(2e9)
