"""`Runner`: one engine step of one model version -- decode rows and prefill pieces in one forward.

`CausalLM.forward` is the reference (tests pin this runner to its logits and cache writes); the
engine's steps run here, over the same weights and the same KV cache layout, built for speed:
  * the decode rows (one token each) and the prefill pieces (prompt chunks, causal within the piece)
    are one (M, hidden) batch through every GEMM: one pass over the weights per step, no padding;
  * q/k/v and gate/up projections fused into one GEMM each (fused copies of the weights, rebuilt by
    `refresh` after a weight load), residual adds folded into `addmm`; each RMSNorm weight is folded
    into the columns of the projection that follows it ((x*w) W^T = x (W diag w)^T; in bf16 this
    rounds W*w instead of x*w, a difference of the size of bf16 rounding itself);
  * on CPU, the C kernels of `ckernel` (kernels/decode.c): per layer one call does RoPE, both cache
    writes and attention for every token of the step (decode rows and prefill pieces; each row reads
    its own K/V exactly to its own length, in place, in fp32 arithmetic for fp32 and bf16 caches), and
    RMSNorm and SiLU-and-multiply are C calls too (measured 1.6-2.9x the engine on torch ops, see
    bench/README.md). Used by default with one torch thread (the kernels are single-threaded; the GEMMs
    use every thread), where they build, for head_dim <= 256. An fp32 cache serving a bf16 model keeps
    torch's RoPE and cache writes and uses the kernel's attention alone ('kernel' mode below);
  * otherwise RoPE is applied to q and k in one op set, looked up in a table built by
    `tailrace.model.rope` (the model's own table function, so positions rotate identically; the C call
    reads the same table), and the k/v writes are index copies;
  * and there (CUDA, several threads, attention='bmm') attention of one query per sequence over a
    contiguous slice of cache rows (a view) as two batched GEMMs per layer with an additive mask
    built once per step, in fp32 whenever the cache is fp32
    (fp32 MKL reads the strided cache views in place). With a bf16/fp16 cache (bf16 bmm copies them)
    the scores GEMM runs as K @ q^T (~2x faster than q @ K^T there) with an fp32 softmax, and at
    batch <= 8 on fp32 upcast copies (faster there);
  * the attended lengths come from the host, so the step needs no device->host sync.
Supports exactly what `CausalLM` supports (Llama/Qwen2 biases, every RoPE type via the table); tests
pin it to `CausalLM.forward` logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrace.engine import ckernel
from tailrace.engine.linear import Linear, packing_supported
from tailrace.model.decoder import CausalLM
from tailrace.model.kv_cache import KVCache
from tailrace.model.rope import inv_freq_and_scale, rope_table

# bf16/fp16 attention at small batches: fp32 GEMMs on upcast copies beat bf16 bmm (measured ~20% of
# the step at batch 1-4, even at batch 8, worse above).
_UPCAST_MAX_BATCH = 8


class _Layer:
    __slots__ = ("qkv", "o", "gate_up", "down")


class Runner:
    def __init__(
        self, model: CausalLM, max_len: int, attention: str | None = None, packed: bool | None = None
    ):
        """`attention`: 'kernel', 'bmm' or 'sdpa'; None = 'kernel' where it applies (see above), else 'bmm'.
        `packed`: oneDNN packed weights (see `linear.py`); None = wherever supported."""
        cfg = model.config
        self.model = model
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.Hkv
        self.I = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.D**-0.5
        w = model.model.embed_tokens.weight
        self.dtype, self.device = w.dtype, w.device
        self.kernel = None
        if (
            attention in (None, "kernel")
            and self.device.type == "cpu"
            and self.D <= ckernel.MAX_HEAD_DIM
            and (attention == "kernel" or torch.get_num_threads() == 1)
        ):
            self.kernel = ckernel.load()
            if self.kernel is None and attention == "kernel":
                raise RuntimeError(f"attention='kernel': {ckernel.unavailable()}; or use attention='bmm'")
        if attention in (None, "kernel"):
            attention = "kernel" if self.kernel is not None else "bmm"
        if attention not in ("kernel", "bmm", "sdpa"):
            raise ValueError(f"attention={attention!r}: use 'kernel', 'bmm' or 'sdpa'")
        self.attention = attention
        self.packed = packing_supported(self.dtype) if packed is None else packed
        if self.device.type != "cpu":
            self.packed = False
        # fp32 packed GEMMs lose to MKL below ~48 rows (measured on the default model: 1.7x slower at 2-4,
        # 1.3x at 16, even at 32-64); bf16 ones win at every batch (0.8-0.9x)
        self.packed_min_batch = 48 if self.dtype == torch.float32 else 1
        inv_freq, scale = inv_freq_and_scale(cfg)
        cos, sin = rope_table(inv_freq, scale, max_len)  # (max_len, D) fp32, sin first half negated
        # As the model: its table follows the module's dtype, so bf16 models rotate in bf16.
        self.cos_sin = torch.stack((cos, sin), dim=1).to(self.device, self.dtype)  # (max_len, 2, D)
        self.arange = torch.arange(max_len, device=self.device)
        self.heads = torch.arange(self.Hkv, device=self.device)
        self._write_base: dict[tuple[int, int, int], torch.Tensor] = {}
        self._rows_cache: dict[tuple[int, int], torch.Tensor] = {}
        self.refresh()

    @torch.inference_mode()
    def refresh(self) -> None:
        """(Re)build the fused weights from the model's current parameters."""
        m = self.model.model

        pk = self.packed

        def proj(norm_w, ws, bs=None):  # one GEMM for the projections that read one RMSNorm's output
            w = torch.cat(ws)
            b = torch.cat(bs) if bs and bs[0] is not None else None
            return Linear(w * norm_w, b, pk)

        self.embed = m.embed_tokens.weight
        self.lm_head = proj(m.norm.weight, [self.model.lm_head.weight])
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            L = _Layer()
            L.qkv = proj(
                layer.input_layernorm.weight,
                [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
            )
            L.o = Linear(a.o_proj.weight, a.o_proj.bias, pk)
            L.gate_up = proj(
                layer.post_attention_layernorm.weight, [mlp.gate_proj.weight, mlp.up_proj.weight]
            )
            L.down = Linear(mlp.down_proj.weight, None, pk)
            self.layers.append(L)

    def _write_index(self, rows: slice, L: int) -> torch.Tensor:
        """(B Hkv,) flat index of position 0 of each (row, kv head) in cache.k[l].view(-1, D); cached."""
        key = (rows.start, rows.stop, L)
        base = self._write_base.get(key)
        if base is None:
            if len(self._write_base) > 1024:
                self._write_base.clear()
            r = torch.arange(rows.start, rows.stop, device=self.device)
            base = ((r[:, None] * self.Hkv + torch.arange(self.Hkv, device=self.device)) * L).reshape(-1)
            self._write_base[key] = base
        return base

    def _attend(
        self, qk: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, r0: int, chunks, masks, mode: str
    ) -> torch.Tensor:
        """Attention of qk[:, :H] (B, H, D) over cache rows r0 + [lo, hi) up to S, chunk by chunk;
        the cache slices are views. Returns (B, H D) in the model dtype."""
        B, H, Hkv, G, D = qk.shape[0], self.H, self.Hkv, self.G, self.D
        if mode == "sdpa":
            q = qk[:, :H].view(B, Hkv, G, D).to(ck.dtype)  # GQA: the query heads of one kv head -> G queries
        else:
            q = qk[:, :H].reshape(B * Hkv, G, D)
            if mode != "bmm16":
                q = q.float()
        outs = []
        for (lo, hi, S), m in zip(chunks, masks):
            kk, vv = ck[r0 + lo : r0 + hi, :, :S], cv[r0 + lo : r0 + hi, :, :S]  # (n, Hkv, S, D) views
            if mode == "sdpa":
                outs.append(F.scaled_dot_product_attention(q[lo:hi], kk, vv, attn_mask=m, scale=self.scale))
                continue
            n = hi - lo
            k3, v3 = kk.reshape(n * Hkv, S, D), vv.reshape(n * Hkv, S, D)  # views
            qc = q[lo * Hkv : hi * Hkv]
            if mode == "bmm16":  # K @ q^T, fp32 softmax
                s = torch.add(m, torch.bmm(k3, qc.transpose(1, 2)).transpose(1, 2), alpha=self.scale)
                outs.append(torch.bmm(torch.softmax(s, dim=-1).to(self.dtype), v3))
            else:  # "bmm" (fp32) or "up" (fp32 on upcast copies)
                if mode == "up":
                    k3, v3 = k3.float(), v3.float()
                s = torch.baddbmm(m, qc, k3.transpose(1, 2), alpha=self.scale)  # (n Hkv, G, S)
                outs.append(torch.bmm(torch.softmax(s, dim=-1), v3))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return o.reshape(B, H * D).to(self.dtype)

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next GEMM), normalized in fp32 and rounded once
        (for bf16 as the model's x.float() ... .to(bf16)); by the C kernel where it is loaded (each torch
        op costs more to dispatch than to compute at decode sizes)."""
        if self.kernel is not None and x.dtype in self.kernel.dtypes:
            return self.kernel.rms(x.contiguous(), self.eps)
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up projection's output (M, 2 I)."""
        if self.kernel is not None and gu.dtype in self.kernel.dtypes:
            return self.kernel.silu_mul(gu)
        return F.silu(gu[:, : self.I]).mul_(gu[:, self.I :])

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: slice,
        chunks: list[tuple[int, int, int]] | int,
    ) -> torch.Tensor:
        """Decode only: see `forward`. An int `chunks` S = one chunk over all rows."""
        if isinstance(chunks, int):
            chunks = [(0, tokens.shape[0], chunks)]
        return self.forward(tokens, positions, cache, rows, chunks)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: slice,
        chunks: list[tuple[int, int, int]],
        pieces: list[tuple[int, int, int]] = (),
        want: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step over M tokens: B = len(rows) decode tokens first, then prefill pieces.

        tokens, positions (M,) int64 on device. Decode token b sits in cache row rows.start + b;
        `chunks`: (lo, hi, S) per attention chunk of the decode rows (rows [lo, hi) attend to
        positions [0, S), S > their positions; see `engine.chunks`). `pieces`: (row, start, n) per
        prefill piece, its n tokens (next in `tokens`) at positions start.. of that row, attending
        causally to the row's cache. Every token's k/v is written at its position first. Returns
        logits (len(want), V) of the tokens `want` indexes (default: the B decode tokens)."""
        B, M = rows.stop - rows.start, tokens.shape[0]
        if self.attention == "kernel" and cache.dtype == self.dtype and self.dtype in self.kernel.dtypes:
            mode = "fused"
        elif self.attention == "kernel" and cache.dtype in self.kernel.dtypes:
            mode = "kernel"
        elif self.attention == "sdpa":
            mode = "sdpa"
        elif cache.dtype == torch.float32:  # fp32 attention (an fp32 cache may serve a bf16 model)
            mode = "bmm"
        else:
            mode = "up" if B <= _UPCAST_MAX_BATCH else "bmm16"
        pk = self.packed and M >= self.packed_min_batch
        x = F.embedding(tokens, self.embed)  # (M, hidden)
        if mode == "fused":  # every token: RoPE, cache writes and attention in one C call per layer
            trow = self._token_rows(rows, pieces)
            pos = positions.contiguous()
            for i, lw in enumerate(self.layers):
                qkv = lw.qkv(self._rms(x), pk)
                o = self.kernel.layer(
                    qkv, self.cos_sin, cache.k[i], cache.v[i], trow, pos, self.G, self.scale
                )
                x = lw.o.add(o, x, pk)
                x = lw.down.add(self._silu_mul(lw.gate_up(self._rms(x), pk)), x, pk)
        else:
            x = self._layers_torch(x, positions, cache, rows, chunks, pieces, mode, pk)
        if want is not None:
            x = x.index_select(0, want)
        elif M > B:
            x = x[:B]
        return self.lm_head(self._rms(x), pk and x.shape[0] >= self.packed_min_batch)

    def _layers_torch(self, x, positions, cache, rows, chunks, pieces, mode, pk) -> torch.Tensor:
        """The layers with RoPE, cache writes and attention as torch ops (and the unfused kernel)."""
        B, M = rows.stop - rows.start, x.shape[0]
        H, Hkv, D = self.H, self.Hkv, self.D
        L = cache.max_len
        widx = self._write_index(rows, L) + positions[:B].repeat_interleave(
            Hkv
        )  # (B Hkv,) into k.view(-1, D)
        if pieces:
            pre = ((self._piece_rows(pieces)[:, None] * Hkv + self.heads) * L + positions[B:, None]).reshape(
                -1
            )
            widx = torch.cat((widx, pre))
        cs = self.cos_sin[positions]  # (M, 2, D)
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # (M, 1, D)
        masks = []  # per decode chunk, additive fp32 (bmm) or cache-dtype (sdpa) mask, built once per step
        kpos = positions[:B].contiguous() if mode == "kernel" else None  # each decode row's last position
        for lo, hi, S in chunks if mode != "kernel" else ():
            m = torch.where(self.arange[:S] > positions[lo:hi, None], float("-inf"), 0.0)  # (n, S)
            if mode == "sdpa":
                masks.append(m.to(cache.dtype).view(hi - lo, 1, 1, S))
            else:
                masks.append(m.repeat_interleave(Hkv, dim=0).view((hi - lo) * Hkv, 1, S))  # broadcast over G
        causal = []  # per prefill piece, its causal mask (1, n G, start + n) fp32
        for _, start, n in pieces:
            m = torch.where(
                self.arange[: start + n] > self.arange[start : start + n, None], float("-inf"), 0.0
            )
            causal.append(m.repeat_interleave(self.G, dim=0)[None])
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(self._rms(x), pk)  # (M, (H + 2 Hkv) D)
            qk = qkv[:, : (H + Hkv) * D].view(M, H + Hkv, D)
            half = D // 2
            qk = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)
            ck, cv = cache.k[i], cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, qk[:, H:].reshape(M * Hkv, D).to(ck.dtype))
            cv.view(-1, D).index_copy_(0, widx, qkv[:, (H + Hkv) * D :].reshape(M * Hkv, D).to(cv.dtype))
            if not B:
                outs = []
            elif mode == "kernel":
                q = qk[:B, :H].float().contiguous().view(B, Hkv, self.G, D)
                o = self.kernel.run(q, ck, cv, kpos, rows.start, self.scale)  # (B, Hkv, G, D) fp32
                outs = [o.view(B, H * D).to(self.dtype)]
            else:
                outs = [self._attend(qk[:B], ck, cv, rows.start, chunks, masks, mode)]  # (B, H D)
            off = B
            for (row, start, n), m in zip(pieces, causal):
                outs.append(
                    self._attend_piece(
                        qk[off : off + n, :H], ck[row, :, : start + n], cv[row, :, : start + n], m
                    )
                )
                off += n
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = lw.o.add(o, x, pk)
            x = lw.down.add(self._silu_mul(lw.gate_up(self._rms(x), pk)), x, pk)
        return x

    def _token_rows(self, rows: slice, pieces) -> torch.Tensor:
        """(M,) cache row of each token: the decode rows, then each prefill piece's row n times."""
        key = (rows.start, rows.stop)
        base = self._rows_cache.get(key)
        if base is None:
            if len(self._rows_cache) > 1024:
                self._rows_cache.clear()
            base = self._rows_cache[key] = torch.arange(rows.start, rows.stop, device=self.device)
        return torch.cat((base, self._piece_rows(pieces))) if pieces else base

    def _piece_rows(self, pieces) -> torch.Tensor:
        """(tokens,) the cache row of each prefill piece's tokens, in order."""
        return torch.tensor([r for r, _, n in pieces for _ in range(n)], device=self.device)

    def _attend_piece(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of one prefill piece, in fp32: q (n, H, D); k, v (Hkv, S, D) cache views;
        mask (1, n G, S). Returns (n, H D) in the model dtype."""
        n, Hkv, G, D = q.shape[0], self.Hkv, self.G, self.D
        q = q.reshape(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D).float()  # rows ordered (n, G)
        s = torch.baddbmm(mask, q, k.float().transpose(1, 2), alpha=self.scale)  # (Hkv, n G, S)
        o = torch.bmm(torch.softmax(s, dim=-1), v.float())  # (Hkv, n G, D)
        return o.view(Hkv, n, G * D).transpose(0, 1).reshape(n, Hkv * G * D).to(self.dtype)
