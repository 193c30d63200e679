"""`ModelConfig`: the shape of a Llama/Mistral/Mixtral/Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE/OLMo2/OLMo3/OLMoE/SmolLM3/Phi-3/
Granite/Granite MoE/Gemma 2/Gemma 3-family decoder, and its mapping to and from HF config.json.

Reads both transformers-5 style RoPE (`rope_parameters` dict) and the older style (top-level `rope_theta`
plus a `rope_scaling` dict keyed by `type` or `rope_type`); writes a config.json that transformers 5.19
loads into Llama/Mistral/Mixtral/Qwen2/Qwen2Moe/Qwen3/Qwen3Moe/Olmo2/Olmo3/Olmoe/SmolLM3/Phi3/Granite/GraniteMoe/
Gemma2/Gemma3ForCausalLM.

- Qwen3 is Llama's layout with a per-head RMSNorm on q and k before RoPE (`qk_norm`) and its bias switch
  on every attention projection. Qwen3-MoE is Qwen3's with a mixture of experts for the MLP of its sparse
  layers (`moe_at`; model/moe.py): a router choosing `num_experts_per_tok` of `num_experts` SwiGLU experts
  a token. Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is Qwen2's attention (q/k/v biased, `qkv_bias` in
  its config.json) with Qwen3-MoE's sparse layers plus a shared expert every token goes through, a SwiGLU
  MLP of width `shared_expert_intermediate_size` whose output is weighted by a sigmoid gate of its own.
- Mistral is Llama's without biases, and with a sliding window in v0.1: every layer attends to the last
  `sliding_window` positions (`window_at`; the decoder and the engine attend to exactly those). Mixtral
  is Mistral's with every MLP a mixture of experts, `intermediate_size` wide, always renormalized
  (its checkpoints name them `block_sparse_moe.experts.{e}.w1/w3/w2`: `moe.as_ours`, `moe.to_disk`).
  Granite's MoE (`granitemoe`) is Granite's with every MLP such a mixture (a softmax over the k likeliest
  logits: the same weights), each layer's experts stacked in its checkpoint.
- OLMo2 moves each layer's norms after its attention and its MLP (`post_norms`: no norm before them),
  normalizes q and k over their whole width (all heads at once) before RoPE, and its RMSNorm scales in
  fp32 before rounding to the dtype. OLMo3 is OLMo2's with a sliding window on some layers
  (`layer_types`; by default three of every four) and RoPE of their own there (`local_rope`: theta and
  scaling; the full layers' are `rope_theta`, `rope_scaling`). OLMoE is Llama's layer with OLMo2's q/k
  norms over the whole width (rounded as Llama's RMSNorm: `qk_norm_wide`) and Qwen3-MoE's experts in
  every layer, intermediate_size wide.
- SmolLM3 is Llama's with no RoPE in some layers (`no_rope_layers`: 1 where a layer rotates q and k, 0
  where it does not; by default every fourth layer).
- Phi-3 is Llama's with q/k/v and gate/up each stored as one fused matrix (split on load, fused on save:
  `model/fused.py`), a sliding window in its 4k models (as Mistral's), and LongRoPE in its
  128k ones and Phi-3.5: its short factors up to `original_max_position_embeddings`, past which
  transformers and vLLM switch to the long ones for the whole sequence (cached keys included), so
  sequences are held to that length. Phi-4-mini rotates only part of each head (`partial_rotary_factor`:
  the first `rotary_dim` dims, halves paired within them; the rest pass through).
- Granite (IBM's) is Llama's with four scalars (`multipliers`): the embeddings times
  `embedding_multiplier`, each layer's attention and MLP outputs times `residual_multiplier` before
  they join the residual, attention scores scaled by `attention_multiplier` (not 1/sqrt(head_dim)), and
  the logits divided by `logits_scaling`.
- Gemma 3 (its text model, `gemma3_text`: the 1B, and the text part of the larger ones saved on its own)
  has OLMo3's layer types (by default five sliding layers of every six, RoPE theta 1e4 there and 1e6 in the
  full layers) and Qwen3's per-head q/k norms, an RMSNorm both before and after the attention and the MLP,
  every RMSNorm scaling by 1 + its weight in fp32 (`gemma`, `norm_offset`), GeGLU (`hidden_act`),
  embeddings times sqrt(hidden_size) rounded to their dtype, and scores scaled by
  `query_pre_attn_scalar` ** -0.5. Gemma 2 is Gemma 3's without the q/k norms or RoPE of its own, its
  sliding and full layers alternating, and its attention scores and logits capped by tanh
  (`attn_logit_softcapping`, `final_logit_softcapping`: c tanh(x / c)).

Features those classes have and this decoder lacks (windows on some layers outside OLMo3 and Gemma,
MLP bias, partial rotary outside Phi-3, activations but SwiGLU's and Gemma's, softcapping outside Gemma,
other RoPE types, experts outside the MoE families) are rejected, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tailrace.common import ConfigError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}
# rope_type -> keys it requires (beyond rope_type). "default" is stored as rope_scaling=None.
ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
_HF_DEFAULT_MAX_POS = {
    "llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768, "olmo2": 2048, "olmo3": 2048,
    "smollm3": 32768, "phi3": 4096, "granite": 2048, "gemma2": 8192, "gemma3_text": 131072, "qwen3_moe": 32768,
    "qwen2_moe": 32768, "olmoe": 4096, "mixtral": 4096 * 32, "granitemoe": 2048,
}  # fmt: skip
_HF_NO_ROPE_INTERVAL = 4  # SmolLM3Config's no_rope_layer_interval: every fourth layer has no RoPE
_HF_DEFAULT_EPS = {"olmo2": 1e-5, "olmo3": 1e-5, "phi3": 1e-5, "olmoe": 1e-5, "mixtral": 1e-5}  # else 1e-6
_HF_OLMO3_WINDOW, _HF_OLMO3_THETA = 4096, 500000.0  # Olmo3Config's sliding_window and default_theta
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types
_HF_MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when config.json leaves it out
_HF_PHI3_ORIGINAL = 4096  # Phi3Config's original_max_position_embeddings (it wins over rope_scaling's)
_HF_GEMMA3_WINDOW, _HF_GEMMA3_PATTERN = 4096, 6  # Gemma3TextConfig's sliding_window, sliding_window_pattern
_HF_GEMMA3_THETA = (1e6, 1e4)  # Gemma3TextConfig's default_theta: the full layers', the sliding ones'
_HF_GEMMA2 = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# the families whose config.json may name a sliding window; those with it on some layers only (`layer_types`),
# HF's default for which is every n-th layer full; those whose sliding layers may have RoPE of their own
WINDOWED = ("mistral", "mixtral", "phi3", "olmo3", "gemma2", "gemma3_text")
LAYERED = ("olmo3", "gemma2", "gemma3_text")
_HF_FULL_EVERY = {"olmo3": 4, "gemma2": 2, "gemma3_text": _HF_GEMMA3_PATTERN}
ROPE_BY_LAYER = ("olmo3", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
GELU_TANH = "gelu_pytorch_tanh"  # Gemma's MLP activation (GeGLU, tanh approximation)
_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
NO_BIAS = ("mistral", "mixtral", "phi3")  # the families without an attention bias
# the families whose MLPs are mixtures of experts
MOE = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe")
SPARSE_STEP = ("qwen3_moe", "qwen2_moe")  # the MoE families with dense layers too (mlp_only_layers, a step)
QWEN2 = ("qwen2", "qwen2_moe")  # q/k/v biased, o_proj never
# the families whose every layer is sparse, its experts intermediate_size wide (config.json has no
# moe_intermediate_size); Mixtral's and Granite's always renormalized
EVERY_LAYER_MOE = ("olmoe", "mixtral", "granitemoe")
RENORMALIZED = ("mixtral", "granitemoe")
GRANITE = ("granite", "granitemoe")  # the families with Granite's four scalars
# each MoE family's config.json keys for its experts, with its config class's defaults (Mixtral's and
# Granite's count is `num_local_experts` there; their width and renormalizing are fixed: `_check_moe`)
_HF_MOE = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 5632},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
    "granitemoe": {"num_experts": 8, "num_experts_per_tok": 2},
}  # fmt: skip


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: = num_attention_heads (plain multi-head attention)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": one of ROPE_REQUIRED, **its parameters}; the older
    # {"type": ...} spelling is accepted and normalized.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on q/k/v (and on o for llama and qwen3, as HF's attention does). None: qwen2 and qwen2_moe -> True,
    # else False.
    attention_bias: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"
    initializer_range: float = 0.02
    # the last this many positions are what a windowed layer attends to (Mistral's and Phi-3's: every layer;
    # OLMo3's and Gemma's: their sliding ones, `window_at`); None: none, or one that covers
    # max_position_embeddings (read as none)
    sliding_window: int | None = None
    # SmolLM3's per-layer RoPE switch (1: the layer rotates q and k, 0: it does not; None there: HF's
    # default, every fourth layer without); None for the other families (every layer rotates)
    no_rope_layers: tuple[int, ...] | None = None
    # Phi-4-mini's: RoPE rotates the first head_dim * this dims of each head (`rotary_dim`), the rest pass
    partial_rotary_factor: float = 1.0
    # OLMo3's and Gemma's per-layer attention ("sliding_attention": windowed, "full_attention"; None there:
    # HF's default, every fourth (OLMo3), second (Gemma 2) or sixth (Gemma 3) layer full), and the sliding
    # layers' RoPE (OLMo3's and Gemma 3's):
    # {"rope_theta": ..., "rope_type": ..., its parameters} (None: the full layers'); None for the other families
    layer_types: tuple[str, ...] | None = None
    local_rope: dict | None = None
    # Granite's scalars (1.0 and None elsewhere; attention_multiplier None: 1/sqrt(head_dim))
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # the MLP's activation: SwiGLU's "silu", Gemma's GeGLU "gelu_pytorch_tanh" (None: the family's), and
    # Gemma's number whose inverse square root scales the attention scores (None: head_dim)
    hidden_act: str | None = None
    query_pre_attn_scalar: float | None = None
    # Gemma 2's tanh softcaps: attention scores become c tanh(s / c) before the mask and softmax, logits
    # likewise (None: none)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # a mixture of experts (the `MOE` families'): the MLP of a sparse layer (`moe_at`) is `num_experts`
    # SwiGLU experts of width moe_intermediate_size and a router; each token goes through its
    # `num_experts_per_tok` likeliest (softmax over the router's logits in fp32; their probabilities
    # renormalized to sum to 1 where norm_topk_prob), weighted by those; the other layers' MLP is the dense
    # one (intermediate_size). A layer is sparse unless listed in mlp_only_layers, every
    # decoder_sparse_step-th (1: all; OLMoE's, Mixtral's, Granite's: every layer, its experts
    # intermediate_size wide, which moe_intermediate_size then equals). 0: dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen2-MoE's shared expert: a SwiGLU MLP this wide beside the routed experts of every sparse layer, its
    # output times sigmoid(shared_expert_gate(x)) (0: none, the other families)
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; use one of {sorted(ARCHITECTURES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.hidden_size % self.num_attention_heads:
            # transformers' LlamaConfig rejects this even when head_dim is explicit.
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; change one of them"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; pick a divisor for num_key_value_heads"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even int (RoPE rotates pairs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range={self.initializer_range!r} must be > 0")
        if self.attention_bias is None:
            self.attention_bias = self.model_type in QWEN2
        if self.model_type in NO_BIAS and self.attention_bias:
            raise ValueError(
                f"attention_bias=True is impossible for model_type={self.model_type!r} (it has no attention "
                "bias); set attention_bias=False or model_type='llama'"
            )
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError(
                "attention_bias=False is impossible for model_type='qwen2' (Qwen2 always has "
                "q/k/v bias); set attention_bias=True or model_type='llama'"
            )
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(
                    f"{name}={v} is outside [0, vocab_size={self.vocab_size}); fix it or set None"
                )
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        f = self.partial_rotary_factor
        if f != 1.0:
            if not isinstance(f, (int, float)) or not 0 < f < 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ValueError(
                    f"partial_rotary_factor={f!r} must be in (0, 1] and leave an even rotary_dim of at least 2 "
                    f"(head_dim {self.head_dim} times it, rounded down)"
                )
            if self.model_type != "phi3":
                raise ValueError(
                    f"partial_rotary_factor={f} is Phi-3's (Phi-4-mini's); model_type={self.model_type!r} rotates "
                    "the whole head: set it to 1.0"
                )
        if self.rope_type == "longrope" and len(self.rope_scaling["short_factor"]) != self.rotary_dim // 2:
            raise ValueError(
                f"rope_scaling short_factor has {len(self.rope_scaling['short_factor'])} entries; LongRoPE "
                f"needs one per rotated pair, rotary_dim / 2 = {self.rotary_dim // 2}"
            )
        w = self.sliding_window
        if w is not None:
            if not isinstance(w, int) or isinstance(w, bool) or w < 2:
                raise ValueError(f"sliding_window={w!r} must be an int >= 2, or None (no window)")
            if self.model_type not in WINDOWED:
                raise ValueError(
                    f"sliding_window={w} is Mistral's, Phi-3's, OLMo3's and Gemma's; model_type="
                    f"{self.model_type!r} has none: set it to None"
                )
            if w >= self.max_position_embeddings:
                self.sliding_window = None  # it covers every position: no window
        if self.model_type == "smollm3" and self.no_rope_layers is None:
            self.no_rope_layers = no_rope_default(self.num_hidden_layers, _HF_NO_ROPE_INTERVAL)
        if self.no_rope_layers is not None:
            layers = tuple(self.no_rope_layers)
            if len(layers) != self.num_hidden_layers or not set(layers) <= {0, 1}:
                raise ValueError(
                    f"no_rope_layers={list(layers)} must hold a 1 (RoPE) or a 0 (none) for each of the "
                    f"{self.num_hidden_layers} layers"
                )
            if self.model_type != "smollm3":
                raise ValueError(
                    f"no_rope_layers is SmolLM3's; model_type={self.model_type!r} rotates in every layer: "
                    "set it to None"
                )
            self.no_rope_layers = layers
        self._check_layer_types()
        self._check_multipliers()
        self._check_gemma()
        self._check_moe()

    def _check_moe(self) -> None:
        E, k, step = self.num_experts, self.num_experts_per_tok, self.decoder_sparse_step
        self.mlp_only_layers = tuple(self.mlp_only_layers or ())
        shared = self.shared_expert_intermediate_size
        if self.model_type not in MOE:
            if E or k or self.moe_intermediate_size or self.mlp_only_layers or shared:
                raise ValueError(
                    "num_experts, num_experts_per_tok, moe_intermediate_size, mlp_only_layers and "
                    f"shared_expert_intermediate_size are the mixtures of experts' ({', '.join(MOE)}); "
                    f"model_type={self.model_type!r} has a dense MLP: leave them at 0 (and ())"
                )
            return
        if (self.model_type == "qwen2_moe") != (type(shared) is int and shared > 0):
            raise ValueError(
                f"shared_expert_intermediate_size={shared!r}: Qwen2-MoE's sparse layers have a shared expert of "
                "that width (> 0); the other mixtures of experts have none (0)"
            )
        if self.model_type in EVERY_LAYER_MOE:  # every layer sparse, its experts intermediate_size wide
            self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
            if self.moe_intermediate_size != self.intermediate_size or self.mlp_only_layers or step != 1:
                raise ValueError(
                    f"a {self.model_type} model's every layer is sparse, its experts intermediate_size wide: leave "
                    "moe_intermediate_size 0 (or = intermediate_size), mlp_only_layers () and decoder_sparse_step 1"
                )
            self.norm_topk_prob = self.norm_topk_prob or self.model_type in RENORMALIZED
        ok = all(
            isinstance(v, int) and not isinstance(v, bool) for v in (E, k, step, self.moe_intermediate_size)
        )
        if not ok or not 0 < k <= E or self.moe_intermediate_size <= 0 or step <= 0:
            raise ValueError(
                f"num_experts={E!r}, num_experts_per_tok={k!r}, moe_intermediate_size={self.moe_intermediate_size!r}, "
                f"decoder_sparse_step={step!r}: a {self.model_type} model needs 0 < num_experts_per_tok <= "
                "num_experts, moe_intermediate_size > 0 and decoder_sparse_step >= 1"
            )
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"mlp_only_layers={list(self.mlp_only_layers)} must list layer indices in [0, {self.num_hidden_layers})"
            )
        self.norm_topk_prob = bool(self.norm_topk_prob)

    def moe_at(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (Qwen3-MoE's sparse layers, the others' every one), as
        transformers' Qwen3MoeDecoderLayer decides: not in mlp_only_layers, and every decoder_sparse_step-th."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return any(self.moe_at(i) for i in range(self.num_hidden_layers))

    def _check_gemma(self) -> None:
        own = GELU_TANH if self.gemma else "silu"
        self.hidden_act = self.hidden_act or own
        if self.hidden_act != own:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not model_type={self.model_type!r}'s; use {own!r} (or None)"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            s = getattr(self, name)
            if s is not None and (not isinstance(s, (int, float)) or isinstance(s, bool) or not s > 0):
                raise ValueError(f"{name}={s!r} must be a number > 0, or None")
            if not self.gemma and s is not None:
                raise ValueError(
                    f"{name}={s!r} is Gemma's; model_type={self.model_type!r} has none (scores scaled by "
                    "1/sqrt(head_dim), nothing capped): leave it None"
                )

    def _check_multipliers(self) -> None:
        names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        for name in names:
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}={v!r} must be a number > 0")
            setattr(self, name, float(v))
        if self.model_type not in GRANITE and self.multipliers != (1.0, 1.0, None, 1.0):
            raise ValueError(
                f"{', '.join(names)} are Granite's; model_type={self.model_type!r} has none: leave them at "
                "1.0 (attention_multiplier None)"
            )

    @property
    def multipliers(self) -> tuple[float, float, float | None, float]:
        return (
            self.embedding_multiplier,
            self.residual_multiplier,
            self.attention_multiplier,
            self.logits_scaling,
        )

    @property
    def attention_scale(self) -> float:
        """What q k^T is multiplied by: Granite's attention_multiplier, Gemma's query_pre_attn_scalar ** -0.5,
        else 1/sqrt(head_dim)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def score_scale(self) -> float | None:
        """`attention_scale` where the family sets its own, None where it is 1/sqrt(head_dim) (SDPA's default,
        whose rounding the default model was trained with)."""
        return (
            None
            if self.multipliers[2] is None and self.query_pre_attn_scalar is None
            else self.attention_scale
        )

    def _check_layer_types(self) -> None:
        if self.model_type not in LAYERED:
            if self.layer_types is not None or self.local_rope is not None:
                raise ValueError(
                    f"layer_types and local_rope are OLMo3's and Gemma's; model_type={self.model_type!r} has one "
                    "kind of layer: set them to None"
                )
            return
        if self.local_rope is not None and self.model_type not in ROPE_BY_LAYER:
            raise ValueError(
                f"local_rope is OLMo3's and Gemma 3's; model_type={self.model_type!r} rotates every layer alike: "
                "set it to None"
            )
        if (
            self.layer_types is None
        ):  # HF's defaults: every fourth layer full (OLMo3), second (Gemma 2), sixth
            every = _HF_FULL_EVERY[self.model_type]
            self.layer_types = tuple(
                SLIDING if (i + 1) % every else FULL for i in range(self.num_hidden_layers)
            )
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {SLIDING, FULL}:
            raise ValueError(
                f"layer_types={list(self.layer_types)} must name {SLIDING!r} or {FULL!r} for each of the "
                f"{self.num_hidden_layers} layers"
            )
        if SLIDING not in self.layer_types:
            self.sliding_window = None  # no layer attends to a window
        if self.local_rope is not None:
            rope = dict(self.local_rope)
            theta = rope.pop("rope_theta", None) or self.rope_theta
            if not theta > 0:
                raise ValueError(f"local_rope rope_theta={theta!r} must be > 0")
            scaling = _normalize_rope_scaling(rope, self.max_position_embeddings)
            self.local_rope = {"rope_theta": float(theta), **(scaling or {"rope_type": "default"})}

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first; halves paired within them): head_dim, or less
        by partial_rotary_factor (as transformers: rounded down)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def local_at(self, layer: int) -> bool:
        """Whether layer `layer` is one of OLMo3's or Gemma's sliding-window layers (OLMo3's and Gemma 3's
        with RoPE of their own)."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    def window_at(self, layer: int) -> int | None:
        """The positions layer `layer` attends to, the newest included (the last `sliding_window`: a token at
        position p attends to (p - W, p], as transformers' sliding-window mask), or None: every one before
        it. Mistral's and Phi-3's windows are every layer's; OLMo3's and Gemma's their sliding layers'."""
        if self.sliding_window is None or (self.layer_types is not None and not self.local_at(layer)):
            return None
        return self.sliding_window

    @property
    def gemma(self) -> bool:
        """Gemma 2's and 3's layer: RMSNorm before and after both the attention and the MLP, each scaling by
        1 + its weight in fp32 (`norm_offset`); GeGLU; embeddings times sqrt(hidden_size), rounded to their
        dtype (Gemma 3's q and k normalized per head so too: `qk_norm`)."""
        return self.model_type in GEMMA

    @property
    def norm_offset(self) -> float:
        """What every RMSNorm adds to its weight before scaling (Gemma's 1: its weights are stored as w - 1)."""
        return 1.0 if self.gemma else 0.0

    def local(self) -> "ModelConfig":
        """The config whose RoPE the sliding layers use: the full layers' where `local_rope` is None."""
        if self.local_rope is None:
            return self
        rope = dict(self.local_rope)
        theta = rope.pop("rope_theta")
        return self.replace(rope_theta=theta, rope_scaling=None if rope["rope_type"] == "default" else rope)

    def rope_at(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k (SmolLM3 leaves some layers without RoPE)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    @property
    def longrope_limit(self) -> int | None:
        """LongRoPE's original_max_position_embeddings (None for other rope types): up to it the short
        factors rotate every position; past it transformers and vLLM rotate the whole sequence by the
        long ones, keys already cached included, which a KV cache cannot follow."""
        return self.rope_scaling["original_max_position_embeddings"] if self.rope_type == "longrope" else None

    def held_to(self) -> list[tuple[int, str, str]]:
        """The lengths a sequence is held to, each (limit, the setting that sets it, why past it the model
        and this decoder would differ): LongRoPE's short range. `context` refuses past them, and so does the
        decoder's RoPE table (`rope.rope_limit`). (A sliding window holds nothing: the decoder and the engine
        attend to it, `window_at`.)"""
        held = []
        if (n := self.longrope_limit) is not None:
            held.append((n, f"LongRoPE original_max_position_embeddings={n}", "past it the model rotates every "
                         "position by its long factors, keys already cached included, which a KV cache cannot "
                         "follow"))  # fmt: skip
        return held

    @property
    def context_limit(self) -> int:
        """Tokens a sequence may hold, prompt and response: max_position_embeddings, or less where a
        length it is held to (`held_to`) ends first."""
        return min([self.max_position_embeddings, *(limit for limit, _, _ in self.held_to())])

    def context(self, asked: int | None, key: str = "max_context") -> int:
        """The context limit a run or an engine asked for (`asked`, the setting `key`; None:
        `context_limit`). One past a length the model is held to (`held_to`) is refused in one line naming
        `key` (ConfigError, a ValueError): past LongRoPE's short range the model's rotation of every position
        changes."""
        if asked is None:
            return self.context_limit
        for limit, what, why in self.held_to():
            if asked > limit:
                raise ConfigError(f"{key}={asked} is past the model's {what}: {why}; set {key} <= {limit}")
        return asked

    @property
    def qk_norm(self) -> bool:
        """Qwen3's and Gemma 3's RMSNorm over each head's q and k (weights of head_dim), between projection
        and RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe", "gemma3_text")

    @property
    def qk_norm_wide(self) -> bool:
        """OLMo2's and OLMoE's RMSNorm over q's and k's whole width (all heads at once: weights of H x head_dim
        and Hkv x head_dim), between projection and RoPE."""
        return self.post_norms or self.model_type == "olmoe"

    @property
    def post_norms(self) -> bool:
        """OLMo2's layer: x + norm(attn(x)), then x + norm(mlp(x)); q and k normalized over their whole
        width (H D and Hkv D weights) before RoPE; every RMSNorm scales in fp32, then rounds."""
        return self.model_type in ("olmo2", "olmo3")

    @property
    def o_bias(self) -> bool:
        """Whether o_proj has a bias: Llama's and Qwen3's follow attention_bias; Qwen2's (and Qwen2-MoE's)
        never has one."""
        return self.attention_bias and self.model_type not in QWEN2

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    # -- HF config.json mapping -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json. Raises ValueError naming the unsupported feature."""
        model_type = d.get("model_type")
        if model_type is None:  # very old configs name only the architecture
            by_arch = {a: t for t, a in ARCHITECTURES.items()}
            model_type = next((by_arch[a] for a in d.get("architectures") or [] if a in by_arch), None)
        if model_type == "gemma3":
            raise ValueError(
                "model_type='gemma3' is Gemma 3's image-text model; take its text model (gemma3_text) out of it "
                "with `tailrace model import SRC --out DIR`, then use DIR"
            )
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported: "
                + ", ".join(f"{t} ({a})" for t, a in ARCHITECTURES.items())
            )
        archs = d.get("architectures")
        if archs and ARCHITECTURES[model_type] not in archs:
            raise ValueError(
                f"architectures={archs} is not a causal LM this decoder implements; "
                f"expected {ARCHITECTURES[model_type]!r} for model_type={model_type!r}"
            )
        gemma = model_type in GEMMA
        # the MLP's activation (Gemma's own key first), which ModelConfig holds to the family's
        act = (d.get("hidden_activation") if gemma else None) or d.get("hidden_act")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported; only bias-free MLPs")
        if d.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention=True (an embedding model's) is not supported; only causal LMs"
            )
        caps = {k: d.get(k, _HF_GEMMA2[k] if model_type == "gemma2" else None) for k in _SOFTCAPS}
        sliding = any(t != FULL for t in d.get("layer_types") or [])
        if d.get("use_sliding_window") or (sliding and model_type not in LAYERED):
            raise ValueError(
                "sliding-window attention is not supported; use a checkpoint with "
                "use_sliding_window=false and full_attention layers"
            )
        heads = d["num_attention_heads"]
        max_pos = d.get("max_position_embeddings", _HF_DEFAULT_MAX_POS[model_type])
        window = {
            "mistral": d.get("sliding_window", _HF_MISTRAL_WINDOW), "phi3": d.get("sliding_window"),
            "mixtral": d.get("sliding_window"),
            "olmo3": d.get("sliding_window", _HF_OLMO3_WINDOW),
            "gemma3_text": d.get("sliding_window", _HF_GEMMA3_WINDOW),
            "gemma2": d.get("sliding_window", _HF_GEMMA2["sliding_window"]),
        }  # fmt: skip
        local, layer_types = None, d.get("layer_types") if model_type in LAYERED else None
        if model_type in ROPE_BY_LAYER:
            (theta, scaling, local), partial = _layered_rope(d, max_pos, model_type), 1.0
        else:
            theta, scaling, partial = _rope_from_hf(d, max_pos, model_type)
        if model_type == "gemma3_text" and layer_types is None:  # its configs on the Hub name the old pattern
            every = d.get("sliding_window_pattern", _HF_GEMMA3_PATTERN)
            layer_types = [SLIDING if (i + 1) % every else FULL for i in range(d["num_hidden_layers"])]
        no_rope = None
        if model_type == "smollm3":
            interval = d.get("no_rope_layer_interval", _HF_NO_ROPE_INTERVAL)
            no_rope = d.get("no_rope_layers") or no_rope_default(d["num_hidden_layers"], interval)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", _HF_DEFAULT_EPS.get(model_type, 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=_attention_bias(d, model_type),
            bos_token_id=_token_id(d.get("bos_token_id"), d["vocab_size"]),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=_token_id(d.get("pad_token_id"), d["vocab_size"]),
            model_type=model_type,
            initializer_range=d.get("initializer_range", 0.02),
            sliding_window=window.get(model_type),
            no_rope_layers=no_rope,
            partial_rotary_factor=partial,
            layer_types=layer_types,
            local_rope=local,
            hidden_act=act,
            **(_moe_from_hf(d, model_type) if model_type in MOE else {}),
            **(_granite_from_hf(d) if model_type in GRANITE else {}),
            **({"query_pre_attn_scalar": d.get("query_pre_attn_scalar", 256), **caps} if gemma else {}),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict for transformers 5.19 (also carries the older rope keys for older readers)."""
        rope = {
            "rope_type": self.rope_type,
            "rope_theta": self.rope_theta,
            **{k: v for k, v in (self.rope_scaling or {}).items() if k != "rope_type"},
            **(
                {"partial_rotary_factor": self.partial_rotary_factor}
                if self.partial_rotary_factor != 1
                else {}
            ),
        }
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type in ("llama", *GRANITE):
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
            if self.model_type in GRANITE:
                d.update(embedding_multiplier=self.embedding_multiplier, residual_multiplier=self.residual_multiplier,
                         attention_multiplier=self.attention_scale, logits_scaling=self.logits_scaling)  # fmt: skip
        elif self.model_type in WINDOWED:
            d.update(sliding_window=self.sliding_window)
        elif self.model_type not in ("olmo2", "olmoe"):
            d.update(use_sliding_window=False)
        if self.model_type in ("qwen3", "olmo2", "olmo3", "smollm3", *GEMMA, *MOE):
            d.update(attention_bias=self.attention_bias)
        if self.model_type in MOE:
            moe = {k: getattr(self, k) for k in _HF_MOE[self.model_type]}
            if self.model_type in RENORMALIZED:
                moe["num_local_experts"] = moe.pop("num_experts")
            d.update(moe, output_router_logits=False)
        if self.model_type in SPARSE_STEP:
            d.update(mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "qwen2_moe":
            d.update(qkv_bias=self.attention_bias)
        if self.model_type == "olmoe":
            d.update(clip_qkv=None)
        if self.gemma:
            d.update(
                hidden_activation=self.hidden_act,
                query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
            )
            d.update({k: getattr(self, k) for k in _SOFTCAPS}, use_bidirectional_attention=False)
        if self.model_type == "gemma3_text":
            d.update(rope_local_base_freq=(self.local_rope or {}).get("rope_theta", self.rope_theta))
        if self.model_type in LAYERED:
            d.update(layer_types=list(self.layer_types))
        if self.model_type in ROPE_BY_LAYER:  # RoPE by layer type: the full layers' and the sliding layers'
            local = dict(self.local_rope or {"rope_theta": self.rope_theta, "rope_type": "default"})
            d.update(rope_parameters={FULL: rope, SLIDING: local})
            d.pop("rope_scaling", None)
        if self.model_type == "smollm3":
            d.update(no_rope_layers=list(self.no_rope_layers), mlp_bias=False)
        if self.model_type == "phi3":  # Phi3Config's own field wins over the rope dict's
            d.update(original_max_position_embeddings=self.longrope_limit or self.max_position_embeddings)
            d.update(partial_rotary_factor=self.partial_rotary_factor)
        return d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def no_rope_default(layers: int, interval: int) -> tuple[int, ...]:
    """SmolLM3Config's `no_rope_layers` when config.json leaves them out: every `interval`-th layer has none."""
    return tuple(int((i + 1) % interval != 0) for i in range(layers))


def _token_id(v: int | None, vocab_size: int) -> int | None:
    """Old configs spell "no such token" as -1 (or an id past the vocabulary); that means None."""
    return v if isinstance(v, int) and 0 <= v < vocab_size else None


def _normalize_rope_scaling(rs: dict | None, max_pos: int) -> dict | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(
            f"rope_scaling={rs!r} must be a dict like {{'rope_type': 'linear', 'factor': 2.0}} or None"
        )
    rs = dict(rs)
    rope_type = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)  # lives in ModelConfig.rope_theta
    if rope_type == "default":
        return None
    if rope_type not in ROPE_REQUIRED:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; use one of {['default', *ROPE_REQUIRED]}"
        )
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            "rope_scaling partial_rotary_factor: set ModelConfig.partial_rotary_factor instead (config.json's "
            "is read into it; only Phi-3 rotates part of a head)"
        )
    rs.pop("partial_rotary_factor", None)
    if rope_type in ("yarn", "llama3"):  # as transformers' standardize_rope_params
        rs.setdefault("original_max_position_embeddings", max_pos)
    missing = [k for k in ROPE_REQUIRED[rope_type] if rs.get(k) is None]
    if missing:
        raise ValueError(
            f"rope_scaling for rope_type={rope_type!r} lacks {missing}; add them to rope_scaling"
        )
    if rope_type == "longrope":
        _check_longrope(rs)
    elif not rs["factor"] > 0:
        raise ValueError(f"rope_scaling factor={rs['factor']!r} must be > 0")
    if rope_type == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
        raise ValueError("rope_scaling llama3 needs high_freq_factor > low_freq_factor")
    return {"rope_type": rope_type, **rs}


