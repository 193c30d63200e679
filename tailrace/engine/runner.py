"""`DecodeRunner`: the decode step (one new token per sequence) of one model version, fast.

`CausalLM.forward` is the reference and serves prefill; decode, which runs every step on every live
sequence, gets this dedicated path over the same weights and the same KV cache layout:
  * q/k/v and gate/up projections fused into one GEMM each (fused copies of the weights, rebuilt by
    `refresh` after a weight load), residual adds folded into `addmm`; each RMSNorm weight is folded
    into the columns of the projection that follows it ((x*w) W^T = x (W diag w)^T; in bf16 this
    rounds W*w instead of x*w, a difference of the size of bf16 rounding itself);
  * RoPE applied to q and k in one op set, looked up in a table built by `tailrace.model.rope` (the
    model's own table function, so positions rotate identically);
  * attention of one query per sequence over a contiguous slice of cache rows (a view) as two batched
    GEMMs per layer with an additive mask built once per step; in bf16/fp16 the scores GEMM runs as
    K @ q^T (measured ~2x faster than q @ K^T there) and the softmax in fp32, as HF's eager path
    (at batch <= 8 the whole attention runs in fp32 on upcast copies, which is faster there);
  * the maximum position comes from the host, so the step needs no device->host sync.
Supports exactly what `CausalLM` supports (Llama/Qwen2 biases, every RoPE type via the table); tests
pin it to `CausalLM.forward` logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrace.engine.linear import Linear, packing_supported
from tailrace.model.decoder import CausalLM
from tailrace.model.kv_cache import KVCache
from tailrace.model.rope import inv_freq_and_scale, rope_table


# bf16/fp16 attention at small batches: fp32 GEMMs on upcast copies beat bf16 bmm (measured ~20% of
# the step at batch 1-4, even at batch 8, worse above).
_UPCAST_MAX_BATCH = 8


class _Layer:
    __slots__ = ("qkv", "o", "gate_up", "down")


class DecodeRunner:
    def __init__(self, model: CausalLM, max_len: int, attention: str | None = None, packed: bool | None = None):
        """`packed`: oneDNN packed weights (see `linear.py`); None = wherever supported."""
        cfg = model.config
        self.model = model
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.Hkv
        self.I = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.D ** -0.5
        w = model.model.embed_tokens.weight
        self.dtype, self.device = w.dtype, w.device
        if attention is None:
            attention = "bmm"
        if attention not in ("bmm", "sdpa"):
            raise ValueError(f"attention={attention!r}: use 'bmm' or 'sdpa'")
        self.attention = attention
        self.packed = packing_supported(self.dtype) if packed is None else packed
        if self.device.type != "cpu":
            self.packed = False
        # fp32 packed GEMMs lose to MKL at tiny batches (measured); bf16 ones win at every batch
        self.packed_min_batch = 4 if self.dtype == torch.float32 else 1
        inv_freq, scale = inv_freq_and_scale(cfg)
        cos, sin = rope_table(inv_freq, scale, max_len)  # (max_len, D) fp32, sin first half negated
        # As the model: its table follows the module's dtype, so bf16 models rotate in bf16.
        self.cos_sin = torch.stack((cos, sin), dim=1).to(self.device, self.dtype)  # (max_len, 2, D)
        self.arange = torch.arange(max_len, device=self.device)
        self._write_base: dict[tuple[int, int, int], torch.Tensor] = {}
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
            L.qkv = proj(layer.input_layernorm.weight, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                               [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            L.o = Linear(a.o_proj.weight, a.o_proj.bias, pk)
            L.gate_up = proj(layer.post_attention_layernorm.weight, [mlp.gate_proj.weight, mlp.up_proj.weight])
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

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next GEMM). For bf16 input the fused kernel
        normalizes in fp32 and rounds once, bitwise as the model's x.float() ... .to(bf16)."""
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
               max_pos: int) -> torch.Tensor:
        """tokens, positions (B,) int64 of the sequences in cache rows `rows` (a contiguous slice);
        `max_pos` >= positions.max() (host-known). Writes each token's k/v at its position and
        returns logits (B, V) in the model dtype."""
        B = tokens.shape[0]
        H, Hkv, D, G, I = self.H, self.Hkv, self.D, self.G, self.I
        S, L = max_pos + 1, cache.max_len
        widx = self._write_index(rows, L) + positions.repeat_interleave(Hkv)  # (B Hkv,) into k.view(-1, D)
        cs = self.cos_sin[positions]  # (B, 2, D)
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # (B, 1, D)
        bias = torch.where(self.arange[:S] > positions[:, None], float("-inf"), 0.0)  # (B, S) fp32 mask
        if self.attention != "sdpa":
            bias = bias.repeat_interleave(Hkv, dim=0).view(B * Hkv, 1, S)  # broadcast over G
        else:
            bias = bias.to(self.dtype).view(B, 1, 1, S)
        fp32 = self.dtype == torch.float32
        pk = self.packed and B >= self.packed_min_batch
        x = F.embedding(tokens, self.embed)  # (B, hidden)
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(self._rms(x), pk)  # (B, (H + 2 Hkv) D)
            qk = qkv[:, :(H + Hkv) * D].view(B, H + Hkv, D)
            half = D // 2
            qk = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)
            k = qk[:, H:].reshape(B * Hkv, D)
            v = qkv[:, (H + Hkv) * D:].reshape(B * Hkv, D)
            ck, cv = cache.k[i], cache.v[i]
            ck.view(-1, D).index_copy_(0, widx, k)
            cv.view(-1, D).index_copy_(0, widx, v)
            kk, vv = ck[rows, :, :S], cv[rows, :, :S]  # (B, Hkv, S, D) views
            if self.attention == "bmm" and not fp32 and B <= _UPCAST_MAX_BATCH:  # fp32 on upcast copies
                q = qk[:, :H].reshape(B * Hkv, G, D).float()
                k3, v3 = kk.reshape(B * Hkv, S, D).float(), vv.reshape(B * Hkv, S, D).float()
                scores = torch.baddbmm(bias, q, k3.transpose(1, 2), alpha=self.scale)
                o = torch.bmm(torch.softmax(scores, dim=-1), v3).to(self.dtype)
            elif self.attention != "sdpa":
                q = qk[:, :H].reshape(B * Hkv, G, D)
                k3, v3 = kk.reshape(B * Hkv, S, D), vv.reshape(B * Hkv, S, D)  # views
                if fp32:
                    scores = torch.baddbmm(bias, q, k3.transpose(1, 2), alpha=self.scale)  # (B Hkv, G, S)
                else:
                    scores = torch.add(bias, torch.bmm(k3, q.transpose(1, 2)).transpose(1, 2), alpha=self.scale)
                o = torch.bmm(torch.softmax(scores, dim=-1).to(self.dtype), v3)  # (B Hkv, G, D)
            else:
                q = qk[:, :H].view(B, Hkv, G, D)  # GQA: query heads of one kv head become G queries
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias, scale=self.scale)
            x = lw.o.add(o.reshape(B, H * D), x, pk)
            gu = lw.gate_up(self._rms(x), pk)  # (B, 2 I)
            act = F.silu(gu[:, :I]).mul_(gu[:, I:])
            x = lw.down.add(act, x, pk)
        return self.lm_head(self._rms(x), pk)
