"""Cached decoding by each backend against transformers' full-forward logits (fp32, max abs diff <= 1e-4),
for every model config of tests/model (llama and qwen2, tied and untied, GQA 1/2/4, every RoPE type)."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import ckernel
from tailrace.engine.backends import select
from tests.engine.engine_helpers import forward_pieces, paged_cache
from tests.model.model_helpers import CONFIGS, TOL, hf_reference, max_diff

T = 24


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, HF reference logits for `ids`, ids) for one config."""
    return hf_reference(request.param, tmp_path_factory.mktemp(request.param), T)


@pytest.fixture(params=["kernel", "bmm", "sdpa"])
def attention(request):
    if request.param == "kernel" and ckernel.load() is None:
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")
    return request.param


def _backend(attention, model, rows, max_context):
    return select(attention, model, max_context, torch.float32)(model), paged_cache(
        model, rows, max_context, 4
    )


@torch.inference_mode()
def test_prefill_then_token_by_token_decode_matches_hf(pair, attention):
    ours, ref, ids = pair
    prompt = 7
    backend, cache = _backend(attention, ours, 2, T + 4)
    out = forward_pieces(backend, cache, [(1, 0, ids[0, :prompt])])
    assert max_diff(out, ref[0, :prompt]) <= TOL
    for t in range(prompt, T):
        out = backend.forward(ids[0, t : t + 1], torch.tensor([t]), cache, slice(1, 2), [(0, 1, t + 1)])
        assert max_diff(out[0], ref[0, t]) <= TOL, f"position {t}"


@pytest.mark.parametrize("rows_kind", ["slice", "tensor"])
@torch.inference_mode()
def test_batched_decode_at_different_positions_matches_hf(pair, attention, rows_kind):
    """Three sequences of different prompt lengths: their prompts as prefill pieces of one step, then
    steps where every row sits at its own position, with one two-token step (as a speculative verify).
    'slice': the rows are contiguous and decode as decode rows; 'tensor': any rows, every step's
    tokens as a prefill piece of their row."""
    ours, ref, ids = pair
    lens = [5, 9, 3]
    rows = [2, 3, 4] if rows_kind == "slice" else [5, 0, 3]
    backend, cache = _backend(attention, ours, 6, T + 8)
    out = forward_pieces(backend, cache, [(r, 0, ids[b, :n]) for b, (r, n) in enumerate(zip(rows, lens))])
    for b, part in enumerate(out.split(lens)):
        assert max_diff(part, ref[b, : lens[b]]) <= TOL
    cur = torch.tensor(lens)
    for step in range(10):
        n = 2 if step == 4 else 1
        if rows_kind == "slice" and n == 1:
            out = backend.forward(
                ids[torch.arange(3), cur], cur, cache, slice(2, 5), [(0, 3, int(cur.max()) + 1)]
            )
        else:
            out = forward_pieces(
                backend, cache, [(r, int(c), ids[b, c : c + n]) for b, (r, c) in enumerate(zip(rows, cur))]
            )
        want = torch.cat([ref[b, c : c + n] for b, c in enumerate(cur)])
        assert max_diff(out, want) <= TOL, f"step {step}"
        cur += n


@torch.inference_mode()
def test_chunked_prefill_matches_hf(pair, attention):
    ours, ref, ids = pair
    backend, cache = _backend(attention, ours, 3, T)
    a = forward_pieces(backend, cache, [(b, 0, ids[b, :10]) for b in range(3)]).view(3, 10, -1)
    b = forward_pieces(backend, cache, [(b, 10, ids[b, 10:T]) for b in range(3)]).view(3, T - 10, -1)
    assert max_diff(torch.cat([a, b], 1), ref) <= TOL
