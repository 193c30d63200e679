"""fp32 logits parity with transformers' Llama/Mistral/Qwen2/Qwen3ForCausalLM (max abs diff <= 1e-4):
full forward both ways through checkpoints. (Cached decoding is the engine's:
tests/engine/test_engine_hf_parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import (
    CONFIGS,
    TOL,
    hf_from_ours,
    hf_reference,
    make_config,
    max_diff,
    random_model,
    randomize_,
)

from tailrace.model import CausalLM, ModelConfig, load_pretrained

T = 24


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, HF reference logits for `ids`, ids) for one config."""
    return hf_reference(request.param, tmp_path_factory.mktemp(request.param), T)


def test_full_forward_matches_hf(pair):
    ours, ref, ids = pair
    with torch.no_grad():
        assert max_diff(ours(ids), ref) <= TOL


def test_hf_saved_checkpoint_loads_and_matches(tmp_path):
    """HF builds and saves (its own config.json and naming, tied and untied); we load and agree."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    small = dict(
        vocab_size=40, hidden_size=48, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64
    )
    hf_cfgs = [
        LlamaConfig(
            **small,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
        Qwen2Config(
            **small, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=777.0
        ),
        # its default window (4,096) covers the 64 positions: full attention
        MistralConfig(**small, num_attention_heads=4, num_key_value_heads=2),
        # as Qwen3-0.6B's config.json: head_dim explicit and wider than hidden/heads
        Qwen3Config(
            **small,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            max_window_layers=2,
            rope_theta=1e6,
        ),
    ]
    ids = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(3))
    for i, hcfg in enumerate(hf_cfgs):
        torch.manual_seed(i)
        hf = randomize_(AutoModelForCausalLM.from_config(hcfg), seed=i).eval()
        hf.save_pretrained(tmp_path / str(i))
        ours = load_pretrained(tmp_path / str(i))
        assert ours.config.tie_word_embeddings == hcfg.tie_word_embeddings
        with torch.no_grad():
            assert max_diff(ours(ids), hf(ids).logits) <= TOL


def test_old_style_rope_config_json_reads_like_hf(tmp_path):
    """A config.json in the pre-transformers-5 spelling: top-level rope_theta + rope_scaling{type}."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(rope_theta=300.0, rope_scaling={"rope_type": "linear", "factor": 3.0})
    ours = random_model(cfg)
    hf_from_ours(ours, tmp_path)  # writes the checkpoint
    d = json.loads((tmp_path / "config.json").read_text())
    del d["rope_parameters"]
    d["rope_scaling"] = {"type": "linear", "factor": 3.0}
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reloaded = load_pretrained(tmp_path)
    assert reloaded.config.rope_scaling == {"rope_type": "linear", "factor": 3.0}
    assert reloaded.config.rope_theta == 300.0
    ids = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        assert max_diff(reloaded(ids), hf(ids).logits) <= TOL


def test_training_gradients_match_hf(tmp_path):
    cfg = make_config(**CONFIGS["llama-gqa4-bias-llama3"])
    ours = random_model(cfg).train()
    hf = hf_from_ours(ours, tmp_path).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    w = torch.randn(2, 16, cfg.vocab_size)
    (ours(ids) * w).sum().backward()
    (hf(ids).logits * w).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert max_diff(p.grad, hf_grads[name].grad) <= 1e-3, name


def test_rope_variant_changes_logits():
    """The parity tests would pass vacuously if positions never mattered at these lengths."""
    base = make_config()
    ids = torch.randint(0, base.vocab_size, (1, 40))
    logits = {}
    for name, scaling in [
        ("default", None),
        ("linear", {"rope_type": "linear", "factor": 4.0}),
        ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
        ("llama3", CONFIGS["llama-gqa4-bias-llama3"]["rope_scaling"]),
    ]:
        model = random_model(base.replace(rope_scaling=scaling))
        with torch.no_grad():
            logits[name] = model(ids)
    for name in ("linear", "yarn", "llama3"):
        assert max_diff(logits[name], logits["default"]) > 1e-2, name


def test_model_type_cannot_be_mixed_up():
    cfg = ModelConfig.from_hf(make_config(model_type="qwen2").to_hf())
    assert cfg.attention_bias and CausalLM(cfg).model.layers[0].self_attn.o_proj.bias is None


