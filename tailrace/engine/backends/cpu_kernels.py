"""`KernelBackend`: the engine step on CPU with the C kernels of `ckernel` (kernels/decode.c).

Per layer one C call does RoPE, both cache writes and attention for every token of the step (decode
rows and prefill pieces; each row reads its own K/V exactly to its own length, in place, in fp32
arithmetic for fp32 and bf16 caches, so attention chunks are not needed), and RMSNorm and
SiLU-and-multiply are C calls too: at decode sizes each torch op costs more to dispatch than to
compute. The GEMMs are `FusedWeights`' (oneDNN packed weights above their batch threshold). The kernels
are single-threaded, the GEMMs use every torch thread. Needs the model and its cache in one dtype,
fp32 or bf16, and head_dim <= 256 (`backends.select` checks). Its speed against the torch backend:
bench/README.md.

`KernelAttentionBackend`: a cache in another dtype than the model's (an fp32 cache serving a bf16
model) keeps the torch backend's RoPE, cache writes and prefill attention, and runs the decode rows'
attention, RMSNorm and SiLU-and-multiply on the kernels.
"""

from __future__ import annotations

import torch

from tailrace.engine.backends.torch_ref import TorchBackend
from tailrace.engine.ckernel import Kernels
from tailrace.model.decoder import CausalLM


class KernelBackend(TorchBackend):
    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        kv_dtype: torch.dtype,
        kernel: Kernels,
        packed: bool | None = None,
    ):
        super().__init__(model, max_len, kv_dtype, "bmm", packed)
        self.name, self.kernel = "kernel", kernel
        self._rows_cache: dict[tuple[int, int], torch.Tensor] = {}

    def _layers(self, x, positions, cache, rows, chunks, pieces, pk: bool) -> torch.Tensor:
        w, layer = self.w, self.kernel.layer
        trow = self._token_rows(rows, pieces)
        pos = positions.contiguous()
        for i, lw in enumerate(w.layers):
            qkv = lw.qkv(self._rms(x), pk)
            o = layer(qkv, self.cos_sin, cache.k[i], cache.v[i], trow, pos, w.G, w.scale)
            x = lw.o.add(o, x, pk)
            x = lw.down.add(self._silu_mul(lw.gate_up(self._rms(x), pk)), x, pk)
        return x

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.rms(x.contiguous(), self.w.eps)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self.kernel.silu_mul(gu)

    def _token_rows(self, rows: slice, pieces) -> torch.Tensor:
        """(M,) cache row of each token: the decode rows, then each prefill piece's row n times."""
        key = (rows.start, rows.stop)
        base = self._rows_cache.get(key)
        if base is None:
            if len(self._rows_cache) > 1024:
                self._rows_cache.clear()
            base = self._rows_cache[key] = torch.arange(rows.start, rows.stop, device=self.w.device)
        return torch.cat((base, self._piece_rows(pieces))) if pieces else base


class KernelAttentionBackend(KernelBackend):
    _layers = TorchBackend._layers

    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        kv_dtype: torch.dtype,
        kernel: Kernels,
        packed: bool | None = None,
    ):
        super().__init__(model, max_len, kv_dtype, kernel, packed)
        self._decode_state, self._attend_decode = _last_positions, self._attend_kernel

    def _attend_kernel(self, q, ck, cv, r0, chunks, kpos) -> torch.Tensor:
        """Each decode row over its own positions [0, kpos[b]], in place (`chunks` unused)."""
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.float().contiguous().view(B, Hkv, G, D)
        o = self.kernel.run(q, ck, cv, kpos, r0, self.w.scale)  # (B, Hkv, G, D) fp32
        return o.view(B, Hkv * G * D).to(self.w.dtype)


def _last_positions(pos: torch.Tensor, chunks) -> torch.Tensor:
    """The kernel's per-step state: each decode row's position (B,), contiguous."""
    return pos.contiguous()
