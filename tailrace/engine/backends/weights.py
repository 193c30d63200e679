"""`FusedWeights`: one model version's parameters laid out for the engine step (both backends).

* q/k/v and gate/up projections fused into one GEMM each, residual adds folded into `addmm`. The
  fusion copies nothing: the model's own q/k/v (gate/up) weights become row blocks of one tensor
  (`fuse_rows`), so a weight load, which copies into them, updates the fused GEMM's weight in place,
  and a version holds its weights once (a fused copy beside them made a Qwen3 version 1.6x its
  weights' bytes on a GPU). RMSNorm weights multiply the normalized rows, as HF's RMSNorm does (round
  to the dtype, then times the weight), not folded into the next GEMM's columns;
* Qwen3's per-head q and k norm weights stacked into one (H + Hkv, D) table per layer, applied to the
  q and k columns of the fused projection's output before RoPE (`norm_qk`; the kernel backend's C
  layer call applies them itself);
* Gemma 3's norms scale by 1 + their weights in fp32: those are fp32 copies holding 1 + w (rebuilt by
  `refresh`), its layers' norms both before and after the attention and the MLP;
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
    # norms: their weights (hidden,), None where the layer has none; qk_norm: Qwen3's q and k norm weights
    # per head, (H + Hkv, D), or None; OLMo2's: post_attn, post_mlp (hidden,) on the attention's and the
    # MLP's outputs, q_norm (H D,) and k_norm (Hkv D,) over all heads at once (OLMoE's too); an MoE's sparse layers:
    # router (E x hidden) and experts [(gate_up, down)], where gate_up and down are None; Qwen2-MoE's
    # shared expert (gate_up, down) and its gate (1 x hidden) in shared and shared_gate (else None)
    __slots__ = (
        *("qkv", "o", "gate_up", "down", "norm_attn", "norm_mlp", "qk_norm"),
        *("post_attn", "post_mlp", "q_norm", "k_norm", "router", "experts", "shared", "shared_gate"),
    )


def fuse_rows(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor whose consecutive row blocks are `params` (each (n_i, ...)), the params made views of
    it: copied there at the first call, found in place at the next (a weight load copies into the
    views). An inference tensor where the params are (a parameter keeps its kind: a plain one made a
    view of an inference tensor, or the reverse, cannot be read by autograd-aware ops), else a plain one,
    which loads outside inference mode may write."""
    ts = [p.data for p in params]
    rows = sum(t.shape[0] for t in ts)
    with torch.inference_mode(ts[0].is_inference()):
        if _consecutive(ts):
            return ts[0].as_strided((rows, *ts[0].shape[1:]), ts[0].stride(), ts[0].storage_offset())
        fused = torch.cat(ts)
        at = 0
        for p in params:
            p.data = fused[at : at + p.shape[0]]
            at += p.shape[0]
    return fused