def test_past_a_sliding_window_the_decoder_attends_to_it_as_transformers(tmp_path):
    """A Mistral v0.1 layer attends to its last `sliding_window` positions: within the window that is
    every position (transformers' windowed model and its windowless twin agree), past it the window is
    real (they differ), and the decoder's logits are the windowed model's all along."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    ours = random_model(cfg)
    windowed = hf_from_ours(ours, tmp_path / "windowed")
    d = json.loads((tmp_path / "windowed" / "config.json").read_text())
    assert d["sliding_window"] == 16
    (tmp_path / "full").mkdir()
    for f in (tmp_path / "windowed").iterdir():
        (tmp_path / "full" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "full" / "config.json").write_text(json.dumps({**d, "sliding_window": None}))
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = windowed(ids).logits, full(ids).logits
        assert max_diff(a[:, :16], b[:, :16]) <= TOL
        assert max_diff(a[:, 16:], b[:, 16:]) > 1e-2  # the window is real past position 15
        assert max_diff(ours(ids), a) <= TOL


def test_a_phi3_checkpoint_transformers_wrote_loads_and_longrope_is_held_to_its_short_range(tmp_path):
    """A Phi-3.5-style checkpoint (old-style "su" LongRoPE, fused q/k/v and gate/up) made by transformers
    itself: within original_max_position_embeddings the decoder's logits are transformers' (short factors,
    cos and sin scaled); past it transformers rotates every position by the long factors, the early ones
    included, so the decoder refuses such a sequence rather than differ."""
    from transformers import Phi3Config, Phi3ForCausalLM

    short = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
    hf_cfg = Phi3Config(
        vocab_size=53, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=32,
        rope_scaling={"type": "su", "short_factor": short, "long_factor": [s * 3 for s in short],
                      "original_max_position_embeddings": 32},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = randomize_(Phi3ForCausalLM(hf_cfg), 3).eval()
    hf.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())
    assert names["model_type"] == "phi3"
    ours = load_pretrained(tmp_path)
    assert ours.config.rope_type == "longrope" and ours.config.context_limit == 32
    ids = torch.randint(0, 53, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        within, past = hf(ids[:, :32]).logits, hf(ids).logits
        assert max_diff(ours(ids[:, :32]), within) <= TOL
        assert max_diff(past[:, :32], within) > 1e-2  # the long factors rotate the early positions too
        with pytest.raises(ValueError, match="original_max_position_embeddings=32"):
            ours(ids)
    with pytest.raises(ValueError, match="max_context=33 is past the model's LongRoPE"):
        ours.config.context(33)
    old = {k: v for k, v in ours.config.rope_scaling.items() if k != "rope_type"} | {"type": "yarn"}
    assert (
        ModelConfig.from_hf({**ours.config.to_hf(), "rope_scaling": old}).rope_type == "longrope"
    )  # as Phi3Config


def test_an_olmo3_checkpoint_transformers_wrote_loads_and_attends_to_its_window(tmp_path):
    """OLMo-3's config.json spelling (the older flat `rope_scaling`: YaRN on the full layers; the sliding
    layers' plain RoPE of `rope_theta`; HF's default layer_types, three sliding of every four): the
    decoder's logits are transformers' within the window and past it, where the sliding layers attend to
    the window only."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    hf_cfg = Olmo3Config(
        vocab_size=53, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=16, rope_theta=5e5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = randomize_(Olmo3ForCausalLM(hf_cfg), 3).eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    cfg = ours.config
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention",) and cfg.context_limit == 64
    assert (cfg.rope_type, cfg.local().rope_type, cfg.local().rope_theta) == ("yarn", "default", 5e5)
    assert [cfg.window_at(i) for i in range(4)] == [16, 16, 16, None]
    ids = torch.randint(0, 53, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) <= TOL


GEMMAS = {  # Gemma-3-1B's and Gemma-2-2B's layouts at a small size, as transformers' configs spell them
    "gemma3": dict(  # 5 sliding layers of 6 (window 8), RoPE theta 1e4 there and 1e6 in the full one
        num_hidden_layers=6, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, rope_theta=1e6,
        rope_local_base_freq=1e4,
    ),
    "gemma2": dict(  # sliding (window 8) and full layers alternating; scores capped at 5, logits at 3
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(GEMMAS))
def test_a_gemma_checkpoint_transformers_wrote_loads_and_matches(tmp_path, family):
    """Built and saved by transformers (the norms' zero-centred weights randomized, so 1 + w matters): the
    decoder's logits are transformers' across several windows, in fp32 and, within bf16 rounding, in
    bf16; Gemma 2's against transformers' eager attention (its SDPA attention drops the score cap, which
    Google's and vLLM's apply)."""
    import transformers
    from transformers import AutoModelForCausalLM

    name = {"gemma3": "Gemma3Text", "gemma2": "Gemma2"}[family]
    hf_cfg = getattr(transformers, f"{name}Config")(
        vocab_size=61, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=128,
        sliding_window=8, **GEMMAS[family],
    )  # fmt: skip
    torch.manual_seed(0)
    randomize_(getattr(transformers, f"{family.capitalize()}ForCausalLM")(hf_cfg), 3).save_pretrained(
        tmp_path
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = load_pretrained(tmp_path)
    cfg = ours.config
    n = cfg.num_hidden_layers
    windows = [8] * 5 + [None] if family == "gemma3" else [8, None] * 2
    assert cfg.gemma and cfg.tie_word_embeddings and [cfg.window_at(i) for i in range(n)] == windows
    assert cfg.qk_norm == (family == "gemma3") and cfg.final_logit_softcapping == GEMMAS[family].get(
        "final_logit_softcapping"
    )
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits
        assert max_diff(ours(ids), ref) <= TOL
        low = max_diff(ours.to(torch.bfloat16)(ids), hf.to(torch.bfloat16)(ids).logits)
        assert low <= 0.05 * ref.abs().max().item()
