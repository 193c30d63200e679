"""The engine step's backends: `Backend`, what the engine calls, and `select`, its one choice per engine.

`TorchBackend` (torch_ref.py) is the reference and runs wherever torch does; `KernelBackend`
(cpu_kernels.py) runs the step on the C kernels on CPU. Every version an engine holds uses the backend
chosen when the engine was built: nothing in the step re-derives it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tailrace.engine import ckernel
from tailrace.engine.adapters import LoraStep
from tailrace.engine.backends.cpu_kernels import KernelAttentionBackend, KernelBackend
from tailrace.engine.backends.torch_ref import Span, TorchBackend
from tailrace.engine.chunks import Chunk
from tailrace.engine.kv_cache import KVCache
from tailrace.model.decoder import CausalLM

ATTENTION = ("auto", "kernel", "bmm", "sdpa")


class Backend(Protocol):
    name: str  # what `attention` resolved to: 'kernel', 'bmm' or 'sdpa'
    kernel: ckernel.Kernels | None  # the C kernels it runs on (the sampler uses them too), or None
    model: CausalLM  # its weights; call `refresh` after changing them

    def refresh(self) -> None:
        """Rebuild the derived (fused) weights from `model`'s current parameters."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: slice,
        chunks: list[Chunk],
        pieces: Sequence[Span] = (),
        want: torch.Tensor | None = None,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """One step over M tokens: B = len(rows) decode tokens first, then prefill pieces.

        tokens, positions (M,) int64 on device. Decode token b is the sequence in cache row
        rows.start + b; `chunks`: (lo, hi, S, first) per attention chunk of the decode rows (rows [lo, hi)
        attend to positions [0, S), S > their positions; `first`, the lowest of them, tells a windowed
        layer where to start reading, and may be left out: then from 0; see `engine.chunks`). `pieces`: (row, start,
        n) per prefill piece, its n tokens (next in `tokens`) at positions start.. of that row,
        attending causally to the row's cache. A row's positions are in the blocks its `cache.table` row
        lists, which cover every position written or read. Every token's k/v is written at its
        position first. `lora`: each token's LoRA adapter, whose low-rank terms follow every base GEMM
        of the projections it adapts (`engine.adapters`). The cache has the dtype the backend was
        built for and rows of at most the backend's `max_context` positions. Returns logits
        (len(want), V) of the tokens `want` indexes (default: the B decode tokens)."""
        ...


def select(
    attention: str | None,
    model: CausalLM,
    max_context: int,
    kv_dtype: torch.dtype,
    batch_invariant: bool = False,
) -> Callable[..., Backend]:
    """The backend of an engine serving `model` (on its device, in its dtype) over a cache whose rows
    address `max_context` positions, in `kv_dtype`; call it with each version's model. `attention`:
      'auto' (or None): `KernelBackend` on CPU with one torch thread, else the torch backend's 'bmm';
      'kernel': `KernelBackend` on CPU with any number of threads (RuntimeError where the kernels do not
      build), else 'bmm';
      'bmm', 'sdpa': `TorchBackend` with that decode attention.
    The kernels need head_dim <= 256 and fp32/bf16 weights and cache; elsewhere 'auto' and 'kernel'
    fall back to 'bmm'. `batch_invariant`: a row's logits must not depend on the batch (nor on whether
    its token is decoded or verified as a prefill piece): the torch backend then attends on fp32 copies
    at every batch with a bf16/fp16 cache, and 'sdpa' (low-precision attention) gives way to 'bmm'.
    The kernels are batch-invariant as they are."""
    attention = attention or "auto"
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: use 'auto', 'kernel', 'bmm' or 'sdpa'")
    w = model.model.embed_tokens.weight
    kernel = None
    if (
        attention in ("auto", "kernel")
        and w.device.type == "cpu"
        and model.config.head_dim <= ckernel.MAX_HEAD_DIM
        and (attention == "kernel" or torch.get_num_threads() == 1)
    ):
        kernel = ckernel.load()
        if kernel is None and attention == "kernel":
            raise RuntimeError(f"attention='kernel': {ckernel.unavailable()}; or use attention='bmm'")
    if kernel is not None and w.dtype in kernel.dtypes and kv_dtype in kernel.dtypes:
        cls = KernelBackend if kv_dtype == w.dtype else KernelAttentionBackend
        return functools.partial(cls, max_context=max_context, kv_dtype=kv_dtype, kernel=kernel)
    variant = "sdpa" if attention == "sdpa" and not (batch_invariant and kv_dtype != torch.float32) else "bmm"
    upcast = {"upcast_max_batch": sys.maxsize} if batch_invariant else {}
    return functools.partial(
        TorchBackend, max_context=max_context, kv_dtype=kv_dtype, variant=variant, **upcast
    )
