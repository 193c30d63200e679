"""ModelConfig: validation messages, both HF rope spellings, and a config.json transformers loads."""

from __future__ import annotations

import pytest
from model_helpers import CONFIGS, HF_CLASSES, make_config

from tailrace.model import ModelConfig


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_to_hf_from_hf_round_trip(name):
    cfg = make_config(**CONFIGS[name])
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_reads_our_config_json(name):
    from transformers import AutoConfig

    cfg = make_config(**CONFIGS[name])
    hf = AutoConfig.for_model(**cfg.to_hf())
    want = HF_CLASSES[cfg.model_type].replace(
        "ForCausalLM", "TextConfig" if cfg.model_type == "gemma3_text" else "Config"
    )
    assert type(hf).__name__ == want
    assert hf.head_dim == cfg.head_dim and hf.num_key_value_heads == cfg.num_key_value_heads
    full = hf.rope_parameters.get("full_attention", hf.rope_parameters)  # OLMo3's: by layer type
    assert full["rope_type"] == cfg.rope_type and full["rope_theta"] == cfg.rope_theta
    for k, v in (cfg.rope_scaling or {}).items():
        assert full[k] == v
    if cfg.local_rope is not None:
        assert hf.rope_parameters["sliding_attention"] == cfg.local_rope
        assert list(hf.layer_types) == list(cfg.layer_types) and hf.sliding_window == cfg.sliding_window


