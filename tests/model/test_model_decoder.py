"""CausalLM and KVCache behaviour beyond HF parity: init, training, autocast, cache rows, errors."""

from __future__ import annotations

import pytest
import torch
from model_helpers import CONFIGS, TOL, hf_from_ours, make_config, max_diff, random_model

from tailrace.model import CausalLM, KVCache


def test_parameter_names_are_hf_names():
    model = CausalLM(make_config(model_type="qwen2", num_hidden_layers=1, tie_word_embeddings=True))
    names = set(model.state_dict())
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    } <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert not any("rotary" in n for n in names)  # rope tables are not persistent


def test_from_config_initializes_like_hf():
    cfg = make_config(pad_token_id=3, hidden_size=128, attention_bias=True)
    a, b = CausalLM.from_config(cfg, seed=1), CausalLM.from_config(cfg, seed=1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    w = a.model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 2e-3 and abs(w.mean().item()) < 2e-3
    assert torch.all(a.model.layers[1].post_attention_layernorm.weight == 1)
    assert torch.all(a.model.layers[0].self_attn.q_proj.bias == 0)
    assert torch.all(a.model.embed_tokens.weight[3] == 0)
    assert not torch.equal(CausalLM.from_config(cfg, seed=2).lm_head.weight, a.lm_head.weight)


def test_num_parameters_counts_tied_weight_once():
    untied = CausalLM(make_config())
    tied = CausalLM(make_config(tie_word_embeddings=True))
    assert untied.num_parameters() - tied.num_parameters() == 53 * 64
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_training_step_updates_every_parameter():
    model = random_model(make_config(tie_word_embeddings=True, attention_bias=True)).train()
    ids = torch.randint(0, 53, (2, 10))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


def test_bf16_autocast_forward_and_backward():
    model = random_model(make_config(num_key_value_heads=2))
    ids = torch.randint(0, 53, (2, 12))
    with torch.no_grad():
        ref = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert max_diff(out, ref) < 0.1 * ref.abs().max().item()
    assert all(p.grad is not None for p in model.parameters())


def test_bf16_model_decodes_close_to_fp32():
    model = random_model(make_config(num_key_value_heads=2))
    bf = random_model(model.config).to(torch.bfloat16)
    ids = torch.randint(0, 53, (2, 16))
    with torch.inference_mode():
        ref = bf(ids)
        cache = bf.new_cache(2, 16)
        assert cache.dtype == torch.bfloat16
        bf(ids[:, :8], torch.arange(8).expand(2, 8), cache)
        for t in range(8, 16):
            out = bf(ids[:, t : t + 1], torch.full((2, 1), t), cache)
            assert max_diff(out[:, 0], ref[:, t]) < 0.05 * ref.abs().max().item()


def test_explicit_positions_on_training_path_shift_rope():
    """positions=None is arange(T); explicit positions are honoured. RoPE is relative: a uniform shift
    changes nothing (up to rounding), a gap changes the logits after it."""
    model = random_model(make_config())
    ids = torch.randint(0, 53, (1, 10))
    gap = torch.cat([torch.arange(5), torch.arange(20, 25)])[None]
    with torch.no_grad():
        ref = model(ids)
        assert max_diff(model(ids, torch.arange(10)[None]), ref) == 0.0
        assert max_diff(model(ids, torch.arange(30, 40)[None]), ref) <= TOL
        shifted = model(ids, gap)
        assert max_diff(shifted[:, :5], ref[:, :5]) == 0.0 and max_diff(shifted[:, 5:], ref[:, 5:]) > 1e-3


def test_positions_beyond_initial_rope_table_match_hf(tmp_path):
    model = random_model(make_config(num_hidden_layers=1))
    hf = hf_from_ours(model, tmp_path)
    ids = torch.randint(0, 53, (1, 300))  # past max_position_embeddings=64 and the first 256-entry table
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) <= TOL


def test_dynamic_rope_is_rejected_past_its_supported_range():
    model = random_model(make_config(**CONFIGS["qwen2-gqa4-headdim-dynamic"]))
    with pytest.raises(ValueError, match="dynamic"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_kv_cache_shape_and_move_row():
    cache = KVCache(num_layers=2, num_rows=3, num_kv_heads=2, max_len=8, head_dim=4)
    assert [t.shape for t in cache.k + cache.v] == [torch.Size([3, 2, 8, 4])] * 4
    assert all(not t.any() for t in cache.k + cache.v)
    for i, t in enumerate(cache.k + cache.v):
        t[2] = i + 1
    cache.move_row(2, 0)
    assert all(torch.all(t[0] == i + 1) for i, t in enumerate(cache.k + cache.v))
    cache.move_row(1, 0, length=3)
    assert all(
        not t[0, :, :3].any() and torch.all(t[0, :, 3:] == i + 1) for i, t in enumerate(cache.k + cache.v)
    )
    assert cache.nbytes() == 4 * 3 * 2 * 8 * 4 * 4


def test_decoding_continues_after_compacting_rows():
    """The engine's compaction: a sequence moved to another row by move_row decodes on unchanged."""
    model = random_model(make_config(num_key_value_heads=2))
    ids = torch.randint(0, 53, (1, 14))
    with torch.no_grad():
        ref = model(ids)
    with torch.inference_mode():
        cache = model.new_cache(4, 16)
        model(ids[:, :6], torch.arange(6)[None], cache, slice(3, 4))
        cache.move_row(3, 1, length=6)
        for t in range(6, 14):
            out = model(ids[:, t : t + 1], torch.tensor([[t]]), cache, slice(1, 2))
            assert max_diff(out[0, 0], ref[0, t]) <= TOL


def test_cache_works_under_no_grad_and_inference_mode_alike():
    model = random_model(make_config())
    ids = torch.randint(0, 53, (1, 6))
    cache = model.new_cache(1, 8)
    with torch.inference_mode():
        a = model(ids[:, :3], torch.arange(3)[None], cache)
    with torch.no_grad():
        b = model(ids[:, 3:], torch.arange(3, 6)[None], cache)
        ref = model(ids)
    assert max_diff(torch.cat([a, b], 1), ref) <= TOL


def test_cached_call_errors_name_the_fix():
    model = random_model(make_config())
    cache = model.new_cache(4, 8)
    one = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_len=8"):
        model(one, torch.full((2, 1), 8), cache)
    with pytest.raises(ValueError, match="consecutive cache rows"):
        model(one, torch.zeros(2, 1, dtype=torch.long), cache, slice(0, 3))
    with pytest.raises(ValueError, match="one cache row id per sequence"):
        model(one, torch.zeros(2, 1, dtype=torch.long), cache, torch.tensor([0, 1, 2]))