def _moe_from_hf(d: dict, model_type: str) -> dict:
    """A MoE family's experts (`_HF_MOE`), its config class's defaults where config.json leaves them out.
    The count is `num_experts` in the Hub's Qwen3-MoE and OLMoE configs, `num_local_experts` in Mixtral's,
    Granite's and those transformers 5 writes (each family's own spelling first). OLMoE's, Mixtral's and
    Granite's expert width and the last two's renormalizing are set by `ModelConfig._check_moe`; Mixtral's
    router_jitter_noise acts only in transformers' training mode. OLMoE's clip_qkv (clamping q, k and v)
    is refused."""
    if model_type == "olmoe" and d.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={d['clip_qkv']} is not supported; use a checkpoint with clip_qkv null")
    moe = {k: d.get(k, v) for k, v in _HF_MOE[model_type].items()}
    count = (
        ("num_local_experts", "num_experts")
        if model_type in RENORMALIZED
        else ("num_experts", "num_local_experts")
    )
    moe["num_experts"] = d.get(count[0], d.get(count[1], moe["num_experts"]))
    return moe | ({"mlp_only_layers": d.get("mlp_only_layers") or ()} if model_type in SPARSE_STEP else {})


def _attention_bias(d: dict, model_type: str) -> bool:
    """Qwen2's q/k/v always biased, Qwen2-MoE's unless its `qkv_bias` says not; the bias-free families' never;
    the others' as `attention_bias` says."""
    if model_type in QWEN2:
        return model_type == "qwen2" or bool(d.get("qkv_bias", True))
    return model_type not in NO_BIAS and bool(d.get("attention_bias"))


