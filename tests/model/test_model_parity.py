"""fp32 logits parity with transformers' LlamaForCausalLM / Qwen2ForCausalLM (max abs diff <= 1e-4):
full forward both ways through checkpoints, and cached decoding against HF's full-forward logits."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import CONFIGS, TOL, hf_from_ours, make_config, max_diff, random_model, randomize_

from tailrace.model import CausalLM, ModelConfig, load_pretrained

T = 24


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, HF reference logits for `ids`, ids) for one config."""
    cfg = make_config(**CONFIGS[request.param])
    ours = random_model(cfg, seed=len(request.param))
    hf = hf_from_ours(ours, tmp_path_factory.mktemp(request.param))
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.model_type]
    ids = torch.randint(0, cfg.vocab_size, (3, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits
    return ours, ref, ids


def test_full_forward_matches_hf(pair):
    ours, ref, ids = pair
    with torch.no_grad():
        assert max_diff(ours(ids), ref) <= TOL


def test_prefill_then_token_by_token_decode_matches_hf(pair):
    ours, ref, ids = pair
    prompt = 7
    with torch.inference_mode():
        cache = ours.new_cache(num_rows=2, max_len=T + 4)
        out = ours(ids[:1, :prompt], torch.arange(prompt)[None], cache, slice(1, 2))
        assert max_diff(out[0], ref[0, :prompt]) <= TOL
        for t in range(prompt, T):
            out = ours(ids[:1, t : t + 1], torch.tensor([[t]]), cache, slice(1, 2))
            assert max_diff(out[0, 0], ref[0, t]) <= TOL, f"position {t}"


@pytest.mark.parametrize("rows_kind", ["slice", "tensor"])
def test_batched_decode_at_different_positions_matches_hf(pair, rows_kind):
    """Three sequences of different prompt lengths: one right-padded prefill, then decode steps where
    every row sits at its own position, with one two-token step (T > 1, as a speculative verify)."""
    ours, ref, ids = pair
    lens = torch.tensor([5, 9, 3])
    rows = slice(2, 5) if rows_kind == "slice" else torch.tensor([5, 0, 3])
    width = int(lens.max())
    padded = ids[:, :width].clone()
    padded[torch.arange(width)[None, :] >= lens[:, None]] = 0  # pad id; these tokens write garbage k/v
    with torch.inference_mode():
        cache = ours.new_cache(num_rows=6, max_len=T + 8)
        out = ours(padded, torch.arange(width).expand(3, width), cache, rows)
        for b in range(3):
            assert max_diff(out[b, : lens[b]], ref[b, : lens[b]]) <= TOL
        cur = lens.clone()
        for step in range(10):
            n = 2 if step == 4 else 1
            pos = cur[:, None] + torch.arange(n)
            out = ours(ids.gather(1, pos), pos, cache, rows)
            assert max_diff(out, ref.gather(1, pos[..., None].expand(-1, -1, ref.shape[-1]))) <= TOL, (
                f"step {step}"
            )
            cur += n


def test_chunked_prefill_matches_hf(pair):
    ours, ref, ids = pair
    with torch.inference_mode():
        cache = ours.new_cache(num_rows=3, max_len=T)
        a = ours(ids[:, :10], torch.arange(10).expand(3, 10), cache)
        b = ours(ids[:, 10:T], torch.arange(10, T).expand(3, T - 10), cache)
    assert max_diff(torch.cat([a, b], 1), ref) <= TOL


def test_hf_saved_checkpoint_loads_and_matches(tmp_path):
    """HF builds and saves (its own config.json and naming, tied and untied); we load and agree."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    hf_cfgs = [
        LlamaConfig(
            vocab_size=40,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            tie_word_embeddings=True,
            max_position_embeddings=64,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        ),
        Qwen2Config(
            vocab_size=40,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            max_position_embeddings=64,
            rope_theta=777.0,
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