def test_both_rope_spellings_normalize_the_same():
    base = make_config().to_hf()
    del base["rope_parameters"], base["rope_theta"]
    new = {
        **base,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 5e5,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    old = {
        **base,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    }
    a, b = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
    assert a == b
    assert a.rope_theta == 5e5
    assert a.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def test_default_rope_is_none_and_missing_original_length_defaults_like_hf():
    assert make_config(rope_scaling={"rope_type": "default"}).rope_scaling is None
    cfg = make_config(rope_scaling={"type": "yarn", "factor": 2.0})
    assert cfg.rope_scaling["original_max_position_embeddings"] == cfg.max_position_embeddings


def test_defaults_follow_hf():
    cfg = make_config(num_attention_heads=8)
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 8
    assert make_config(model_type="qwen2").attention_bias is True
    assert make_config(model_type="llama").attention_bias is False
    minimal = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    cfg = ModelConfig.from_hf(minimal)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (10000.0, None, 2048)
    assert ModelConfig.from_hf({**minimal, "eos_token_id": [1, 2]}).eos_token_id == [1, 2]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), ["num_key_value_heads=3", "divisor"]),
        (dict(hidden_size=60, num_attention_heads=8), ["hidden_size=60", "num_attention_heads=8"]),
        (dict(vocab_size=0), ["vocab_size=0", "positive"]),
        (dict(num_hidden_layers=-1), ["num_hidden_layers=-1"]),
        (dict(head_dim=7), ["head_dim=7", "even"]),
        (dict(model_type="gpt2"), ["model_type='gpt2'", "llama", "qwen2"]),
        (dict(model_type="qwen2", attention_bias=False), ["attention_bias=False", "qwen2"]),
        (dict(model_type="mistral", attention_bias=True), ["attention_bias=True", "mistral"]),
        (
            dict(rope_scaling={"rope_type": "su", "factor": 2.0}),
            ["'su'", "linear", "yarn", "llama3", "longrope"],
        ),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), ["short_factor", "long_factor"]),
        (
            dict(
                rope_scaling={
                    "rope_type": "longrope",
                    "original_max_position_embeddings": 32,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                }
            ),
            ["short_factor has 4", "rotary_dim / 2 = 8"],
        ),  # fmt: skip
        (dict(model_type="phi3", attention_bias=True), ["attention_bias=True", "phi3"]),
        (dict(partial_rotary_factor=0.5), ["partial_rotary_factor=0.5", "Phi-3's", "1.0"]),
        (dict(residual_multiplier=0.5), ["residual_multiplier", "Granite's", "model_type='llama'"]),
        (dict(model_type="granite", logits_scaling=0.0), ["logits_scaling=0.0", "> 0"]),
        (
            dict(model_type="phi3", partial_rotary_factor=0.1),
            ["partial_rotary_factor=0.1", "even rotary_dim"],
        ),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["low_freq_factor", "high_freq_factor"]),
        (dict(rope_scaling={"rope_type": "linear"}), ["factor"]),
        (
            dict(rope_scaling={"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
            ["partial_rotary_factor"],
        ),
        (dict(pad_token_id=99), ["pad_token_id=99", "vocab_size"]),
        (dict(rms_norm_eps=0.0), ["rms_norm_eps"]),
        (dict(sliding_window=16), ["sliding_window=16", "Mistral's", "None"]),
        (dict(model_type="mistral", sliding_window=1), ["sliding_window=1", ">= 2"]),
        (dict(hidden_act="gelu_pytorch_tanh"), ["hidden_act='gelu_pytorch_tanh'", "'llama'", "'silu'"]),
        (dict(query_pre_attn_scalar=256), ["Gemma's", "None"]),
        (dict(final_logit_softcapping=30.0), ["final_logit_softcapping=30.0", "Gemma's", "None"]),
        (dict(model_type="gemma3_text", hidden_act="silu"), ["hidden_act='silu'", "gelu_pytorch_tanh"]),
        (
            dict(num_experts=8, num_experts_per_tok=2),
            ["experts' (qwen3_moe", "dense MLP", "model_type='llama'"],
        ),
        (
            dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8),
            ["0 < num_experts_per_tok <= num_experts"],
        ),
        (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2), ["moe_intermediate_size > 0"]),
        (
            dict(
                model_type="qwen3_moe",
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                mlp_only_layers=(2,),
            ),
            ["mlp_only_layers=[2]", "[0, 2)"],
        ),
        (
            dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
            ["intermediate_size wide"],
        ),
        (  # Qwen2-MoE without its shared expert, and one on a family that has none
            dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
            ["shared_expert_intermediate_size=0", "Qwen2-MoE's sparse layers have a shared expert"],
        ),
        (
            dict(
                model_type="qwen3_moe",
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=8,
            ),  # fmt: skip
            ["the other mixtures of experts have none (0)"],
        ),
        (
            dict(shared_expert_intermediate_size=8),
            ["shared_expert_intermediate_size are the mixtures", "dense MLP"],
        ),
    ],
)
def test_validation_names_field_and_fix(overrides, words):
    with pytest.raises(ValueError) as e:
        make_config(**overrides)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(use_sliding_window=True), ["sliding"]),
        (dict(hidden_act="gelu"), ["hidden_act", "silu"]),
        (dict(mlp_bias=True), ["mlp_bias"]),
        (dict(architectures=["LlamaForSequenceClassification"]), ["LlamaForCausalLM"]),
        (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), ["gemma", "llama", "qwen3"]),
        (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), ["per-layer"]),
    ],
)
def test_from_hf_rejects_features_we_lack(changes, words):
    _rejects(make_config(), changes, words)


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(attn_logit_softcapping=-1.0), ["attn_logit_softcapping=-1.0", "> 0"]),
        (dict(use_bidirectional_attention=True), ["use_bidirectional_attention"]),
        (dict(hidden_activation="gelu"), ["hidden_act='gelu'", "gelu_pytorch_tanh"]),
    ],
)
def test_from_hf_rejects_what_gemma3_has_and_we_lack(changes, words):
    _rejects(make_config(**CONFIGS["gemma3-gqa2-tied-window-localrope"]), changes, words)


def test_gemma3_configs_on_the_hub_read_as_transformers_reads_them():
    """Gemma-3-1B's config.json spelling (flat rope_theta, rope_local_base_freq, sliding_window_pattern,
    no layer_types): five sliding layers of every six, theta 1e4 there and 1e6 in the full ones."""
    d = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    }  # fmt: skip
    cfg = ModelConfig.from_hf(d)
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**d)
    assert list(cfg.layer_types) == list(hf.layer_types) and cfg.layer_types.count("full_attention") == 4
    assert (cfg.rope_theta, cfg.local().rope_theta, cfg.rope_type) == (1e6, 1e4, "default")
    assert cfg.tie_word_embeddings and cfg.attention_scale == 1 / 16 and cfg.context_limit == 32768
    assert [cfg.window_at(i) for i in range(6)] == [512] * 5 + [None]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def _rejects(base: ModelConfig, changes: dict, words: list[str]) -> None:
    d = {**base.to_hf(), **changes}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(d)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "changes, window",
    [
        (dict(sliding_window=16), 16),  # Mistral v0.1's layout: every layer attends to the last 16
        (dict(max_position_embeddings=32768, sliding_window=...), 4096),  # ...: no key (MistralConfig's)
        (dict(sliding_window=None), None),  # v0.2 on
        (dict(sliding_window=64), None),  # a window covering every position is none
    ],
)
def test_a_mistral_window_is_kept_and_holds_nothing(changes, window):
    """The window is kept (and written back), every layer's (`window_at`); the decoder and the engine
    attend to it, so the context is the model's whole."""
    d = {**make_config(model_type="mistral").to_hf(), **changes}
    cfg = ModelConfig.from_hf({k: v for k, v in d.items() if v is not ...})
    assert cfg.sliding_window == window and cfg.to_hf()["sliding_window"] == window
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert [cfg.window_at(i) for i in range(cfg.num_hidden_layers)] == [window] * cfg.num_hidden_layers
    limit = cfg.max_position_embeddings
    assert cfg.context_limit == limit and cfg.context(None) == limit and cfg.context(limit) == limit


