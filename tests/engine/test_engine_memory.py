"""KV memory follows the work: the pool's size from a budget, outputs unchanged by paging and preemption
(against the unpaged layout: one block of max_context per row), and a long-context model in a small
budget."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import EngineError, TailraceEngine, ckernel
from tailrace.engine.kv_budget import GIB, size_pool
from tailrace.engine.kv_cache import KVCache
from tests.engine.engine_helpers import full_logprobs, req, tiny_model

CPU = torch.device("cpu")


def _size(**kw):
    base = dict(
        token_bytes=1024, block_size=16, num_slots=128, max_context=1024, context_given=True, device=CPU
    )
    return size_pool(**{**base, **kw})


def test_budget_sets_the_blocks_and_the_start_up_line_says_so():
    s = _size(budget_gib=1 / 16)  # 64 MiB of 16 KiB blocks
    assert (s.num_blocks, s.max_context) == (4096, 1024)
    assert s.describe(128) == (
        "KV 64.0 MiB of a 64.0 MiB budget (kv_memory_gb): 4,096 blocks of 16 tokens = 65,536 tokens, "
        "128 slots of up to 1,024"
    )
    assert _size(budget_gib=8.0).num_blocks == 128 * 64  # never more than the slots could use
    small = 32 * 16 * 1024 / GIB  # 32 blocks: 512 tokens, half a request of max_context
    with pytest.raises(EngineError, match="fewer than one request of max_context=1,024") as e:
        _size(budget_gib=small)
    assert "\n" not in str(e.value) and "kv_memory_gb" in str(e.value)
    s = _size(budget_gib=small, context_given=False)  # the model's default limit shrinks to the pool
    assert (s.num_blocks, s.max_context) == (32, 512)
    with pytest.raises(EngineError, match="must be positive"):
        _size(budget_gib=0.0)
    unset = _size(budget_gib=None, num_slots=1)  # a fraction of the available memory, capped by the slots
    assert unset.num_blocks == 64 and "available" in unset.source


def test_the_pool_follows_the_work_not_the_model_context():
    """64 slots of a 32,768-token model whose requests hold at most 100 tokens: 64 x 7 blocks, not a
    share of the machine; the default context limit is then the whole pool."""
    s = _size(budget_gib=None, num_slots=64, max_context=32768, context_given=False, expected_context=100)
    assert (s.num_blocks, s.max_context) == (64 * 7, 64 * 7 * 16)
    s = _size(budget_gib=8.0, num_slots=4, max_context=1024, expected_context=100)  # an asked-for limit:
    assert (s.num_blocks, s.max_context) == (64, 1024)  # room for one request of it
    tight = 100 * 16 * 1024 / GIB  # the budget still bounds it
    assert (
        _size(budget_gib=tight, max_context=32768, context_given=False, expected_context=100).num_blocks
        == 100
    )
    with pytest.raises(EngineError, match="expected_context=1 must be at least 2"):
        _size(budget_gib=None, expected_context=1)


def _reqs():
    # A re-prefilled k/v comes from another batch shape than the decoded one, so logits may differ by an
    # ulp, and a draw whose two best noisy values lie within that apart would differ too (seed 3 has one:
    # 9.5e-7 apart). These requests have none.
    g = torch.Generator().manual_seed(4)
    lens = torch.randint(2, 30, (16,), generator=g).tolist()
    news = torch.randint(10, 60, (16,), generator=g).tolist()
    return [
        req(f"p{i}", n, m, temperature=(1.0, 0.0, 0.8)[i % 3], top_k=(0, 20)[i % 2])
        for i, (n, m) in enumerate(zip(lens, news))
    ]


@pytest.mark.parametrize("attention", ["kernel", "bmm"])
def test_paging_and_preemption_keep_seeded_outputs_identical_to_the_unpaged_engine(attention):
    """16 requests through 8 slots over a pool of 40 blocks of 4 tokens (160 tokens for up to ~700 held
    at once): many preemptions, each request re-prefilled from its kept tokens. Against the unpaged
    layout (one 96-token block per row): the same tokens, versions and finish reasons, logprobs within
    float noise (a re-prefilled k/v comes from a different batch shape than the decoded one)."""
    if attention == "kernel" and ckernel.load() is None:
        pytest.skip(f"C kernel unavailable: {ckernel.unavailable()}")
    model = tiny_model(0)
    reqs = _reqs()
    unpaged = TailraceEngine(model, num_slots=8, max_context=96, block_size=96, attention=attention)
    assert unpaged.cache.num_blocks == 8
    want = unpaged.generate(reqs)
    budget = 40 * 4 * KVCache.token_bytes(model, torch.float32) / GIB
    paged = TailraceEngine(
        model, num_slots=8, max_context=96, block_size=4, kv_memory_gb=budget, attention=attention
    )
    assert paged.cache.num_blocks == 40
    got = paged.generate(reqs)
    assert paged.preemptions >= 5
    for a, b in zip(want, got):
        assert (a.token_ids, a.versions, a.finish) == (b.token_ids, b.versions, b.finish)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert b.submitted <= b.first_token <= b.finished
    assert paged.paging.num_holders == 0 and paged.paging.pool.num_free == 40  # every block came back


def test_aborting_a_preempted_request_returns_everything_it_generated():
    model = tiny_model(0)
    reqs = _reqs()[:8]
    full = {r.request_id: r for r in TailraceEngine(model, num_slots=8, max_context=96).generate(reqs)}
    budget = 24 * 4 * KVCache.token_bytes(model, torch.float32) / GIB
    eng = TailraceEngine(model, num_slots=8, max_context=96, block_size=4, kv_memory_gb=budget)
    for r in reqs:
        eng.add(r)
    while not eng.preemptions:
        eng.step()
    victim = eng._waiting[0]  # requeued first, its tokens kept
    assert victim.req.resume_ids
    part = eng.abort(victim.id)
    assert part.token_ids == victim.req.resume_ids == full[victim.id].token_ids[: len(part.token_ids)]
    assert eng.paging.num_holders == eng.num_running


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_long_context_model_runs_within_a_small_kv_budget(model_type):
    """max_position_embeddings 32,768 and 64 slots: the unpaged cache was 64 x 32,768 positions (1 GiB
    here); a 1 MiB budget holds 2,048 tokens, the default context limit shrinks to them, and 64
    requests run through it with the outputs of an engine with room to spare."""
    model = tiny_model(1, model_type=model_type, max_position_embeddings=32768)
    token = KVCache.token_bytes(model, torch.float32)
    assert 65 * 32768 * token >= GIB  # what the unpaged engine allocated
    reqs = [req(f"l{i}", 5 + i % 11, 20 + i % 23, temperature=1.0) for i in range(64)]
    eng = TailraceEngine(model, num_slots=64, kv_memory_gb=1 / 1024)
    assert eng.cache.nbytes() <= GIB / 1024 and eng.max_context == 2048
    assert "2,048 tokens, 64 slots of up to 2,048" in eng.describe()
    got = eng.generate(reqs)
    assert eng.rows.out_tok.shape[1] < 100  # output buffers follow max_new_tokens, not the context
    roomy = TailraceEngine(model, num_slots=64, max_context=64, block_size=64)
    assert [r.token_ids for r in got] == [r.token_ids for r in roomy.generate(reqs)]


def test_an_explicit_context_the_budget_cannot_hold_is_refused_at_start_up():
    model = tiny_model(0)
    with pytest.raises(EngineError, match="raise kv_memory_gb or lower max_context"):
        TailraceEngine(model, num_slots=4, max_context=256, kv_memory_gb=100 * 512 / GIB)


@pytest.mark.parametrize(
    "attention, dtype",
    [("kernel", torch.float32), ("bmm", torch.float32), ("bmm", torch.bfloat16), ("sdpa", torch.float32)],
)
def test_a_dropped_version_is_freed_at_once(attention, dtype):
    """No reference cycle keeps a dropped version's weights: without the garbage collector (which
    may run minutes later) they went free only when it did, ~700 MB a version at 135M parameters."""
    if attention == "kernel" and ckernel.unavailable():
        pytest.skip("no C compiler")
    import gc
    import weakref

    eng = TailraceEngine(tiny_model(0).to(dtype), num_slots=2, attention=attention)
    eng.load_weights(tiny_model(1).state_dict(), 1)
    eng.generate([req("a", 4, 5, version=1), req("b", 4, 5, version=0)])
    gone = weakref.ref(eng._versions[1].model)
    gc.disable()
    try:
        eng.drop_version(1)
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("attention", ["kernel", "bmm"])
def test_a_sliding_window_is_attended_past_it(attention):
    """Mistral v0.1's window (8 positions, not a multiple of the block size): the context is the model's
    whole, and a sequence several windows long samples with the logprobs of the decoder's whole-sequence
    forward, which attends to the window (pinned to transformers' by tests/model)."""
    if attention == "kernel" and ckernel.unavailable():
        pytest.skip("no C compiler")
    model = tiny_model(0, model_type="mistral", sliding_window=8)
    engine = TailraceEngine(model, num_slots=2, attention=attention)
    assert engine.max_context == 256
    outs = engine.generate([req("a", 5, 30), req("b", 11, 25)])
    for r, out in zip([req("a", 5, 30), req("b", 11, 25)], outs):
        assert len(out.token_ids) == r.params.max_new_tokens
        ref = full_logprobs(model, r.prompt_ids, out.token_ids)
        assert max(abs(x - y) for x, y in zip(out.logprobs, ref)) < 1e-4
