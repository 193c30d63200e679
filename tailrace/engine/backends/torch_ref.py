"""`TorchBackend`: the reference backend, one engine step of one version in torch ops; runs wherever
torch does (CUDA, CPU with several threads, CPU without a C compiler).

The B decode rows (one token each) and the prefill pieces (prompt chunks, causal within the piece)
are one (M, hidden) batch through every GEMM (`FusedWeights`): one pass over the weights per step, no
padding. Per layer:
  * RoPE on q and k in one op set, looked up in a table built by `tailrace.model.rope` (the model's own
    table function, so positions rotate identically); the k/v writes are index copies;
  * decode attention of one query per row over a contiguous slice of cache rows (a view), chunk by
    chunk (`engine.chunks`), with additive masks built once per step. `variant`, chosen once:
    'bmm': two batched GEMMs per chunk, in fp32 whenever the cache is fp32 (fp32 MKL reads the
    strided cache views in place); with a bf16/fp16 cache (bf16 bmm copies them) the scores GEMM runs
    as K @ q^T with an fp32 softmax, and up to `UPCAST_MAX_BATCH` rows on fp32 upcast copies, whichever
    is faster at that batch (bench/README.md); 'sdpa': `F.scaled_dot_product_attention` in the
    cache's dtype;
  * prefill pieces attend causally to their row's cache, in fp32.
The attended lengths come from the host, so the step needs no device->host sync. Supports exactly
what `CausalLM` supports (Llama/Qwen2 biases, every RoPE type via the table); tests pin it to the
logits of `CausalLM.forward` over whole sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tailrace.engine.backends.weights import FusedWeights
from tailrace.engine.chunks import Chunk
from tailrace.engine.ckernel import Kernels
from tailrace.engine.kv_cache import KVCache
from tailrace.model.decoder import CausalLM
from tailrace.model.rope import inv_freq_and_scale, rope_table

UPCAST_MAX_BATCH = 8  # bf16/fp16 decode attention of at most this many rows runs on fp32 copies
Span = tuple[int, int, int]  # (row, start, n): a prefill piece's n tokens at positions start.. of a row


class TorchBackend:
    kernel: Kernels | None = None  # no C kernels: the sampler runs on torch ops too

    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        kv_dtype: torch.dtype,
        variant: str = "bmm",
        packed: bool | None = None,
    ):
        """`model` on its device, in its dtype; `max_len`, `kv_dtype`: the cache's positions and dtype;
        `variant`: decode attention, 'bmm' or 'sdpa'; `packed`: see `FusedWeights`."""
        if variant not in ("bmm", "sdpa"):
            raise ValueError(f"variant={variant!r}: use 'bmm' or 'sdpa'")
        self.name, self.model, self.kv_dtype = variant, model, kv_dtype
        self.w = w = FusedWeights(model, packed)
        inv_freq, scale = inv_freq_and_scale(model.config)
        cos, sin = rope_table(inv_freq, scale, max_len)  # (max_len, D) fp32, sin first half negated
        # As the model: its table follows the module's dtype, so bf16 models rotate in bf16.
        self.cos_sin = torch.stack((cos, sin), dim=1).to(w.device, w.dtype)  # (max_len, 2, D)
        self.arange = torch.arange(max_len, device=w.device)
        self.heads = torch.arange(w.Hkv, device=w.device)
        self._write_base: dict[tuple[int, int, int], torch.Tensor] = {}
        # decode attention: its per-step state (from the decode rows' positions) and its per-layer call
        if variant == "sdpa":
            self._decode_state, self._attend_decode = self._sdpa_masks, self._attend_sdpa
        elif kv_dtype == torch.float32:  # fp32 attention (an fp32 cache may serve a bf16 model)
            self._decode_state, self._attend_decode = self._bmm_masks, self._attend_fp32
        else:
            self._decode_state, self._attend_decode = self._bmm_masks, self._attend_low

    def refresh(self) -> None:
        self.w.refresh()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: slice,
        chunks: list[Chunk],
        pieces: Sequence[Span] = (),
        want: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See `Backend.forward`."""
        B, M = rows.stop - rows.start, tokens.shape[0]
        x = F.embedding(tokens, self.w.embed)  # (M, hidden)
        x = self._layers(x, positions, cache, rows, chunks, pieces, self.w.packed_at(M))
        if want is not None:
            x = x.index_select(0, want)
        elif M > B:
            x = x[:B]
        return self.w.lm_head(self._rms(x), self.w.packed_at(x.shape[0]))

    def _layers(self, x, positions, cache, rows, chunks, pieces, pk: bool) -> torch.Tensor:
        """The layers over x (M, hidden), `pk`: GEMMs on packed weights."""
        w = self.w
        B, M = rows.stop - rows.start, x.shape[0]
        H, Hkv, D = w.H, w.Hkv, w.D
        L = cache.max_len
        widx = self._write_index(rows, L) + positions[:B].repeat_interleave(
            Hkv
        )  # (B Hkv,) into k.view(-1, D)
        if pieces:
            pre = (self._piece_rows(pieces)[:, None] * Hkv + self.heads) * L + positions[B:, None]
            widx = torch.cat((widx, pre.reshape(-1)))
        cs = self.cos_sin[positions]  # (M, 2, D)
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # (M, 1, D)
        dec = self._decode_state(positions[:B], chunks)  # built once per step, read by every layer
        causal = []  # per prefill piece, its causal mask (1, n G, start + n) fp32
        for _, start, n in pieces:
            m = torch.where(
                self.arange[: start + n] > self.arange[start : start + n, None], float("-inf"), 0.0
            )
            causal.append(m.repeat_interleave(w.G, dim=0)[None])
        half = D // 2
        for i, lw in enumerate(w.layers):
            qkv = lw.qkv(self._rms(x), pk)  # (M, (H + 2 Hkv) D)
            qk = qkv[:, : (H + Hkv) * D].view(M, H + Hkv, D)
            qk = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)
            ck, cv = cache.k[i], cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, qk[:, H:].reshape(M * Hkv, D).to(ck.dtype))
            cv.view(-1, D).index_copy_(0, widx, qkv[:, (H + Hkv) * D :].reshape(M * Hkv, D).to(cv.dtype))
            outs = [self._attend_decode(qk[:B, :H], ck, cv, rows.start, chunks, dec)] if B else []
            off = B
            for (row, start, n), m in zip(pieces, causal):
                q = qk[off : off + n, :H]
                outs.append(self._attend_piece(q, ck[row, :, : start + n], cv[row, :, : start + n], m))
                off += n
            x = lw.o.add(_cat(outs), x, pk)
            x = lw.down.add(self._silu_mul(lw.gate_up(self._rms(x), pk)), x, pk)
        return x

    # -- decode attention: q (B, H, D) over cache rows r0 + [lo, hi) up to S per chunk (views of the
    # -- cache); returns (B, H D) in the model's dtype

    def _bmm_masks(self, pos: torch.Tensor, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Per chunk, the additive fp32 mask ((hi - lo) Hkv, 1, S) hiding positions past each row's own
        (broadcast over the G query heads of a kv head)."""
        out = []
        for lo, hi, S in chunks:
            m = torch.where(self.arange[:S] > pos[lo:hi, None], float("-inf"), 0.0)  # (n, S)
            out.append(m.repeat_interleave(self.w.Hkv, dim=0).view((hi - lo) * self.w.Hkv, 1, S))
        return out

    def _sdpa_masks(self, pos: torch.Tensor, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Per chunk, the additive mask (hi - lo, 1, 1, S) in the cache's dtype."""
        return [
            torch.where(self.arange[:S] > pos[lo:hi, None], float("-inf"), 0.0)
            .to(self.kv_dtype)
            .view(hi - lo, 1, 1, S)
            for lo, hi, S in chunks
        ]

    def _attend_fp32(self, q, ck, cv, r0, chunks, masks, upcast: bool = False) -> torch.Tensor:
        """fp32 GEMMs on the cache views (`upcast`: on fp32 copies of a low-precision cache's)."""
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.reshape(B * Hkv, G, D).float()
        outs = []
        for (lo, hi, S), m in zip(chunks, masks):
            n = hi - lo
            k3 = ck[r0 + lo : r0 + hi, :, :S].reshape(n * Hkv, S, D)  # views
            v3 = cv[r0 + lo : r0 + hi, :, :S].reshape(n * Hkv, S, D)
            if upcast:
                k3, v3 = k3.float(), v3.float()
            s = torch.baddbmm(
                m, q[lo * Hkv : hi * Hkv], k3.transpose(1, 2), alpha=self.w.scale
            )  # (n Hkv, G, S)
            outs.append(torch.bmm(torch.softmax(s, dim=-1), v3))
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_low(self, q, ck, cv, r0, chunks, masks) -> torch.Tensor:
        """A bf16/fp16 cache: small batches as `_attend_fp32` on upcast copies; larger ones in the cache's
        dtype, the scores as K @ q^T (the faster order for strided low-precision views), fp32 softmax."""
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        if B <= UPCAST_MAX_BATCH:
            return self._attend_fp32(q, ck, cv, r0, chunks, masks, upcast=True)
        q = q.reshape(B * Hkv, G, D)
        outs = []
        for (lo, hi, S), m in zip(chunks, masks):
            n = hi - lo
            k3 = ck[r0 + lo : r0 + hi, :, :S].reshape(n * Hkv, S, D)  # views
            v3 = cv[r0 + lo : r0 + hi, :, :S].reshape(n * Hkv, S, D)
            s = torch.add(
                m, torch.bmm(k3, q[lo * Hkv : hi * Hkv].transpose(1, 2)).transpose(1, 2), alpha=self.w.scale
            )
            outs.append(torch.bmm(torch.softmax(s, dim=-1).to(self.w.dtype), v3))
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_sdpa(self, q, ck, cv, r0, chunks, masks) -> torch.Tensor:
        B, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.view(B, Hkv, G, D).to(ck.dtype)  # GQA: the query heads of one kv head -> G queries
        outs = [
            F.scaled_dot_product_attention(
                q[lo:hi],
                ck[r0 + lo : r0 + hi, :, :S],
                cv[r0 + lo : r0 + hi, :, :S],
                attn_mask=m,
                scale=self.w.scale,
            )
            for (lo, hi, S), m in zip(chunks, masks)
        ]
        return _cat(outs).reshape(B, self.w.H * D).to(self.w.dtype)

    def _attend_piece(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of one prefill piece, in fp32: q (n, H, D); k, v (Hkv, S, D) cache views;
        mask (1, n G, S). Returns (n, H D) in the model dtype."""
        n, Hkv, G, D = q.shape[0], self.w.Hkv, self.w.G, self.w.D
        q = q.reshape(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D).float()  # rows ordered (n, G)
        s = torch.baddbmm(mask, q, k.float().transpose(1, 2), alpha=self.w.scale)  # (Hkv, n G, S)
        o = torch.bmm(torch.softmax(s, dim=-1), v.float())  # (Hkv, n G, D)
        return o.view(Hkv, n, G * D).transpose(0, 1).reshape(n, Hkv * G * D).to(self.w.dtype)

    # -- the rest of a layer

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next GEMM), normalized in fp32 and rounded once
        (for bf16 as the model's x.float() ... .to(bf16))."""
        return F.rms_norm(x, (x.shape[-1],), eps=self.w.eps)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up projection's output (M, 2 I)."""
        return F.silu(gu[:, : self.w.I]).mul_(gu[:, self.w.I :])

    def _write_index(self, rows: slice, L: int) -> torch.Tensor:
        """(B Hkv,) flat index of position 0 of each (row, kv head) in cache.k[l].view(-1, D); cached."""
        key = (rows.start, rows.stop, L)
        base = self._write_base.get(key)
        if base is None:
            if len(self._write_base) > 1024:
                self._write_base.clear()
            r = torch.arange(rows.start, rows.stop, device=self.w.device)
            base = ((r[:, None] * self.w.Hkv + self.heads) * L).reshape(-1)
            self._write_base[key] = base
        return base

    def _piece_rows(self, pieces: Sequence[Span]) -> torch.Tensor:
        """(tokens,) the cache row of each prefill piece's tokens, in order."""
        return torch.tensor([r for r, _, n in pieces for _ in range(n)], device=self.w.device)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
