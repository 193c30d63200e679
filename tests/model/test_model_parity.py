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


def test_past_a_sliding_window_transformers_differs_and_the_decoder_refuses(tmp_path):
    """Within its window a Mistral v0.1 layer attends to every position, as this decoder does (the
    parity tests above); past it transformers attends to the window only, so the decoder refuses such
    a sequence rather than differ."""
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
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = windowed(ids).logits, full(ids).logits
        assert max_diff(ours(ids[:, :16]), a[:, :16]) <= TOL and max_diff(a[:, :16], b[:, :16]) <= TOL
        assert max_diff(a[:, 16:], b[:, 16:]) > 1e-2  # the window is real past position 15
        with pytest.raises(ValueError, match="sliding_window=16"):
            ours(ids)
