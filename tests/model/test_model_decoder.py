"""CausalLM behaviour beyond HF parity: init, training, autocast, positions, RoPE range."""

from __future__ import annotations

import pytest
import torch
from model_helpers import CONFIGS, TOL, hf_from_ours, make_config, max_diff, random_model

from tailrace.model import CausalLM


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


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_eager_attention_equals_sdpa_in_fp32(kv_heads):
    """The CPU bf16 path's attention, run in fp32 where both are exact: causal, heads grouped as HF's
    repeat_kv (query head h reads kv head h // G), the same output and gradients as SDPA."""
    import torch.nn.functional as F

    from tailrace.model.attention import eager_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 17, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, 17, kv_heads, 8, generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(3, 17, 4, 8, generator=g)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    out = eager_attention(q, k, v)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    assert max_diff(out, ref) < 1e-5
    assert all(max_diff(a, b) < 1e-5 for a, b in zip(grads, grads_ref))


def test_bf16_autocast_on_cpu_attends_eagerly_as_accurately_as_sdpa(monkeypatch):
    """Under CPU bf16 autocast, sequences up to EAGER_MAX_T attend eagerly (scores and softmax in fp32,
    as accurate as SDPA's bf16 kernel against the fp32 forward); longer ones, fp32 and CUDA keep SDPA."""
    from tailrace.model import attention

    cpu = torch.device("cpu")
    assert attention.attends_eagerly(attention.EAGER_MAX_T, torch.bfloat16, cpu)
    assert not attention.attends_eagerly(attention.EAGER_MAX_T + 1, torch.bfloat16, cpu)
    assert not attention.attends_eagerly(16, torch.float32, cpu)
    assert not attention.attends_eagerly(16, torch.bfloat16, torch.device("cuda"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.attends_eagerly(16, torch.float32, cpu)  # RoPE makes q fp32; autocast decides
    model = random_model(make_config(num_key_value_heads=2))
    ids = torch.randint(0, 53, (4, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = model(ids).float()
            monkeypatch.setattr(attention, "EAGER_MAX_T", 0)
            sdpa = model(ids).float()
    assert max_diff(eager, sdpa) > 0  # the two paths ran
    assert max_diff(eager, ref) < 1.5 * max_diff(sdpa, ref) + 1e-3


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


@pytest.mark.parametrize("T,window", [(24, 7), (100, 16), (97, 33)])
def test_windowed_attention_equals_sdpa_under_the_window_mask(T, window):
    """The trainer's window-by-window attention (past two windows) against one SDPA over the whole
    sequence under the window's mask, fp64, GQA 2, with gradients."""
    import torch.nn.functional as F

    from tailrace.model.attention import causal_mask, windowed_attention

    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, T, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, T, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, T, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    mask = causal_mask(T, torch.bool, q.device, window)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True, scale=0.3
    ).transpose(1, 2)
    got = windowed_attention(q, k, v, 0.3, window)
    assert (got - want).abs().max() < 1e-12
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        assert (a - b).abs().max() < 1e-12
