"""Both backends are pinned to `CausalLM.forward` over whole sequences: same logits, same KV-cache
writes (the k/v of that forward, after RoPE)."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import ckernel
from tailrace.engine.backends import select
from tailrace.engine.backends.cpu_kernels import KernelAttentionBackend, KernelBackend
from tailrace.engine.backends.linear import packing_supported
from tailrace.engine.backends.torch_ref import TorchBackend
from tests.engine.engine_helpers import (
    forward_pieces,
    paged_cache,
    read_kv,
    reference_kv,
    tiny_model,
    write_kv,
)

# Phi-3.5's LongRoPE, its short range 128 of 256 positions: cos and sin scaled by sqrt(1 + ln 2 / ln 128)
LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 128,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [2.0] * 8,
}  # fmt: skip
CONFIGS = {
    "llama": {},
    "llama-bias-mha": dict(attention_bias=True, num_key_value_heads=4),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3-tied": dict(model_type="qwen3", tie_word_embeddings=True),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    ),  # fmt: skip
    # OLMo3: the sliding layer rotates by its own table (theta 1000), the full one by YaRN's
    "olmo3-local-rope": dict(
        model_type="olmo3",
        layer_types=("sliding_attention", "full_attention"),
        local_rope={"rope_theta": 1000.0},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),  # fmt: skip
    "smollm3-norope-first": dict(model_type="smollm3", no_rope_layers=(0, 1)),
    # Gemma 2: Gemma 3's without q/k norms, its score and logit softcaps small enough to bite
    "gemma2-softcap": dict(
        model_type="gemma2", sliding_window=10, attn_logit_softcapping=1.0, final_logit_softcapping=2.0
    ),  # fmt: skip
    # windows shorter than the sequences (up to 47 tokens; 10 not a multiple of the block size)
    "mistral-window": dict(model_type="mistral", sliding_window=10),
    # Gemma 3: norms before and after, scaling by 1 + w; per-head q/k norms; GeGLU; a sliding layer (its own
    # theta) and a full one
    "gemma3-window": dict(
        model_type="gemma3_text",
        sliding_window=10,
        layer_types=("sliding_attention", "full_attention"),
        local_rope={"rope_theta": 1e4},
        rope_theta=1e6,
        query_pre_attn_scalar=24,
    ),  # fmt: skip
    # mixtures of experts: Qwen3-MoE's (a dense layer beside a sparse one) and OLMoE's (whole-width q/k norms)
    "qwen3moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        mlp_only_layers=(1,),
    ),  # fmt: skip
    "olmoe": dict(model_type="olmoe", num_experts=5, num_experts_per_tok=2),
    # Qwen2-MoE's: biased q/k/v, a sparse layer with its shared expert beside a dense one
    "qwen2moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=40,
        mlp_only_layers=(1,),
    ),  # fmt: skip
    "granitemoe": dict(
        model_type="granitemoe",
        num_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=6.0,
    ),  # fmt: skip
    "mixtral-window": dict(
        model_type="mixtral", num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, sliding_window=10
    ),
    "phi3-longrope": dict(model_type="phi3", rope_scaling=LONGROPE),
    "phi3-partial": dict(model_type="phi3", partial_rotary_factor=0.75),  # Phi-4-mini: 12 of 16 dims rotate
    "llama3-rope": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
}


def decode(backend, tokens, positions, cache, rows, chunks):
    """A decode-only step; an int `chunks` S = one chunk over all rows."""
    if isinstance(chunks, int):
        chunks = [(0, tokens.shape[0], chunks)]
    return backend.forward(tokens, positions, cache, rows, chunks)


def skip_without_kernel(attention: str) -> None:
    if attention == "kernel" and ckernel.load() is None:  # no C compiler here: the torch paths still run
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(
    "attention,packed", [("kernel", None), ("bmm", False), ("bmm", True), ("sdpa", None)]
)
@torch.inference_mode()
def test_decode_matches_model_forward(name, attention, packed):
    skip_without_kernel(attention)
    model = tiny_model(3, **CONFIGS[name])
    B, max_context = 5, 96
    backend = select(attention, model, max_context, torch.float32)(
        model, packed=packed and packing_supported(torch.float32)
    )
    lens = [7, 30, 1, 19, 44]
    ref_cache, cache = (
        paged_cache(model, B + 2, max_context),
        paged_cache(model, B + 2, max_context),
    )  # one layout
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.config.vocab_size, (B, max(lens) + 3), generator=g)
    for b, n in enumerate(lens):  # prompts into rows 1..B; the reference holds the whole sequences
        write_kv(cache, b + 1, reference_kv(model, toks[b : b + 1, :n]))
        write_kv(ref_cache, b + 1, reference_kv(model, toks[b : b + 1, : n + 3]))
    pos = torch.tensor(lens)
    for step in range(3):
        # one chunk, then rows cut into chunks that each attend only as far as their longest row, and
        # (with their lowest position, as the engine plans them) a windowed layer from its window's start
        cuts = [(0, 2), (2, 3), (3, B)]
        chunks = (
            int(pos.max()) + 1
            if step == 0
            else [
                (lo, hi, int(pos[lo:hi].max()) + 1, *([int(pos[lo:hi].min())] if step == 2 else []))
                for lo, hi in cuts
            ]
        )
        x = toks[torch.arange(B), pos]
        ref = torch.stack([model(toks[b : b + 1, : int(pos[b]) + 1])[0, -1] for b in range(B)])
        got = decode(backend, x, pos, cache, slice(1, B + 1), chunks)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        pos = pos + 1
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(cache.k[layer], ref_cache.k[layer], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache.v[layer], ref_cache.v[layer], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float32])  # a bf16 model's cache in either dtype
@pytest.mark.parametrize("B", [3, 12])  # upcast fp32 attention at small batches, bf16 GEMMs above
@pytest.mark.parametrize(
    "attention,packed", [("kernel", None), ("bmm", False), ("bmm", True), ("sdpa", None)]
)
@pytest.mark.parametrize("name", ["llama", "gemma2-softcap"])  # Gemma 2: scores capped, in every path
@torch.inference_mode()
def test_bf16_decode_close_to_model_forward(attention, packed, B, kv, name):
    skip_without_kernel(attention)
    model = tiny_model(4, **CONFIGS[name]).to(torch.bfloat16)
    backend = select(attention, model, 64, kv)(model, packed=packed and packing_supported(torch.bfloat16))
    cache = paged_cache(model, B, 64, dtype=kv)
    toks = torch.randint(0, model.config.vocab_size, (B, 20), generator=torch.Generator().manual_seed(1))
    write_kv(cache, 0, reference_kv(model, toks[:, :12]))  # the model's bf16 prompt k/v, held in `kv`
    pos = torch.full((B,), 12)
    ref = model(toks[:, :13])[:, 12].float()
    got = decode(backend, toks[:, 12], pos, cache, slice(0, B), [(0, 1, 13), (1, B, 13)]).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize(
    "dtype,model_type",
    [
        (torch.float32, "llama"),
        (torch.bfloat16, "llama"),
        (torch.bfloat16, "olmo2"),
        (torch.bfloat16, "smollm3"),
        (torch.bfloat16, "phi3"),
        (torch.bfloat16, "phi3-partial"),
        (torch.bfloat16, "granite"),
        (torch.bfloat16, "gemma3"),
        (torch.bfloat16, "gemma2"),
    ],
)
@torch.inference_mode()
def test_mixed_prefill_and_decode_step_matches_model_forward(dtype, model_type):
    """Decode rows and prefill pieces (a whole prompt, and the second chunk of another) in one step; in
    bf16 on OLMo2's layout too (its norms scale in fp32 before rounding)."""
    extra = {
        "smollm3": dict(no_rope_layers=(1, 0)), "phi3": dict(rope_scaling=LONGROPE),
        "phi3-partial": dict(partial_rotary_factor=0.75),
        "granite": {k: v for k, v in CONFIGS["granite"].items() if k != "model_type"},
        "gemma3": {**{k: v for k, v in CONFIGS["gemma3-window"].items() if k != "model_type"}, "sliding_window": 8},
    }.get(model_type, {})  # fmt: skip
    extra |= {"gemma2": dict(sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)}.get(
        model_type, {}
    )
    family = {"gemma3": "gemma3_text"}.get(model_type, model_type.split("-")[0])
    model = tiny_model(5, model_type=family, **extra).to(dtype)
    backend = select("auto", model, 64, dtype)(model)
    V = model.config.vocab_size
    toks = torch.randint(0, V, (4, 30), generator=torch.Generator().manual_seed(2))
    cache = paged_cache(model, 5, 64)
    # rows 0, 1 decode from position 9 and 14; row 3 has 6 tokens prefilled
    for row, n in ((0, 9), (1, 14), (3, 6)):
        write_kv(cache, row, reference_kv(model, toks[row : row + 1, :n]))
    pos = torch.tensor([9, 14])
    ref_dec = [model(toks[0:1, :10])[0, -1], model(toks[1:2, :15])[0, -1]]
    ref_a = model(toks[2:3, :11])[0, -1]  # whole prompt into row 2
    ref_b = model(toks[3:4, :13])[0, -1]  # chunk 2 of row 3
    tokens = torch.cat([torch.stack([toks[0, 9], toks[1, 14]]), toks[2, :11], toks[3, 6:13]])
    positions = torch.cat([pos, torch.arange(11), torch.arange(6, 13)])
    want = torch.tensor([0, 1, 2 + 10, 2 + 11 + 6])
    got = backend.forward(
        tokens, positions, cache, slice(0, 2), [(0, 1, 10), (1, 2, 15)], [(2, 0, 11), (3, 6, 7)], want
    ).float()
    ref = torch.stack([ref_dec[0], ref_dec[1], ref_a, ref_b]).float()
    tol = 2e-5 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (got - ref).abs().max() < tol
    for r, n in ((0, 10), (1, 15), (2, 11), (3, 13)):
        ref_k = reference_kv(model, toks[r : r + 1, :n])
        for layer in range(model.config.num_hidden_layers):
            want_k = ref_k[layer][0][0].float()  # bf16: within 5% of k's own scale (not the logits')
            k_tol = 2e-5 if dtype == torch.float32 else 0.05 * float(want_k.abs().max())
            assert (read_kv(cache, layer, r, n)[0].float() - want_k).abs().max() < k_tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_short_pieces_attend_together_as_each_alone(dtype, monkeypatch):
    """Speculation's drafts are short prefill pieces: the torch backend attends them in one batched call
    (padded to the longest), a long piece between them on its own, and every token's logits are the
    model's, and those of the one-piece-at-a-time path."""
    from tailrace.engine.backends import torch_ref

    model = tiny_model(7, num_key_value_heads=2).to(dtype)
    V = model.config.vocab_size
    toks = torch.randint(0, V, (5, 64), generator=torch.Generator().manual_seed(4))
    cache = paged_cache(model, 5, 64, block_size=4)
    done = {0: 12, 1: 20, 2: 9, 3: 3, 4: 30}  # tokens already in each row's cache
    for row, n in done.items():
        write_kv(cache, row, reference_kv(model, toks[row : row + 1, :n]))
    # rows 0, 1 decode; pieces: row 2 five tokens (a draft), row 3 forty (a prompt chunk), row 4 two
    pieces = [(2, 9, 5), (3, 3, 40), (4, 30, 2)]
    tokens = torch.cat([toks[0, 12:13], toks[1, 20:21]] + [toks[r, s : s + n] for r, s, n in pieces])
    positions = torch.cat([torch.tensor([12, 20])] + [torch.arange(s, s + n) for _, s, n in pieces])
    want = torch.arange(tokens.shape[0])
    chunks = [(0, 1, 13), (1, 2, 21)]
    ref = torch.cat(
        [model(toks[0:1, :13])[0, -1:], model(toks[1:2, :21])[0, -1:]]
        + [model(toks[r : r + 1, : s + n])[0, s:] for r, s, n in pieces]
    ).float()

    def step(short: int) -> torch.Tensor:
        monkeypatch.setattr(torch_ref, "SHORT_PIECE", short)
        backend = TorchBackend(model, 64, cache.dtype)
        return backend.forward(tokens, positions, cache, slice(0, 2), chunks, pieces, want).float()

    together, alone = step(32), step(0)
    tol = 2e-5 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (together - ref).abs().max() < tol
    assert (together - alone).abs().max() <= (
        1e-5 if dtype == torch.float32 else 0.02 * float(ref.abs().max())
    )