def test_moe_configs_on_the_hub_read_as_their_models():
    """Qwen3-30B-A3B's, OLMoE-1B-7B-0924's, Mixtral-8x7B's, granite-3.1-1b-a400m's and Qwen1.5-MoE-A2.7B's
    config.json as the Hub ships them: every layer sparse, the experts' count, choices, width and
    renormalizing read, and the parameters they make (on the meta device) the published totals: 30.5B, 6.9B,
    46.7B, 1.3B and 14.3B."""
    import torch

    from tailrace.model import CausalLM

    qwen = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, head_dim=128,
                hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
                mlp_only_layers=[], decoder_sparse_step=1, moe_intermediate_size=768, norm_topk_prob=True,
                num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                num_key_value_heads=4, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1e6, sliding_window=None,
                tie_word_embeddings=False, use_sliding_window=False, vocab_size=151936)  # fmt: skip
    olmoe = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", attention_bias=False, clip_qkv=None,
                 eos_token_id=50279, hidden_size=2048, intermediate_size=1024, max_position_embeddings=4096,
                 norm_topk_prob=False, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
                 num_hidden_layers=16, num_key_value_heads=16, pad_token_id=1, rms_norm_eps=1e-5,
                 rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False, vocab_size=50304)  # fmt: skip
    mixtral = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                   intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32,
                   num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8,
                   rms_norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=0.02, sliding_window=None,
                   tie_word_embeddings=False, vocab_size=32000)  # fmt: skip
    # Qwen1.5-MoE-A2.7B's: a shared expert beside each layer's 60 (its config.json reads no qkv_bias: True)
    qwen2 = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", bos_token_id=151643,
                 decoder_sparse_step=1, eos_token_id=151643, hidden_act="silu", hidden_size=2048,
                 intermediate_size=5632, max_position_embeddings=8192, max_window_layers=21, moe_intermediate_size=1408,
                 norm_topk_prob=False, num_attention_heads=16, num_experts=60, num_experts_per_tok=4,
                 num_hidden_layers=24, num_key_value_heads=16, output_router_logits=False, rms_norm_eps=1e-6,
                 rope_theta=1e6, router_aux_loss_coef=0.001, shared_expert_intermediate_size=5632,
                 sliding_window=32768, tie_word_embeddings=False, use_sliding_window=False,
                 vocab_size=151936)  # fmt: skip
    granite = dict(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", attention_multiplier=0.015625,
                   embedding_multiplier=12.0, hidden_size=1024, intermediate_size=512, logits_scaling=6.0,
                   max_position_embeddings=131072, num_attention_heads=16, num_experts_per_tok=8,
                   num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, residual_multiplier=0.22,
                   rms_norm_eps=1e-6, rope_theta=10000000.0, tie_word_embeddings=True, vocab_size=49155)  # fmt: skip
    for d, total, (E, k, width, norm) in (
        (qwen, 30.53e9, (128, 8, 768, True)),
        (olmoe, 6.92e9, (64, 8, 1024, False)),
        (mixtral, 46.70e9, (8, 2, 14336, True)),
        (granite, 1.335e9, (32, 8, 512, True)),
        (qwen2, 14.32e9, (60, 4, 1408, False)),
    ):
        cfg = ModelConfig.from_hf(d)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (
            E,
            k,
            width,
            norm,
        )
        assert all(cfg.moe_at(i) for i in range(cfg.num_hidden_layers))
        with torch.device("meta"):
            assert CausalLM(cfg).num_parameters() == pytest.approx(total, rel=2e-3)
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        ModelConfig.from_hf({**olmoe, "clip_qkv": 8.0})