def _granite_from_hf(d: dict) -> dict:
    """GraniteConfig's scalars, its defaults (1.0; attention_multiplier too) where config.json leaves them out."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {k: d.get(k, 1.0) for k in keys}


def _layered_rope(d: dict, max_pos: int, model_type: str) -> tuple[float, dict | None, dict]:
    """(the full layers' rope_theta and rope_scaling, the sliding layers' {"rope_theta", ...}), as
    Olmo3Config and Gemma3TextConfig read them: `rope_parameters` by layer type, or the older flat
    `rope_scaling` (the full layers'), each theta its own where given, else `rope_theta` (OLMo3's: 500000
    for both) or, Gemma 3's, `rope_theta` (1e6) for the full layers and `rope_local_base_freq` (1e4) for
    the sliding ones."""
    params = d.get("rope_parameters") or {}
    nested = isinstance(params, dict) and (SLIDING in params or FULL in params)
    full = dict((params.get(FULL) if nested else params) or {})
    local = dict((params.get(SLIDING) if nested else None) or {})
    full.update(d.get("rope_scaling") or {})
    if model_type == "gemma3_text":
        thetas = (
            d.get("rope_theta") or _HF_GEMMA3_THETA[0],
            d.get("rope_local_base_freq") or _HF_GEMMA3_THETA[1],
        )
    else:
        thetas = (d.get("rope_theta") or _HF_OLMO3_THETA,) * 2
    for rope, theta in zip((full, local), thetas):
        rope.setdefault("rope_theta", theta)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"partial_rotary_factor != 1 is not supported for {model_type}; rotate the whole head"
            )
        rope.pop("partial_rotary_factor", None)
    full_theta = full.pop("rope_theta")
    local.setdefault("rope_type", local.pop("type", None) or "default")
    return float(full_theta), _normalize_rope_scaling(full, max_pos), local


def _check_longrope(rs: dict) -> None:
    for k in ("short_factor", "long_factor"):
        f = rs[k]
        if (
            not isinstance(f, (list, tuple))
            or not f
            or not all(isinstance(x, (int, float)) and x > 0 for x in f)
        ):
            raise ValueError(
                f"rope_scaling {k}={f!r} must be a list of positive numbers, one per rotated pair"
            )
        rs[k] = [float(x) for x in f]
    if len(rs["short_factor"]) != len(rs["long_factor"]):
        raise ValueError(
            "rope_scaling short_factor and long_factor must have the same length (rotary_dim / 2)"
        )
    for k in ("factor", "attention_factor"):
        if rs.get(k) is not None and not rs[k] > 0:
            raise ValueError(f"rope_scaling {k}={rs[k]!r} must be > 0")


def _rope_from_hf(d: dict, max_pos: int, model_type: str) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from either config.json style. Like transformers
    5, `rope_scaling` wins over `rope_parameters` when both are present, and the rope dict's
    partial_rotary_factor over the top-level one; Phi-3's "su" and "yarn" are its LongRoPE."""
    src = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(src, dict) or any(isinstance(v, dict) for v in src.values()):
        raise ValueError(f"rope parameters {src!r} are not a flat dict; per-layer-type RoPE is not supported")
    src = dict(src)
    theta = src.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    partial = src.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    rope_type = src.get("rope_type") or src.get("type") or "default"
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        src.pop("type", None)
        src["rope_type"] = rope_type = "longrope"
    if model_type == "phi3" and rope_type == "longrope":  # Phi3Config's field, 4096 when left out, wins
        src["original_max_position_embeddings"] = d.get("original_max_position_embeddings", _HF_PHI3_ORIGINAL)
    elif rope_type in ("yarn", "llama3", "longrope") and d.get("original_max_position_embeddings"):
        src["original_max_position_embeddings"] = d[
            "original_max_position_embeddings"
        ]  # HF gives it priority
    return float(theta), _normalize_rope_scaling(src, max_pos), float(partial)