@pytest.mark.parametrize("attention", ["kernel", "bmm", "sdpa"])
@torch.inference_mode()
def test_bf16_prefill_then_decode_close_to_bf16_forward(attention):
    """A bf16 model's cache is bf16; prefill then token-by-token decode stay within bf16 noise."""
    skip_without_kernel(attention)
    model = tiny_model(6, num_key_value_heads=2).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = model(ids)
    cache = paged_cache(model, 2, 16, block_size=4)
    assert cache.dtype == torch.bfloat16
    backend = select(attention, model, 16, cache.dtype)(model)
    forward_pieces(backend, cache, [(0, 0, ids[0, :8]), (1, 0, ids[1, :8])])
    for t in range(8, 16):
        out = decode(backend, ids[:, t], torch.full((2,), t), cache, slice(0, 2), t + 1)
        assert (out.float() - ref[:, t].float()).abs().max() < 0.05 * ref.abs().max().item()


def test_select_resolves_attention_to_one_backend_class():
    model, f32, bf16 = tiny_model(), torch.float32, torch.bfloat16
    for attention in ("bmm", "sdpa"):
        backend = select(attention, model, 32, f32)(model)
        assert type(backend) is TorchBackend and backend.name == attention and backend.kernel is None
    with pytest.raises(ValueError, match="use 'auto', 'kernel', 'bmm' or 'sdpa'"):
        select("flash", model, 32, f32)
    if ckernel.load() is None:
        assert select("auto", model, 32, f32)(model).name == "bmm"
        return
    assert type(select(None, model, 32, f32)(model)) is KernelBackend  # one torch thread (conftest)
    half = tiny_model().to(bf16)
    assert type(select("auto", half, 32, f32)(half)) is KernelAttentionBackend  # fp32 cache, bf16 model
    assert type(select("auto", half, 32, torch.float16)(half)) is TorchBackend  # a cache the kernels lack
    torch.set_num_threads(2)
    try:
        assert select("auto", model, 32, f32)(model).name == "bmm"
        assert select("kernel", model, 32, f32)(model).name == "kernel"
    finally:
        torch.set_num_threads(1)
