"""Round-to-nearest weight quantization: the self-drafter's copy of the live policy (EfficientRollout).

Symmetric RTN per output channel (int8) or per group of 32 inputs of an output channel (int4): w ->
round(w / s) s with s = max|w| / (2^(bits-1) - 1) over the channel or group. Only the decoder layers'
linear weights are quantized; embeddings, norms and the (tied) head are the policy's own tensors,
shared, not copied. The copy holds the dequantized values in the model's dtype, so it runs on the
engine's own backend and kernels: it reproduces the published drafter's numerics (its acceptance), not
its memory-bandwidth saving. That is the int4 drafter's path; the int8 one instead has the backend
round its fused weights (`FusedWeights(int8=True)`), which on CPU keeps them int8 for the C int8 GEMM.
"""

from __future__ import annotations

import torch

from tailrace.model.decoder import CausalLM

GROUP4 = 32  # int4: inputs per scale
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rtn(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w (out, in) -> its RTN-quantized values, dequantized, in w's dtype (see module doc)."""
    qmax = 2 ** (bits - 1) - 1
    group = w.shape[1] if bits >= 8 or w.shape[1] % GROUP4 else GROUP4
    g = w.float().reshape(w.shape[0], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / qmax
    q = torch.round(g / scale).clamp_(-qmax - 1, qmax)
    return (q * scale).reshape(w.shape).to(w.dtype)


@torch.inference_mode()
def quantized_copy(model: CausalLM, bits: int) -> CausalLM:
    """A `CausalLM` whose layers' linear weights are `model`'s quantized to `bits`; the rest shared."""
    state = {}
    for name, t in model.state_dict().items():
        quantize = name.endswith(".weight") and name.split(".")[-2] in LINEAR
        state[name] = quantize_rtn(t, bits) if quantize else t
    with torch.device("meta"):
        copy = CausalLM(model.config)
    copy.load_state_dict(state, strict=False, assign=True)
    copy.tie_weights()
    w = model.model.embed_tokens.weight
    return copy.to(w.device, w.dtype).eval().requires_grad_(False)