def _consecutive(ts: list[torch.Tensor]) -> bool:
    """Whether the tensors lie one after another, contiguous, in one storage."""
    storage, at = ts[0].untyped_storage().data_ptr(), ts[0].storage_offset()
    for t in ts:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return False
        at += t.numel()
    return True


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
        self.eps = cfg.rms_norm_eps
        # OLMo2's and Gemma's RMSNorm: scaled in fp32, then rounded to the dtype (Gemma's q/k norms too)
        self.scale_fp32, self.offset = cfg.post_norms or cfg.gemma, cfg.norm_offset
        self.scale = cfg.attention_scale  # 1/sqrt(D), or Granite's attention_multiplier, Gemma's
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2's cap on the scores (None: none)
        self.gelu = cfg.hidden_act != "silu"  # Gemma's GeGLU
        self.windows = [cfg.window_at(i) for i in range(cfg.num_hidden_layers)]  # each layer's (None: all)
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
        """(Re)build what derives from the model's current parameters: packed copies, int8 roundings, the
        q/k norm tables (the fused weights are the parameters themselves)."""
        m, pk = self.model.model, self.packed
        plain = not self.packed_at(1)  # some calls run on W itself (below packed_min_batch rows)

        def proj(ws, bs=None, int8=self.int8):  # one GEMM for the projections reading one RMSNorm
            w = fuse_rows(ws) if len(ws) > 1 else ws[0].detach()
            b = fuse_rows(bs) if bs and bs[0] is not None else None
            return Linear(w, b, pk, self.kernel, int8, plain)

        # plain tensors over the parameters' storage (a load writes them): ops that take a Parameter (a
        # torch-function subclass) dispatch slower (bench/README.md, under model_memory.py: the GEMM calls of
        # the built-in model's decode 0.055 s with the LM head a Parameter, 0.045 s as a view)
        def norm(p):  # Gemma's scale by 1 + the weight, in fp32
            return p.detach() if not self.offset else self.offset + p.detach().float()

        self.embed = m.embed_tokens.weight
        self.norm = norm(m.norm.weight)
        self.lm_head = proj([self.model.lm_head.weight], int8=False)
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            L = _Layer()
            L.qkv = proj(
                [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
            )
            L.o = Linear(a.o_proj.weight, a.o_proj.bias, pk, self.kernel, self.int8, plain)
            L.router = L.experts = L.gate_up = L.down = L.shared = L.shared_gate = None
            if hasattr(mlp, "experts"):  # the router in the model's precision: int8 would move its choices
                L.router = proj([mlp.gate.weight], int8=False)
                L.experts = [(proj([e.gate_proj.weight, e.up_proj.weight]), proj([e.down_proj.weight]))
                             for e in mlp.experts]  # fmt: skip
                if hasattr(mlp, "shared_expert"):
                    s = mlp.shared_expert
                    L.shared = (proj([s.gate_proj.weight, s.up_proj.weight]), proj([s.down_proj.weight]))
                    L.shared_gate = proj([mlp.shared_expert_gate.weight], int8=False)
            else:
                L.gate_up = proj([mlp.gate_proj.weight, mlp.up_proj.weight])
                L.down = Linear(mlp.down_proj.weight, None, pk, self.kernel, self.int8, plain)
            L.norm_attn = L.norm_mlp = L.post_attn = L.post_mlp = L.q_norm = L.k_norm = L.qk_norm = None
            if layer.sandwich:
                L.norm_attn = norm(layer.input_layernorm.weight)
                L.post_attn = norm(layer.post_attention_layernorm.weight)
                L.norm_mlp = norm(layer.pre_feedforward_layernorm.weight)
                L.post_mlp = norm(layer.post_feedforward_layernorm.weight)
            elif layer.post_norms:
                L.post_attn = layer.post_attention_layernorm.weight.detach()
                L.post_mlp = layer.post_feedforward_layernorm.weight.detach()
            else:
                L.norm_attn = layer.input_layernorm.weight.detach()
                L.norm_mlp = layer.post_attention_layernorm.weight.detach()
            if a.qk_norm_wide:  # OLMo2's, OLMoE's
                L.q_norm, L.k_norm = a.q_norm.weight.detach(), a.k_norm.weight.detach()
            if a.qk_norm:
                L.qk_norm = torch.cat(
                    (norm(a.q_norm.weight).expand(self.H, -1), norm(a.k_norm.weight).expand(self.Hkv, -1))
                )
            self.layers.append(L)


def norm_qk(qkv: torch.Tensor, weight: torch.Tensor, D: int, eps: float) -> torch.Tensor:
    """Qwen3's q and k norms on the fused projection's output qkv (M, (H + 2 Hkv) D), in place: each
    head's q and k RMS-normalized over D in fp32, rounded to the model's dtype, then scaled by its
    weight (`weight` (H + Hkv, D)), as HF's Qwen3RMSNorm; fp32 weights (Gemma 3's 1 + w, or an fp32
    model's, where the two orders are one) scale in fp32, then round, as the C layer call. Returns qkv."""
    qk = qkv[:, : weight.shape[0] * D].view(qkv.shape[0], weight.shape[0], D)
    n = torch.nn.functional.rms_norm(qk.float(), (D,), eps=eps)
    qk.copy_((n * weight).to(qkv.dtype) if weight.dtype == torch.float32 else weight * n.to(qkv.dtype))
    return qkv
