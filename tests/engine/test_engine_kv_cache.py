"""`KVCache` and `BlockTable`: storage, table moves, and decoding through a backend across a row move and
across modes."""

from __future__ import annotations

import torch

from tailrace.engine.backends import select
from tailrace.engine.kv_cache import KVCache
from tests.engine.engine_helpers import forward_pieces, paged_cache, tiny_model

TOL = 1e-4  # max abs fp32 logits difference against the whole-sequence forward


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_kv_cache_shape_table_and_moves():
    cache = KVCache(
        num_layers=2, num_blocks=5, num_kv_heads=2, block_size=4, head_dim=3, num_rows=3, max_context=10
    )
    assert [t.shape for t in cache.k + cache.v] == [torch.Size([5, 2, 4, 3])] * 4
    assert all(not t.any() for t in cache.k + cache.v)
    assert cache.table.t.shape == (3, 3) and cache.max_context == 12  # ceil(10 / 4) blocks per row
    assert cache.nbytes() == 4 * 5 * 2 * 4 * 3 * 4
    cache.table.set(2, [4, 1])
    cache.table.put([(2, 2, 3), (0, 0, 2)])
    cache.table.move(2, 1)
    assert cache.table.t.tolist() == [[2, 0, 0], [4, 1, 3], [4, 1, 3]]


def test_decoding_continues_after_a_row_move():
    """The engine's compaction moves a sequence's table row, never its k/v: it decodes on unchanged."""
    model = tiny_model(2, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids)
    with torch.inference_mode():
        cache = paged_cache(model, 4, 16, block_size=4)
        backend = select("auto", model, 16, cache.dtype)(model)
        forward_pieces(backend, cache, [(3, 0, ids[0, :6])])
        cache.table.move(3, 1)
        for t in range(6, 14):
            out = backend.forward(ids[0, t : t + 1], torch.tensor([t]), cache, slice(1, 2), [(0, 1, t + 1)])
            assert max_diff(out[0], ref[0, t]) <= TOL


def test_cache_works_under_no_grad_and_inference_mode_alike():
    model = tiny_model(3)
    ids = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(5))
    cache = paged_cache(model, 1, 8, block_size=2)
    backend = select("auto", model, 8, cache.dtype)(model)
    with torch.inference_mode():
        a = forward_pieces(backend, cache, [(0, 0, ids[:3])])
    with torch.no_grad():
        b = forward_pieces(backend, cache, [(0, 3, ids[3:])])
        ref = model(ids[None])[0]
    assert max_diff(torch.cat([a, b]), ref) <= TOL
