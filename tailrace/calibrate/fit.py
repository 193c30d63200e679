"""Fits of the measurements to the simulator's cost model: the decode step's roofline form, the
trainer's FLOP rate, and the engine worker's per-row excess over the decode fit."""

from __future__ import annotations

import numpy as np

from tailrace.config import ArchConfig
from tailrace.sim.models import ModelShape
from tailrace.tokenizer import char_tokenizer


def default_shape(cfg: ArchConfig) -> ModelShape:
    return ModelShape(
        "tailrace-default",
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.hidden_size // cfg.num_heads,
        cfg.intermediate_size,
        char_tokenizer().vocab_size,
        tied_embeddings=True,
    )


def _decode_work(shape: ModelShape, dtype_bytes: int, B, ctx):
    """(bytes read, FLOPs) of a decode step of B rows reading ctx cached tokens in all: the two sides
    of the roofline the fit and `worker_excess` evaluate (scalars or arrays)."""
    mem = shape.weight_bytes_read(1, dtype_bytes) + shape.kv_bytes_per_token(dtype_bytes) * ctx
    return mem, 2.0 * shape.matmul_params * B + shape.attn_flops_per_context_token * ctx


def fit_decode(rows, shape: ModelShape, dtype_bytes: int = 4) -> dict:
    """Fit the cost model's own decode form to measured steps:
        t = overhead + per_seq * B + max((W + kv * ctx) / bw, (2 N B + attn * ctx) / rate)
    by a log grid over (bw, rate) with overhead, per_seq >= 0 solved by least squares at each point;
    the grid point with the smallest median relative error wins."""
    P = np.array(rows, float)
    B, ctx, t = P[:, 0], P[:, 1], P[:, 2]
    mem, flops = _decode_work(shape, dtype_bytes, B, ctx)
    X = np.stack([np.ones_like(B), B], 1)
    best = None
    for bw in np.logspace(8.5, 11.5, 61):
        for rate in np.logspace(8.5, 12, 71):
            roof = np.maximum(mem / bw, flops / rate)
            (a, s), *_ = np.linalg.lstsq(X, t - roof, rcond=None)
            if s < 0:
                a, s = float(np.mean(t - roof)), 0.0
            a = max(a, 0.0)
            err = float(np.median(np.abs(a + s * B + roof - t) / t))
            if best is None or err < best[0]:
                best = (err, bw, rate, a, s)
    err, bw, rate, a, s = best
    return {
        "overhead_s": float(a),
        "per_seq_s": float(s),
        "mem_bw": float(bw),
        "flops_per_s": float(rate),
        "rel_err_median": err,
        "points": len(rows),
    }


def fit_train(rows) -> dict:
    """t = overhead + FLOPs / rate, overhead >= 0."""
    f = np.array([r[1] for r in rows], float)
    t = np.array([r[2] for r in rows], float)
    w = 1.0 / t  # relative error: a small step's time matters as much as a big one's
    (a, inv), *_ = np.linalg.lstsq(np.stack([w, f * w], 1), np.ones_like(t), rcond=None)
    if a < 0 or inv <= 0:
        a, inv = 0.0, float(np.sum(t) / np.sum(f))
    return {
        "overhead_s": float(a),
        "flops_per_s": float(1.0 / inv),
        "rel_err_median": float(np.median(np.abs(a + inv * f - t) / t)),
    }


def worker_excess(dec: dict, wk: dict, shape: ModelShape, dtype_bytes: int) -> float:
    """Seconds per running row per step that the runtime's worker spends beyond the fitted pure decode
    step at its mean batch and context (its sampling, stop checks and result packaging, and the prompt
    prefills of admissions mixed into its steps: work that grows with the rows, not with the step)."""
    B = wk["mean_batch"]
    mem, flops = _decode_work(shape, dtype_bytes, B, B * wk["mean_row_context"])
    pred = dec["overhead_s"] + dec["per_seq_s"] * B + max(mem / dec["mem_bw"], flops / dec["flops_per_s"])
    return max(0.0, wk["mean_step_s"] - pred) / B
