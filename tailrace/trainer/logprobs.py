"""Per-token log-probabilities and entropies from logits, in bounded memory.

`log_softmax(logits / T)` over a (B, T, V) tensor would allocate a full float32 copy of the logits
(and autograd would keep it for backward). Here rows are processed in chunks: the forward keeps only
the per-row log-normaliser (B*T floats), and the backward recomputes each chunk's softmax. The only
full-size allocation beyond the logits themselves is their gradient, which backward must produce.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # per-chunk float32 working set: 64 MiB


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 -> fp32; fp64 stays fp64


def _rows(n_rows: int, vocab: int, chunk_rows: int | None) -> range:
    step = chunk_rows or max(1, CHUNK_ELEMENTS // vocab)
    return range(0, n_rows, step)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_rows: int | None):
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)  # (N, V)
        tgt = targets.reshape(-1, 1)  # (N, 1)
        acc = _acc_dtype(logits.dtype)
        out = torch.empty(flat.shape[0], dtype=acc, device=logits.device)
        lse = torch.empty_like(out)
        rows = _rows(flat.shape[0], V, chunk_rows)
        for s in rows:
            x = flat[s : s + rows.step].to(acc) / temperature  # (c, V), freed each iteration
            lse[s : s + rows.step] = torch.logsumexp(x, dim=-1)
            out[s : s + rows.step] = x.gather(1, tgt[s : s + rows.step]).squeeze(1) - lse[s : s + rows.step]
        ctx.save_for_backward(logits, targets, lse)  # logits are saved, not copied
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        tgt = targets.reshape(-1, 1)
        g = grad_out.reshape(-1, 1).to(lse.dtype) / ctx.temperature  # d(x/T)/dx = 1/T
        grad = torch.empty_like(flat)
        rows = _rows(flat.shape[0], V, ctx.chunk_rows)
        for s in rows:
            e = s + rows.step
            x = flat[s:e].to(lse.dtype) / ctx.temperature
            p = torch.exp(x - lse[s:e, None])  # softmax, (c, V)
            d = -p * g[s:e]  # d logp_target / d x_v = 1[v = target] - p_v
            d.scatter_add_(1, tgt[s:e], g[s:e])
            grad[s:e] = d.to(grad.dtype)
        return grad.view_as(logits), None, None, None


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, chunk_rows: int | None = None
) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at `targets`.

    logits (B, T, V) any float dtype; targets (B, T) long -> (B, T) in float32 (float64 for float64
    logits). Differentiable w.r.t. logits. `chunk_rows` overrides the rows per chunk (tests).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0; logprobs of greedy decoding are undefined")
    return _TokenLogprobs.apply(logits, targets, float(temperature), chunk_rows)


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float, chunk_rows: int | None):
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        out = torch.empty(flat.shape[0], dtype=_acc_dtype(logits.dtype), device=logits.device)
        rows = _rows(flat.shape[0], V, chunk_rows)
        for s in rows:
            logp = torch.log_softmax(flat[s : s + rows.step].to(out.dtype) / temperature, dim=-1)
            out[s : s + rows.step] = -(logp.exp() * logp).sum(-1)  # H = -sum p log p
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, ent = ctx.saved_tensors
        V = logits.shape[-1]
        flat = logits.reshape(-1, V)
        g = grad_out.reshape(-1, 1).to(ent.dtype) / ctx.temperature
        grad = torch.empty_like(flat)
        rows = _rows(flat.shape[0], V, ctx.chunk_rows)
        for s in rows:
            e = s + rows.step
            logp = torch.log_softmax(flat[s:e].to(ent.dtype) / ctx.temperature, dim=-1)
            # dH/dx_v = -p_v (log p_v + H)
            grad[s:e] = (-logp.exp() * (logp + ent[s:e, None]) * g[s:e]).to(grad.dtype)
        return grad.view_as(logits), None, None


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, *, chunk_rows: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: (B, T, V) -> (B, T), in the chunks
    `token_logprobs` takes; differentiable (an entropy bonus trains through it), a metric of detached
    logits otherwise."""
    return _Entropy.apply(logits, float(temperature), chunk_rows)
