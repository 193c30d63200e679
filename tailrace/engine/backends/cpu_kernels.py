"""`KernelBackend`: the engine step on CPU with the C kernels of `ckernel` (kernels/decode.c).

Per layer one C call does Qwen3's q/k norms, RoPE, both cache writes and attention for every token of
the step (decode rows and prefill pieces; each row reads its own K/V exactly to its own length (the
last `window` positions of a sliding layer's; Gemma 2's scores capped), in place from the blocks its
block-table row lists, in fp32 arithmetic for fp32 and bf16 caches, so attention chunks are not
needed), and RMSNorm and SiLU-and-multiply are C calls too: at decode sizes each torch op costs more to
dispatch than to compute (Gemma's GeGLU and its norms too, which scale by an fp32 1 + w, its q/k norms
in the layer call). The GEMMs are `FusedWeights`': the kernels' own
bf16 GEMM on one thread where the CPU has AVX-512 BF16, else oneDNN packed weights above their batch
threshold (on every torch thread). The other kernels are single-threaded. Needs the model and its cache
in one dtype, fp32 or bf16, and head_dim <= 256 (`backends.select` checks). Its speed against the torch
backend: bench/README.md.

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
        max_context: int,
        kv_dtype: torch.dtype,
        kernel: Kernels,
        packed: bool | None = None,
        int8: bool = False,
    ):
        super().__init__(model, max_context, kv_dtype, "bmm", packed, kernel, int8)
        self.name, self.kernel = "kernel", kernel
        # each layer's RoPE table: OLMo3's sliding layers have their own; a layer without RoPE (SmolLM3's)
        # rotates by cos 1, sin 0, which leaves q and k as they are, bit for bit (built only for a model
        # that has such layers)
        self.tables = [self.local_cos_sin if near else self.cos_sin for near in self.local]
        if not all(self.rope):
            identity = torch.stack(
                (torch.ones_like(self.cos_sin[:, 0]), torch.zeros_like(self.cos_sin[:, 1])), 1
            )
            self.tables = [t if r else identity for t, r in zip(self.tables, self.rope)]

    def _layers(self, x, positions, cache, rows, chunks, pieces, pk: bool, lora=None) -> torch.Tensor:
        w, layer, table = self.w, self.kernel.layer, cache.table.t
        trow = self._token_rows(rows, pieces)
        pos = positions.contiguous()
        for i, lw in enumerate(w.layers):
            # the C call applies Qwen3's and Gemma 3's q/k norms
            qkv = self._qkv(i, lw, x, pk, lora, qk_norm=False)
            o = layer(
                qkv, self.tables[i], cache.k[i], cache.v[i], table, trow, pos, w.G, w.scale, lw.qk_norm, w.eps,
                w.windows[i], w.softcap,
            )  # fmt: skip
            x = self._mlp(i, lw, self._o(i, lw, o, x, pk, lora), pk, lora)
        return x

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernel.rms(x.contiguous(), self.w.eps, weight, self.w.scale_fp32)

    def _act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self.kernel.silu_mul(gu, self.w.gelu)


class KernelAttentionBackend(KernelBackend):
    _layers = TorchBackend._layers

    def __init__(
        self,
        model: CausalLM,
        max_context: int,
        kv_dtype: torch.dtype,
        kernel: Kernels,
        packed: bool | None = None,
        int8: bool = False,
    ):
        super().__init__(model, max_context, kv_dtype, kernel, packed, int8)
        self._decode_state, self._attend_decode = _kernel_state, type(self)._attend_kernel

    def _attend_kernel(self, q, ck, cv, state) -> torch.Tensor:
        """Each decode row over its own positions [0, pos[b]] (the last `window` of them), in place."""
        pos, table, r0, window = state
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.float().contiguous().view(B, Hkv, G, D)
        o = self.kernel.run(q, ck, cv, table, pos, r0, self.w.scale, window, self.w.softcap)  # (B, Hkv, G, D)
        return o.view(B, Hkv * G * D).to(self.w.dtype)


def _kernel_state(
    _backend, pos: torch.Tensor, chunks, table: torch.Tensor, r0: int, bs: int, window=None
) -> tuple:
    """The kernel's per-step state: each decode row's position (B,), contiguous; the block table; the
    first decode row (`chunks` unused: each row reads exactly its own length); the layers' window."""
    return pos.contiguous(), table, r0, window
