"""`FusedWeights`: one model version's parameters laid out for the engine step (both backends).

* q/k/v and gate/up projections fused into one GEMM each (fused copies of the weights, rebuilt by
  `refresh` after a weight load), residual adds folded into `addmm`; each RMSNorm weight is folded
  into the columns of the projection that follows it ((x*w) W^T = x (W diag w)^T; in bf16 this
  rounds W*w instead of x*w, a difference of the size of bf16 rounding itself);
* Qwen3's per-head q and k norm weights stacked into one (H + Hkv, D) table per layer, applied to the
  q and k columns of the fused projection's output before RoPE (`norm_qk`; the kernel backend's C
  layer call applies them itself);
* on CPU, GEMMs over oneDNN packed copies of the weights at batches where they beat MKL (`packed_at`;
  see `linear.py`).
"""

from __future__ import annotations

import torch

from tailrace.engine.backends.linear import Linear, packing_supported
from tailrace.engine.ckernel import Kernels
from tailrace.model.decoder import CausalLM

PACKED_FP32_MIN_HIDDEN = 512  # fp32 models this wide use the packed weights at every batch


class _Layer:
    # norms: their weights (hidden,); qk_norm: Qwen3's q and k norm weights per head, (H + Hkv, D), or None
    __slots__ = ("qkv", "o", "gate_up", "down", "norm_attn", "norm_mlp", "qk_norm")


class FusedWeights:
    def __init__(
        self, model: CausalLM, packed: bool | None = None, kernel: Kernels | None = None, int8: bool = False
    ):
        """`packed`: oneDNN packed weights; None = wherever supported (CPU only). `kernel`: the C
        kernels, whose GEMM serves the linears where it can (`linear.kernel_gemm_serves`). `int8`: the
        decoder layers' fused weights rounded to int8 per output row (a quantized drafter; the LM head
        and embeddings stay the model's precision)."""
        cfg = model.config
        self.model, self.kernel, self.int8 = model, kernel, int8
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.Hkv  # query heads per kv head
        self.I = cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.D**-0.5
        w = model.model.embed_tokens.weight
        self.dtype, self.device = w.dtype, w.device
        self.packed = packing_supported(self.dtype) if packed is None else packed
        if self.device.type != "cpu":
            self.packed = False
        # bf16 packed GEMMs win at every batch; fp32 ones lose to MKL below 48 rows on small weights
        # (hidden 128) and win at every batch on larger ones (hidden 576) (bench/README.md)
        small = cfg.hidden_size < PACKED_FP32_MIN_HIDDEN
        self.packed_min_batch = 48 if self.dtype == torch.float32 and small else 1
        self.refresh()

    def packed_at(self, rows: int) -> bool:
        """Whether GEMMs over `rows` input rows use the packed weights."""
        return self.packed and rows >= self.packed_min_batch

    @torch.inference_mode()
    def refresh(self) -> None:
        """(Re)build the fused weights from the model's current parameters."""
        m, pk = self.model.model, self.packed
        plain = not self.packed_at(1)  # some calls run on W itself (below packed_min_batch rows)

        def proj(norm_w, ws, bs=None, int8=self.int8):  # one GEMM for the projections reading one RMSNorm
            w = torch.cat(ws)
            b = torch.cat(bs) if bs and bs[0] is not None else None
            return Linear(w * norm_w, b, pk, self.kernel, int8, plain)

        self.embed = m.embed_tokens.weight
        self.lm_head = proj(m.norm.weight, [self.model.lm_head.weight], int8=False)
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            L = _Layer()
            L.qkv = proj(
                layer.input_layernorm.weight,
                [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
            )
            L.o = Linear(a.o_proj.weight, a.o_proj.bias, pk, self.kernel, self.int8, plain)
            L.gate_up = proj(
                layer.post_attention_layernorm.weight, [mlp.gate_proj.weight, mlp.up_proj.weight]
            )
            L.down = Linear(mlp.down_proj.weight, None, pk, self.kernel, self.int8, plain)
            L.norm_attn, L.norm_mlp = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            L.qk_norm = (
                torch.cat((a.q_norm.weight.expand(self.H, -1), a.k_norm.weight.expand(self.Hkv, -1)))
                if a.qk_norm
                else None
            )
            self.layers.append(L)


def norm_qk(qkv: torch.Tensor, weight: torch.Tensor, D: int, eps: float) -> torch.Tensor:
    """Qwen3's q and k norms on the fused projection's output qkv (M, (H + 2 Hkv) D), in place: each
    head's q and k RMS-normalized over D in fp32, rounded to the model's dtype, then scaled by its
    weight (`weight` (H + Hkv, D)), as HF's Qwen3RMSNorm. Returns qkv."""
    qk = qkv[:, : weight.shape[0] * D].view(qkv.shape[0], weight.shape[0], D)
    qk.copy_(weight * torch.nn.functional.rms_norm(qk.float(), (D,), eps=eps).to(qkv.dtype))
    return qkv
