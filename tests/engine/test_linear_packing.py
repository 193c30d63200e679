"""Packed (oneDNN) GEMMs run at a bounded set of row counts: oneDNN keeps a compiled kernel for every
input shape it meets, so an engine whose batches took every row count grew without end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailrace.engine.backends.linear import Linear, packing_supported, padded_rows


def test_padded_rows_hand_checked():
    assert [padded_rows(m) for m in (1, 5, 8, 9, 16, 17, 63, 64, 65, 129, 130, 513, 1025)] == [
        1, 5, 8, 16, 16, 24, 64, 64, 72, 144, 144, 576, 1152,
    ]  # fmt: skip


def test_padded_rows_cover_every_batch_with_few_shapes_and_little_padding():
    shapes = {padded_rows(m) for m in range(1, 2049)}
    assert len(shapes) <= 60  # 1..8, then ~8 per doubling
    for m in range(1, 2049):
        r = padded_rows(m)
        assert r >= m and (r - m <= 7 if m <= 64 else (r - m) / m <= 1 / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 9, 49, 64, 65, 130])
def test_padded_packed_linear_matches_plain(dtype, m):
    if not packing_supported(dtype):
        pytest.skip(f"no oneDNN packed linear for {dtype} here")
    g = torch.Generator().manual_seed(m)
    w, b = torch.randn(40, 24, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    x, r = torch.randn(m, 24, generator=g).to(dtype), torch.randn(m, 40, generator=g).to(dtype)
    lin = Linear(w, b, packed=True)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    y = lin(x, True)
    assert y.shape == (m, 40) and y.is_contiguous()
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)
    z = lin.add(x, r, True)
    assert z.shape == (m, 40)
    torch.testing.assert_close(z.float(), (r + F.linear(x, w, b)).float(), atol=tol, rtol=tol)


@torch.inference_mode()
def test_a_version_holds_its_weights_once_and_a_load_updates_its_fused_gemms():
    """The fused q/k/v and gate/up GEMMs run on the model's own weights (row blocks of one tensor), the
    LM head on the model's head: no copy (0.84 GiB a bf16 version of a 0.6B model had). A weight load,
    which copies into them, gives the tokens of an engine built on the new weights."""
    from tailrace.engine import TailraceEngine
    from tests.engine.engine_helpers import req, tiny_model

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    model = tiny_model(2, model_type="qwen3", attention_bias=True)
    engine = TailraceEngine(model, num_slots=4, attention="bmm")
    w, m = engine._versions[0].w, engine._versions[0].model
    for L, layer in zip(w.layers, m.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        assert all(same(L.qkv.w, p) for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
        assert all(same(L.qkv.b, p) for p in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
        assert same(L.gate_up.w, mlp.gate_proj.weight) and same(L.gate_up.w, mlp.up_proj.weight)
    assert same(w.lm_head.w, m.lm_head.weight)
    new = tiny_model(5, model_type="qwen3", attention_bias=True)
    engine.load_weights(new.state_dict(), 0)
    reqs = [req(f"r{i}", 3 + i, 12, seed=i, temperature=1.0) for i in range(4)]
    got = [(r.token_ids, r.logprobs) for r in engine.generate(reqs)]
    want = [
        (r.token_ids, r.logprobs) for r in TailraceEngine(new, num_slots=4, attention="bmm").generate(reqs)
    ]
    assert got == want


def test_weights_packed_at_every_batch_keep_no_plain_copy(monkeypatch):
    """fp32 models from hidden 512 (bf16 ones always) run every GEMM on packed weights, so no Linear
    keeps a reference to W (an int8 drafter's dequantized W is then freed); the engine's tokens are
    those of an engine that runs plain GEMMs."""
    from tailrace.engine import TailraceEngine
    from tailrace.engine.backends import weights
    from tests.engine.engine_helpers import req, tiny_model

    if not packing_supported(torch.float32):
        pytest.skip("no oneDNN packed GEMMs here")
    model = tiny_model(2, model_type="qwen3")
    reqs = [req(f"r{i}", 3 + i, 12, seed=i, temperature=1.0) for i in range(4)]
    kept = TailraceEngine(model, num_slots=4, attention="bmm")
    assert kept._versions[0].w.layers[0].qkv.w is not None  # tiny: plain GEMMs below 48 rows
    monkeypatch.setattr(weights, "PACKED_FP32_MIN_HIDDEN", 0)
    packed = TailraceEngine(model, num_slots=4, attention="bmm", prefill_tokens=16)
    w = packed._versions[0].w
    assert all(lin.w is None for L in w.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
    assert w.lm_head.w is None
    got = [(r.token_ids, r.logprobs) for r in packed.generate(reqs)]
    want = [(r.token_ids, r.logprobs) for r in kept.generate(reqs)]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y)) < 1e-4
    # a prompt longer than the prefill chunk, alone: its first steps want no logits (an LM head call on
    # no rows, where W itself is gone, raised)
    long = [req("long", 40, 4, seed=9, temperature=1.0)]
    assert packed.generate(long)[0].token_ids == kept.generate(long)[0].token_ids
