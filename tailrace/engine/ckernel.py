"""The engine's C kernels for the decode step (kernels/decode.c, kernels/gemm.c): built once per machine,
loaded by ctypes.

Built with the system C compiler ($CC, default `cc`; -O3 -march=native) into one library in
$TAILRACE_CACHE/kernels/ under a name hashing the sources, the flags, the compiler and this CPU's
feature flags, so a shared home directory never hands one machine another's instructions. Written to a
temporary name and renamed, so processes building at once never load a half-written library. No torch
headers: a build takes well under a second. Where there is no compiler (or the build fails) `load()`
returns None, `unavailable()` says why, and the engine runs torch ops instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tailrace.common import cache_root

SOURCES = tuple(Path(__file__).with_name("kernels") / f for f in ("decode.c", "gemm.c"))
GEMM_PANEL = 48  # columns per panel of a weight packed for `Kernels.gemm` (NR in gemm.c)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp-simd", "-shared", "-fPIC"]
MAX_HEAD_DIM = 256
LORA_ROWS = 8  # kernels/decode.c: rows of one adapter per block of its LoRA kernel

_lock = threading.Lock()
_state: dict[str, object] = {}


class Kernels:
    """The decode step's kernels: `layer` (RoPE, cache writes and attention of a layer in one call),
    `rms`, `silu_mul`, `gumbel` and `sample` (the sampler's noise and draw), `run` (attention alone),
    `lora` (rows' adapter terms), and `gemm` (linears over weights packed by `pack`, in the dtypes
    `gemm_dtypes` lists: fp32 where the CPU has AVX-512, bf16 where it has AVX-512 BF16).
    Both attention calls read a paged cache in place: k, v (blocks, Hkv, block_size, D), fp32/bf16, and a
    block table (rows, W) int32 whose row r lists the blocks holding positions [0, W block_size) of the
    sequence in row r (see `KVCache`)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {torch.float32: lib.decode_attn_f32, torch.bfloat16: lib.decode_attn_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_void_p]
            fn.argtypes += [ctypes.c_int64, ctypes.c_float]
        self.dtypes = tuple(self._fns)  # the cache dtypes it reads
        self._layer = {torch.float32: lib.decode_layer_f32, torch.bfloat16: lib.decode_layer_bf16}
        # a bf16 layer whose q/k norm weights are fp32 (Gemma 3's)
        self._layer_w32 = lib.decode_layer_w32_bf16
        for fn in (*self._layer.values(), self._layer_w32):
            fn.restype = ctypes.c_int
            fn.argtypes = (
                [ctypes.c_void_p] * 8
                + [ctypes.c_int64] * 8
                + [ctypes.c_float]
                + [ctypes.c_void_p] * 2
                + [ctypes.c_float]
                + [ctypes.c_int64] * 2
                + [ctypes.c_float]
            )
        self._rms = {torch.float32: lib.rms_f32, torch.bfloat16: lib.rms_bf16}
        # OLMo2's (scaled in fp32, rounded once): in fp32 the same as rms_f32
        self._rms32 = {torch.float32: lib.rms_f32, torch.bfloat16: lib.rms_scale32_bf16}
        self._silu_mul = {torch.float32: lib.silu_mul_f32, torch.bfloat16: lib.silu_mul_bf16}
        self._gelu_mul = {torch.float32: lib.gelu_mul_f32, torch.bfloat16: lib.gelu_mul_bf16}
        for fn in (*self._rms.values(), lib.rms_scale32_bf16, lib.rms_w32_bf16):
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
        for fn in (*self._silu_mul.values(), *self._gelu_mul.values()):
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.gumbel_f32.restype = None
        lib.gumbel_f32.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        )
        self._sample = {torch.float32: lib.sample_f32, torch.bfloat16: lib.sample_bf16}
        for fn in self._sample.values():
            fn.restype = None
            fn.argtypes = (
                [ctypes.c_void_p]
                + [ctypes.c_void_p, ctypes.c_int64] * 4
                + [ctypes.c_void_p]
                + [ctypes.c_int64] * 2
                + [ctypes.c_void_p] * 3
            )
        self._lora = {torch.float32: lib.lora_f32, torch.bfloat16: lib.lora_bf16}
        for fn in self._lora.values():
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 3
        lib.gumbel_of_bits.restype = None
        lib.gumbel_of_bits.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self._gemm = {torch.float32: lib.gemm_f32, torch.bfloat16: lib.gemm_bf16}
        for fn in self._gemm.values():
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            fn.argtypes += [ctypes.c_void_p] * 3
        lib.gemm_i8.restype = None
        lib.gemm_i8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.gemm_i8.argtypes += [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
        has = lib.gemm_supported()
        self.gemm_dtypes = tuple(d for d, bit in ((torch.float32, 1), (torch.bfloat16, 2)) if has & bit)
        self._lib = lib
        self._scratch = torch.empty(0)

    def gumbel_of_bits(self, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The noise of each 23-bit pattern in `bits` (int32, contiguous) and the bound the draw skips
        chunks by for its bucket: (g, bound), fp32."""
        if not (bits.dtype == torch.int32 and bits.dim() == 1 and bits.is_contiguous()):
            raise ValueError(f"gumbel_of_bits: bad operand {tuple(bits.shape)} {bits.dtype}")
        g, bound = torch.empty(bits.shape[0]), torch.empty(bits.shape[0])
        self._lib.gumbel_of_bits(bits.data_ptr(), bits.shape[0], g.data_ptr(), bound.data_ptr())
        return g, bound

    @staticmethod
    def pack(w: torch.Tensor) -> torch.Tensor:
        """w (N, K) laid out for `gemm`: panels of 48 columns (zero past N); bf16 with k in pairs
        (ceil(N/48), K/2, 48, 2) (K even), fp32 with k single (ceil(N/48), K, 48)."""
        if w.dtype not in (torch.float32, torch.bfloat16) or (w.dtype == torch.bfloat16 and w.shape[1] % 2):
            raise ValueError(
                f"pack: needs an fp32 weight, or a bf16 one with an even number of columns, not "
                f"{tuple(w.shape)} {w.dtype}"
            )
        return _panels(w, pairs=w.dtype == torch.bfloat16)

    @staticmethod
    def pack_i8(q: torch.Tensor) -> torch.Tensor:
        """q (N, K) int8, K even, in `pack`'s bf16 layout (ceil(N/48), K/2, 48, 2), for `gemm_i8`."""
        if q.dtype != torch.int8 or q.shape[1] % 2:
            raise ValueError(
                f"pack_i8: needs an int8 weight with an even number of columns, not {tuple(q.shape)}"
            )
        return _panels(q, pairs=True)

    def gemm_i8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        b: torch.Tensor | None = None,
        r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y (M, n) = x (M, K) (Q diag(scale))^T (+ b) (+ r): int8 weights Q (n, K) `pack_i8`ed, one fp32
        scale per output column, bf16 x, r and y, fp32 accumulation. Needs bf16 in `gemm_dtypes`."""
        M, K = x.shape
        n = scale.shape[0]
        if not (
            torch.bfloat16 in self.gemm_dtypes
            and x.dtype == torch.bfloat16
            and x.is_contiguous()
            and packed.dtype == torch.int8
            and packed.shape == _panel_shape(n, K, pairs=True)
            and scale.dtype == torch.float32
            and scale.is_contiguous()
            and _bias_residual_ok(b, r, M, n, torch.bfloat16)
        ):
            raise ValueError(
                f"gemm_i8: bad operands x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)}, n {n}"
            )
        y = torch.empty(M, n, dtype=torch.bfloat16)
        self._lib.gemm_i8(
            x.data_ptr(),
            M,
            K,
            packed.data_ptr(),
            scale.data_ptr(),
            n,
            0 if b is None else b.data_ptr(),
            0 if r is None else r.data_ptr(),
            y.data_ptr(),
        )
        return y

    def gemm(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        b: torch.Tensor | None = None,
        r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y (M, n) = x (M, K) W^T (+ b) (+ r) in x's dtype (fp32 or bf16) with fp32 accumulation, W
        (n, K) as `pack`ed; b fp32 (n,), r (M, n) in x's dtype. One thread."""
        M, K = x.shape
        dt = x.dtype
        if not (
            dt in self.gemm_dtypes
            and packed.dtype == dt
            and x.is_contiguous()
            and packed.shape == _panel_shape(n, K, pairs=dt == torch.bfloat16)
            and _bias_residual_ok(b, r, M, n, dt)
        ):
            raise ValueError(
                f"gemm: bad operands x {tuple(x.shape)} {dt}, packed {tuple(packed.shape)}, n {n}"
            )
        y = torch.empty(M, n, dtype=dt)
        self._gemm[dt](
            x.data_ptr(),
            M,
            K,
            packed.data_ptr(),
            n,
            0 if b is None else b.data_ptr(),
            0 if r is None else r.data_ptr(),
            y.data_ptr(),
        )
        return y

    def _scratch_of(self, n: int) -> torch.Tensor:
        """The kernels' fp32 work buffer, grown to at least n floats (one per instance: one engine thread)."""
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n)
        return self._scratch

    def gumbel(self, key: torch.Tensor, index: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        """`sampler.gumbel_noise` computed here: (B, V) fp32 from key, index (B,) int64 (any stride) and
        salt (V,) int64. The same hash; the logarithms by a polynomial (relative error ~1e-7)."""
        B, V = key.shape[0], salt.shape[0]
        if not (
            key.dtype == index.dtype == salt.dtype == torch.int64
            and index.shape == (B,)
            and key.dim() == 1
            and salt.is_contiguous()
        ):
            raise ValueError(
                f"gumbel: bad operands key {tuple(key.shape)}, index {tuple(index.shape)}, salt {tuple(salt.shape)}"
            )
        out = torch.empty(B, V)
        self._lib.gumbel_f32(
            key.data_ptr(),
            key.stride(0),
            index.data_ptr(),
            index.stride(0),
            salt.data_ptr(),
            out.data_ptr(),
            B,
            V,
        )
        return out

    def sample(
        self,
        logits: torch.Tensor,
        inv_temp: torch.Tensor,
        noise_scale: torch.Tensor,
        key: torch.Tensor,
        index: torch.Tensor,
        salt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row of logits (B, V) fp32 or bf16 (read as fp32) without top-k/top-p or bans:
        `sampler.sample`'s token given this module's noise, and its logprob under
        log_softmax(logits * inv_temp)."""
        B, V = logits.shape
        if not (
            logits.dtype in self._sample
            and inv_temp.dtype == noise_scale.dtype == torch.float32
            and logits.is_contiguous()
            and key.dtype == index.dtype == salt.dtype == torch.int64
            and salt.shape == (V,)
            and salt.is_contiguous()
            and inv_temp.shape == noise_scale.shape == key.shape == index.shape == (B,)
        ):
            raise ValueError(
                f"sample: bad operands logits {tuple(logits.shape)} {logits.dtype}, salt {tuple(salt.shape)}"
            )
        scratch = self._scratch_of(2 * V)
        tokens, lps = torch.empty(B, dtype=torch.int64), torch.empty(B)
        self._sample[logits.dtype](
            logits.data_ptr(),
            inv_temp.data_ptr(),
            inv_temp.stride(0),
            noise_scale.data_ptr(),
            noise_scale.stride(0),
            key.data_ptr(),
            key.stride(0),
            index.data_ptr(),
            index.stride(0),
            salt.data_ptr(),
            B,
            V,
            scratch.data_ptr(),
            tokens.data_ptr(),
            lps.data_ptr(),
        )
        return tokens, lps

    def rms(
        self, x: torch.Tensor, eps: float, weight: torch.Tensor, scale_fp32: bool = False
    ) -> torch.Tensor:
        """RMSNorm of each row of x (M, N), fp32 or bf16, as the model's: normalized in fp32, rounded to
        the dtype, times `weight` (N,) of x's dtype, rounded again; `scale_fp32` (OLMo2's, Gemma's): times the
        weight in fp32, rounded once (Gemma's weight, 1 + w, may be fp32 for a bf16 x)."""
        w32 = scale_fp32 and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
        fn = self._lib.rms_w32_bf16 if w32 else (self._rms32 if scale_fp32 else self._rms).get(x.dtype)
        ok = fn is not None and x.dim() == 2 and x.is_contiguous() and (weight.dtype is x.dtype or w32)
        if not (ok and weight.dim() == 1 and weight.numel() == x.shape[1] and weight.is_contiguous()):
            raise ValueError(
                f"rms: bad operands {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
            )
        y = torch.empty_like(x)
        fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    def silu_mul(self, gu: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """silu(gu[:, :I]) * gu[:, I:] of gu (M, 2 I), fp32 or bf16 (computed in fp32, rounded once); `gelu`:
        Gemma's GELU (tanh approximation) for SiLU."""
        if not (gu.dtype in self._silu_mul and gu.dim() == 2 and gu.is_contiguous() and gu.shape[1] % 2 == 0):
            raise ValueError(f"silu_mul: bad operand {tuple(gu.shape)} {gu.dtype}")
        M, I = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(M, I, dtype=gu.dtype)
        (self._gelu_mul if gelu else self._silu_mul)[gu.dtype](gu.data_ptr(), out.data_ptr(), M, I)
        return out

    def lora(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        slot: torch.Tensor,
        y: torch.Tensor,
        cols: torch.Tensor,
        ranks: torch.Tensor,
    ) -> None:
        """y (M, N) += each row's LoRA terms, in place: row m of x (M, K) through adapter slot[m] (int32;
        < 0: none) of a (S, R, K) and bt (S, R, N) (B transposed), segment g being columns
        cols[g]..cols[g + 1] of y and ranks ranks[g]..ranks[g + 1] (int64, nseg + 1 each). One dtype,
        fp32 or bf16."""
        M, K = x.shape
        S, R, _ = a.shape
        N = y.shape[1]
        b = bt
        if not (
            x.dtype in self._lora
            and a.dtype == b.dtype == y.dtype == x.dtype
            and a.shape == (S, R, K)
            and b.shape == (S, R, N)
            and y.shape == (M, N)
            and slot.shape == (M,)
            and slot.dtype == torch.int32
            and cols.dtype == ranks.dtype == torch.int64
            and cols.shape == ranks.shape
            and all(t.is_contiguous() for t in (x, a, b, slot, y, cols, ranks))
        ):
            raise ValueError(
                f"lora: bad operands x {tuple(x.shape)} {x.dtype}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                f"y {tuple(y.shape)} {y.dtype}, slot {tuple(slot.shape)} {slot.dtype}"
            )
        scratch = self._scratch_of(LORA_ROWS * (R + N) + 2 * M)  # + M int64 row indices
        rc = self._lora[x.dtype](
            x.data_ptr(), a.data_ptr(), b.data_ptr(), slot.data_ptr(), y.data_ptr(),
            M, K, N, R, S, cols.shape[0] - 1, cols.data_ptr(), ranks.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        if rc:
            raise ValueError(f"lora: an adapter slot outside [0, {S}) in {slot.tolist()}")

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: torch.Tensor,
        pos: torch.Tensor,
        row0: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of q (B, Hkv, G, D) fp32, sequence b (table row row0 + b) over its positions
        [0, pos[b]] (the last `window` of them, where given; scores capped at `softcap` by tanh, where
        given); returns (B, Hkv, G, D) fp32."""
        B, Hkv, G, D = q.shape
        nblocks, kv_heads, bs, head_dim = k.shape
        rows, W = table.shape
        if not (
            q.dtype == torch.float32
            and q.is_contiguous()
            and k.dtype in self._fns
            and (kv_heads, head_dim) == (Hkv, D)
            and _paged(k, v, table)
            and pos.dtype == torch.int64
            and pos.is_contiguous()
            and pos.shape == (B,)
        ):
            raise ValueError(
                f"decode_attn: bad operands q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} "
                f"{k.dtype}, table {tuple(table.shape)} {table.dtype}, pos {tuple(pos.shape)} {pos.dtype}"
            )
        scratch = self._scratch_of(G * W * bs)
        out = torch.empty_like(q)
        rc = self._fns[k.dtype](
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            table.data_ptr(),
            pos.data_ptr(),
            out.data_ptr(),
            B,
            Hkv,
            G,
            D,
            row0,
            rows,
            W,
            bs,
            nblocks,
            scale,
            scratch.data_ptr(),
            window or 0,
            softcap or 0.0,
        )
        if rc:
            raise ValueError(f"decode_attn: {_WHY[rc]} (rows {row0}..{row0 + B}, positions {pos.tolist()})")
        return out

    def layer(
        self,
        qkv: torch.Tensor,
        cos_sin: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        table: torch.Tensor,
        row: torch.Tensor,
        pos: torch.Tensor,
        G: int,
        scale: float,
        qk_norm: torch.Tensor | None = None,
        eps: float = 0.0,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One layer's attention block after the q/k/v projection: token t of qkv (M, (H + 2 Hkv) D)
        rotated by RoPE (cos_sin (>= W block_size, 2, R), the backend's table: the first R dims of each
        head rotate, R = D but for a partial rotary, Phi-4-mini's), its k and v written into
        the cache at position pos[t] of the sequence in table row row[t], its q attended over that
        sequence's positions [0, pos[t]] (a prefill piece: one row's tokens in increasing positions,
        causal; the last `window` positions only, where given; scores capped at `softcap` by tanh, where
        given); returns o (M, H D). One dtype, fp32 or bf16.
        `qk_norm`: Qwen3's q and k norm weights (H + Hkv, D), applied with `eps` to each head's q and k
        before RoPE, as `weights.norm_qk` (Gemma 3's, fp32 1 + w in a bf16 layer: scaled in fp32, rounded
        once)."""
        M, Wq = qkv.shape
        nblocks, Hkv, bs, D = k.shape
        rows, W = table.shape
        dt = qkv.dtype
        if not (
            dt in self._layer
            and cos_sin.dtype == k.dtype == dt
            and _paged(k, v, table)
            and qkv.is_contiguous()
            and cos_sin.is_contiguous()
            and Wq == (G + 2) * Hkv * D
            and cos_sin.shape[0] >= W * bs
            and cos_sin.shape[1] == 2
            and 2 <= cos_sin.shape[2] <= D
            and pos.shape == row.shape == (M,)
            and pos.dtype == row.dtype == torch.int64
            and pos.is_contiguous()
            and row.is_contiguous()
            and (
                qk_norm is None
                or (
                    qk_norm.dtype in (dt, torch.float32)
                    and qk_norm.is_contiguous()
                    and qk_norm.shape == ((G + 1) * Hkv, D)
                )
            )
        ):
            raise ValueError(
                f"decode_layer: bad operands qkv {tuple(qkv.shape)} {dt}, k {tuple(k.shape)} "
                f"{k.dtype}, table {tuple(table.shape)} {table.dtype}, cos_sin {tuple(cos_sin.shape)} "
                f"{cos_sin.dtype}, G {G}, pos {tuple(pos.shape)} {pos.dtype}, row {tuple(row.shape)} {row.dtype}"
                + ("" if qk_norm is None else f", qk_norm {tuple(qk_norm.shape)} {qk_norm.dtype}")
            )
        scratch = self._scratch_of(G * W * bs + 2 * G * D)
        out = torch.empty(M, G * Hkv * D, dtype=dt)
        w32 = qk_norm is not None and qk_norm.dtype != dt  # Gemma 3's fp32 1 + w in a bf16 layer
        rc = (self._layer_w32 if w32 else self._layer[dt])(
            qkv.data_ptr(),
            cos_sin.data_ptr(),
            table.data_ptr(),
            row.data_ptr(),
            pos.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            M,
            rows,
            W,
            Hkv,
            G,
            D,
            bs,
            nblocks,
            scale,
            scratch.data_ptr(),
            None if qk_norm is None else qk_norm.data_ptr(),
            eps,
            cos_sin.shape[2],
            window or 0,
            softcap or 0.0,
        )
        if rc:
            raise ValueError(f"decode_layer: {_WHY[rc]} (rows {row.tolist()}, positions {pos.tolist()})")
        return out


_WHY = {
    -1: "head_dim > 256 or odd, or a rotary width odd or past it",
    -2: "a position outside the block table",
    -3: "a row outside the block table",
    -4: "a block outside the cache",
    -5: "an adapter slot outside the adapters",
}


def _panel_shape(n: int, k: int, pairs: bool) -> tuple[int, ...]:
    """A packed (n, k) weight's shape: 48-column panels, k in pairs (bf16, int8) or single (fp32)."""
    panels = -(-n // GEMM_PANEL)
    return (panels, k // 2, GEMM_PANEL, 2) if pairs else (panels, k, GEMM_PANEL)


def _panels(w: torch.Tensor, pairs: bool) -> torch.Tensor:
    """w (N, K) in `_panel_shape`'s layout, the columns past N zero."""
    n, k = w.shape
    shape = _panel_shape(n, k, pairs)
    w = torch.nn.functional.pad(w, (0, 0, 0, shape[0] * GEMM_PANEL - n))
    split = (k // 2, 2) if pairs else (k,)
    return w.view(shape[0], GEMM_PANEL, *split).transpose(1, 2).contiguous()


def _bias_residual_ok(
    b: torch.Tensor | None, r: torch.Tensor | None, m: int, n: int, dt: torch.dtype
) -> bool:
    """A GEMM's optional bias (fp32, (n,)) and residual (`dt`, (m, n)), contiguous."""
    return (b is None or (b.dtype == torch.float32 and b.shape == (n,) and b.is_contiguous())) and (
        r is None or (r.dtype == dt and r.shape == (m, n) and r.is_contiguous())
    )


def _paged(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> bool:
    """k, v one contiguous paged cache (4-D, as the caller unpacked k); table int32, contiguous (2-D,
    as the caller unpacked it)."""
    return (
        k.shape == v.shape
        and k.dtype == v.dtype
        and table.dtype == torch.int32
        and k.is_contiguous()
        and v.is_contiguous()
        and table.is_contiguous()
    )


def _build_key(cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"no C compiler {cc!r} ({e}); set CC to one") from e
    cpu = platform.machine()
    try:
        cpu += next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), ""
        )
    except OSError:
        pass
    h = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in SOURCES),
        " ".join(FLAGS).encode(),
        version.encode(),
        cpu.encode(),
    ):
        h.update(part)
    return h.hexdigest()[:16]


def _build() -> Path:
    cc = os.environ.get("CC", "cc")
    out = cache_root() / "kernels" / f"decode-{_build_key(cc)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(
                f"{cc} failed on {' '.join(f.name for f in SOURCES)}: {r.stderr.strip()[-500:]}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> Kernels | None:
    """The kernel, built on first use in this process; None where it cannot be built (see `unavailable`)."""
    with _lock:
        if "kernel" not in _state:
            try:
                _state["kernel"] = Kernels(ctypes.CDLL(str(_build())))
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                _state["kernel"], _state["why"] = None, str(e)
        return _state["kernel"]  # type: ignore[return-value]


def unavailable() -> str | None:
    """Why `load()` returned None (None when it did not)."""
    load()
    return _state.get("why")  # type: ignore[return-value]
