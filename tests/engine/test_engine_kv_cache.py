"""`KVCache`: storage and row moves, and decoding through a backend across a move and across modes."""

from __future__ import annotations

import torch

from tailrace.engine.backends import select
from tailrace.engine.kv_cache import KVCache
from tests.engine.engine_helpers import forward_pieces, tiny_model

TOL = 1e-4  # max abs fp32 logits difference against the whole-sequence forward


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


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
    model = tiny_model(2, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids)
    with torch.inference_mode():
        cache = KVCache.for_model(model, 4, 16)
        backend = select("auto", model, 16, cache.dtype)(model)
        forward_pieces(backend, cache, [(3, 0, ids[0, :6])])
        cache.move_row(3, 1, length=6)
        for t in range(6, 14):
            out = backend.forward(ids[0, t : t + 1], torch.tensor([t]), cache, slice(1, 2), [(0, 1, t + 1)])
            assert max_diff(out[0], ref[0, t]) <= TOL


def test_cache_works_under_no_grad_and_inference_mode_alike():
    model = tiny_model(3)
    ids = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(5))
    cache = KVCache.for_model(model, 1, 8)
    backend = select("auto", model, 8, cache.dtype)(model)
    with torch.inference_mode():
        a = forward_pieces(backend, cache, [(0, 0, ids[:3])])
    with torch.no_grad():
        b = forward_pieces(backend, cache, [(0, 3, ids[3:])])
        ref = model(ids[None])[0]
    assert max_diff(torch.cat([a, b]), ref) <= TOL
