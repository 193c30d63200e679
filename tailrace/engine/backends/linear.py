"""`Linear`: y = x W^T (+ b) (+ residual) for the engine step, by MKL, by oneDNN on packed weights, or
(on one thread, where the CPU has AVX-512; bf16 needs AVX-512 BF16) by the C kernels' GEMM
(`ckernel.Kernels.gemm`), which beats both at decode batches: it prefetches the next panel of a weight
that streams from memory, and costs one ctypes call (figures: bench/README.md).

On CPU, MKL re-packs the weight on every call; oneDNN can pack it once (`_reorder_linear_weight`) and
then reads it in its own blocked layout, and fuses the residual add. Which is faster depends on the
dtype and the batch (figures: bench/README.md), so `packed` is chosen per call
(`FusedWeights.packed_at`). These `torch.ops.mkldnn` ops are what torch's own inductor uses on CPU;
`packing_supported` checks them once and everything falls back to plain `F.linear`/`addmm` where
they are missing or disagree.

oneDNN compiles and keeps a kernel for every input shape it meets (about 0.6 MB each, never freed),
so an engine whose batches take every row count from 1 to prefill_tokens + slots grew by gigabytes
over a long run. Packed GEMMs therefore run on inputs padded to `padded_rows(M)`: about 8 row counts
per doubling of M, whatever the batches (the padding rows are zeros; their outputs are dropped).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tailrace.common import padded_rows  # noqa: F401 (the engine's name for it)
from tailrace.engine.ckernel import Kernels


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """True when oneDNN packed linears exist here and match F.linear on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        if dtype not in (torch.float32, torch.bfloat16):
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(dtype)
        x = torch.randn(5, 16, generator=g).to(dtype)
        r = torch.randn(5, 24, generator=g).to(dtype)
        lin = Linear(w, None, packed=True)
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        ok = torch.allclose(lin(x, True).float(), F.linear(x, w).float(), atol=tol, rtol=tol)
        ok &= torch.allclose(
            lin.add(x, r, True).float(), torch.addmm(r, x, w.t()).float(), atol=tol, rtol=tol
        )
        return bool(ok)
    except (RuntimeError, AttributeError):
        return False


def kernel_gemm_serves(kernel: Kernels, w: torch.Tensor) -> bool:
    """Whether the C kernels' GEMM can serve weight `w`: a dtype it has on this CPU (`gemm_dtypes`), on
    CPU, an even number of columns for bf16, and one torch thread (the kernel runs on one)."""
    return (
        w.dtype in kernel.gemm_dtypes
        and w.device.type == "cpu"
        and (w.dtype == torch.float32 or w.shape[1] % 2 == 0)
        and torch.get_num_threads() == 1
    )


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def rtn_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 per output row: q (N, K) int8 and scale (N,) fp32 with
    w ~ q * scale[:, None], scale = max|w_row| / 127."""
    scale = w.float().abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Linear:
    __slots__ = ("w", "wt", "n", "b", "p", "k", "kw", "kb", "ks")

    def __init__(
        self,
        w: torch.Tensor,
        b: torch.Tensor | None,
        packed: bool,
        kernel: Kernels | None = None,
        int8: bool = False,
        plain: bool = True,
    ):
        """`kernel`: the C kernels, whose GEMM then serves every call (`packed` unused), where it can
        (`kernel_gemm_serves`). `int8`: W rounded to int8 per output row (`rtn_int8`, a quantized
        drafter's weights): run on the kernels' int8 GEMM where it serves a bf16 W, else as the
        dequantized values on the other paths (the same numbers, without the halved weight bytes).
        `plain=False`: every call will pass `packed=True`, so W itself is not kept where a packed copy
        (the kernels' or oneDNN's) serves: an int8 W (its dequantized copy) is then freed; the model's
        own weights stay the model's."""
        self.ks = None
        if int8:
            q, scale = rtn_int8(w)
            if kernel is not None and kernel_gemm_serves(kernel, w) and w.dtype == torch.bfloat16:
                self.ks = scale
                self.kw = kernel.pack_i8(q)
            w = (q.float() * scale[:, None]).to(w.dtype)
        self.w, self.wt, self.n, self.b = w, w.t(), w.shape[0], b
        self.k = kernel if kernel is not None and kernel_gemm_serves(kernel, w) else None
        if self.k is not None:
            self.kb, self.p = None if b is None else b.float(), None
            if self.ks is None:
                self.kw = self.k.pack(w)
        else:
            self.p = torch.ops.mkldnn._reorder_linear_weight(w) if packed else None
        if not plain and (self.k is not None or self.p is not None):
            self.w = self.wt = None

    def __call__(self, x: torch.Tensor, packed: bool) -> torch.Tensor:
        if not x.shape[0]:  # no rows (a prefill chunk whose logits no one wants): `packed_at` is False at 0
            return x.new_empty(0, self.n)  # rows, and W itself may be gone (`plain=False`)
        if self.ks is not None:
            return self.k.gemm_i8(x.contiguous(), self.kw, self.ks, self.kb)
        if self.k is not None:
            return self.k.gemm(x.contiguous(), self.kw, self.n, self.kb)
        if packed:
            m = x.shape[0]
            y = torch.ops.mkldnn._linear_pointwise(_pad(x, padded_rows(m)), self.p, self.b, "none", [], "")
            return y[:m]
        return F.linear(x, self.w, self.b)

    def add(self, x: torch.Tensor, residual: torch.Tensor, packed: bool) -> torch.Tensor:
        """residual + x W^T + b."""
        if self.ks is not None:
            return self.k.gemm_i8(x.contiguous(), self.kw, self.ks, self.kb, residual.contiguous())
        if self.k is not None:
            return self.k.gemm(x.contiguous(), self.kw, self.n, self.kb, residual.contiguous())
        if packed:
            m = x.shape[0]
            r = padded_rows(m)
            y = torch.ops.mkldnn._linear_pointwise.binary(
                _pad(x, r), _pad(residual, r), self.p, self.b, "add"
            )
            return y[:m]
        y = torch.addmm(residual, x, self.wt)
        return y if self.b is None else y.add_(self.b)
