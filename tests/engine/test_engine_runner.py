"""`DecodeRunner` is pinned to `CausalLM.forward`: same logits, same KV-cache writes."""
from __future__ import annotations

import pytest
import torch

from tailrace.engine.linear import packing_supported
from tailrace.engine.runner import DecodeRunner

from tests.engine.engine_helpers import tiny_model

CONFIGS = {
    "llama": {},
    "llama-bias-mha": dict(attention_bias=True, num_key_value_heads=4),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("attention,packed", [("bmm", False), ("bmm", True), ("sdpa", None)])
@torch.inference_mode()
def test_decode_matches_model_forward(name, attention, packed):
    model = tiny_model(3, **CONFIGS[name])
    B, max_len = 5, 96
    runner = DecodeRunner(model, max_len, attention, packed=packed and packing_supported(torch.float32))
    lens = [7, 30, 1, 19, 44]
    ref_cache, cache = model.new_cache(B + 2, max_len), model.new_cache(B + 2, max_len)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.config.vocab_size, (B, max(lens) + 3), generator=g)
    for b, n in enumerate(lens):  # prompts into rows 1..B of both caches
        for c in (ref_cache, cache):
            model(toks[b:b + 1, :n], None, c, slice(b + 1, b + 2))
    pos = torch.tensor(lens)
    for step in range(3):
        x = toks[torch.arange(B), pos]
        ref = model(x[:, None], pos[:, None], ref_cache, slice(1, B + 1))[:, 0]
        got = runner.decode(x, pos, cache, slice(1, B + 1), int(pos.max()))
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        pos = pos + 1
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(cache.k[layer], ref_cache.k[layer], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.v[layer], ref_cache.v[layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("B", [3, 12])  # upcast fp32 attention at small batches, bf16 GEMMs above
@pytest.mark.parametrize("attention,packed", [("bmm", False), ("bmm", True), ("sdpa", None)])
@torch.inference_mode()
def test_bf16_decode_close_to_model_forward(attention, packed, B):
    model = tiny_model(4).to(torch.bfloat16)
    runner = DecodeRunner(model, 64, attention, packed=packed and packing_supported(torch.bfloat16))
    ref_cache, cache = model.new_cache(B, 64), model.new_cache(B, 64)
    toks = torch.randint(0, model.config.vocab_size, (B, 20), generator=torch.Generator().manual_seed(1))
    for c in (ref_cache, cache):
        model(toks[:, :12], None, c, slice(0, B))
    pos = torch.full((B,), 12)
    ref = model(toks[:, 12:13], pos[:, None], ref_cache, slice(0, B))[:, 0].float()
    got = runner.decode(toks[:, 12], pos, cache, slice(0, B), 12).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
