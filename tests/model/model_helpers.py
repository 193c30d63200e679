"""Shared fixtures for tests/model: small random configs and HF reference models built from our weights."""

from __future__ import annotations

import torch

from tailrace.model import CausalLM, ModelConfig, save_pretrained

TOL = 1e-4  # max abs fp32 logits difference allowed against transformers

# Each entry exercises a different corner; together: llama, mistral, qwen2, qwen3, olmo2, olmo3, smollm3, phi3,
# granite and gemma 3, tied and untied, GQA ratios 1/2/4, head_dim != hidden/heads, every rope type in both
# spellings, with and without q/k/v bias, sliding windows shorter than the test sequences.
CONFIGS = {
    "llama-mha-default": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa2-tied-headdim-linear": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    "llama-gqa4-bias-llama3": dict(
        model_type="llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        attention_bias=True,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "qwen2-gqa2-tied-yarn": dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    ),
    "qwen2-gqa4-headdim-dynamic": dict(
        model_type="qwen2",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=12,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    ),
    "mistral-gqa4-nowindow": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2),
    # Mistral v0.1's layout: a sliding window shorter than the test sequences (24 tokens; 9 is not a
    # multiple of the engine tests' block size 4)
    "mistral-gqa2-window": dict(
        model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=9
    ),
    # Qwen3-0.6B's layout: per-head q/k norms, head_dim wider than hidden/heads, tied, a bias on all four
    # attention projections (off in the published checkpoints; on here so o_proj's bias is covered too)
    "qwen3-gqa2-tied-headdim-bias": dict(
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_theta=1e6,
    ),
    # SmolLM3's layout: Llama's with no RoPE in some layers (here the second), tied
    "smollm3-gqa2-tied-norope": dict(
        model_type="smollm3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        no_rope_layers=(1, 0),
    ),  # fmt: skip
    # Phi-3's layout: fused q/k/v and gate/up, a window (the 4k models') and LongRoPE (the 128k models' and
    # Phi-3.5's), held to its short range: 32 of 64 positions, so cos and sin are scaled by sqrt(1 + ln 2 / ln 32)
    "phi3-gqa2-window-longrope": dict(
        model_type="phi3",
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=13,
        rope_scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0],
        },
    ),  # fmt: skip
    # Phi-4-mini's layout: Phi-3's, tied, RoPE on 3/4 of each head (12 of 16 dims, paired within them)
    # with LongRoPE over those 12
    "phi3-gqa2-tied-partial-longrope": dict(
        model_type="phi3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        rope_scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.2, 1.5, 1.9, 2.4, 3.0],
            "long_factor": [2.0] * 6,
        },
    ),  # fmt: skip
    # OLMo2's layout: norms after attention and MLP, q/k normalized over all heads at once, untied
    "olmo2-gqa2-bias": dict(
        model_type="olmo2", num_attention_heads=4, num_key_value_heads=2, attention_bias=True
    ),
    # Granite 3's layout: Llama's, tied, with its four scalars (Granite-3.x-8B's values, logits 8 here)
    "granite-gqa2-tied-multipliers": dict(
        model_type="granite",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    ),  # fmt: skip
    # OLMo3's layout: OLMo2's, a sliding layer (window 10, shorter than the test sequences) with plain RoPE
    # of its own theta, and a full layer with YaRN (as OLMo-3-7B's long-context layers)
    "olmo3-gqa2-window-localrope": dict(
        model_type="olmo3",
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=10,
        layer_types=("sliding_attention", "full_attention"),
        local_rope={"rope_theta": 1000.0},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ),  # fmt: skip
    # Gemma 3's layout (gemma3_text): norms before and after attention and MLP, each scaling by 1 + its
    # weight, per-head q/k norms, GeGLU, scaled embeddings, tied; two sliding layers (window 7) with RoPE of
    # their own theta and a full one with linear RoPE (as Gemma-3-4B's), scores by query_pre_attn_scalar 24
    "gemma3-gqa2-tied-window-localrope": dict(
        model_type="gemma3_text",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=7,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        local_rope={"rope_theta": 1e4},
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),  # fmt: skip
    # Gemma 2's layout: Gemma 3's without q/k norms or RoPE of its own, sliding and full layers alternating
    # (window 7), its tanh softcaps small enough to bite (scores at 2, logits at 3)
    "gemma2-gqa2-tied-window-softcap": dict(
        model_type="gemma2",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        sliding_window=7,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),  # fmt: skip
    # Qwen3-MoE's layout (Qwen3-30B-A3B's, small): Qwen3's attention, each layer's MLP six experts (of width 40)
    # and a router choosing two a token, renormalized; the middle layer's MLP dense (mlp_only_layers)
    "qwen3moe-gqa2-experts-dense": dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
    ),  # fmt: skip
    # OLMoE's layout (OLMoE-1B-7B's, small): Llama's pre-norm layer, q and k normalized over their whole width
    # (as OLMo2's, but rounded as Llama's RMSNorm), every MLP five experts as wide as intermediate_size, two a
    # token, not renormalized; a bias on the attention projections
    "olmoe-gqa2-experts-bias": dict(
        model_type="olmoe",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=5,
        num_experts_per_tok=2,
        attention_bias=True,
    ),  # fmt: skip
    # Mixtral's layout (Mixtral-8x7B's, small): Mistral's attention (here a window shorter than the test
    # sequences), every MLP four experts as wide as intermediate_size, two a token, renormalized; its
    # checkpoint names (block_sparse_moe, w1/w3/w2) ours on load and its own again on save
    "mixtral-gqa2-experts-window": dict(
        model_type="mixtral",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        sliding_window=11,
    ),  # fmt: skip
    # Granite 3's MoE layout (granite-3.1-1b-a400m's, small): Granite's four scalars, every MLP four experts,
    # two a token (a softmax over the two likeliest logits); its checkpoint stacks each layer's experts
    "granitemoe-gqa2-experts-multipliers": dict(
        model_type="granitemoe",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=6.0,
    ),  # fmt: skip
}
HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}


def make_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=53,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    return ModelConfig(**{**base, **overrides})


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Weights far from HF's tiny init, so logits differ across positions and mistakes show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def random_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    return randomize_(CausalLM.from_config(cfg, seed=seed), seed + 1).eval()


def hf_from_ours(model: CausalLM, tmp_path):
    """transformers' own model, loaded from our save_pretrained output."""
    from transformers import AutoModelForCausalLM

    save_pretrained(model, tmp_path)
    # transformers' SDPA attention drops Gemma 2's softcap (its eager attention, Google's and vLLM's apply it)
    eager = {"attn_implementation": "eager"} if model.config.attn_logit_softcapping is not None else {}
    return AutoModelForCausalLM.from_pretrained(tmp_path, **eager).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def hf_reference(name: str, tmp_path, T: int = 24):
    """(ours, HF logits of `ids`, ids (3, T)) for CONFIGS[name]: our random model and transformers' own
    model loaded from its checkpoint."""
    cfg = make_config(**CONFIGS[name])
    ours = random_model(cfg, seed=len(name))
    hf = hf_from_ours(ours, tmp_path)
    assert type(hf).__name__ == HF_CLASSES[cfg.model_type]
    ids = torch.randint(0, cfg.vocab_size, (3, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
    return ours, ref, ids
