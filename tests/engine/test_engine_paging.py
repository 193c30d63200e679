"""`BlockPool` and `Paging` alone (pure Python): hand-checked admissions, growth and preemptions, and a
property over random operation sequences: no block owned twice, every held position has a block,
freed blocks return, and preemption takes only sequences younger than every survivor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.block_pool import BlockPool
from tailrace.engine.paging import Paging


def test_pool_hands_out_blocks_in_order_and_reuses_freed_ones_first():
    pool = BlockPool(6, 4)
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pool.allocate("a", 9) == [0, 1, 2]
    assert pool.allocate("a", 12) == [] and pool.allocate("a", 13) == [3]
    assert pool.allocate("b", 2) == [4] and pool.num_free == 1
    assert pool.release("a") == [0, 1, 2, 3] and pool.num_free == 5
    assert pool.allocate("c", 8) == [0, 1]  # the just-freed blocks, lowest first
    with pytest.raises(ValueError, match="needs 4 blocks, 3 are free"):
        pool.allocate("d", 16)
    with pytest.raises(KeyError):
        pool.release("a")


def test_admission_leaves_one_block_per_holder_that_can_grow():
    p = Paging(10, 4)
    assert p.admit("a", 40, 40, age=0) == list(range(10))  # alone, at its limit: the whole pool
    p.release("a")
    assert p.admit("a", 9, 39, age=0) == [0, 1, 2]  # 3 blocks + its own reserve 1 <= 10
    assert p.admit("b", 16, 30, age=1) == [3, 4, 5, 6]  # 4 + reserve 2 <= 7 free
    assert p.admit("c", 1, 30, age=2) is None  # 1 + reserve 3 > 3 free
    assert p.admit("c", 4, 4, age=2) == [7]  # 1 + reserve 2 (it cannot grow) <= 3 free
    assert p.num_holders == 3 and p.pool.num_free == 2
    with pytest.raises(ValueError, match="already holds"):
        p.admit("a", 1, 1, age=5)


def test_growth_takes_a_free_block_then_preempts_the_youngest():
    p = Paging(7, 4)
    assert p.admit("old", 4, 99, age=0) == [0]
    assert p.admit("mid", 8, 99, age=1) == [1, 2]  # 2 + reserve 2 <= 6 free
    assert p.admit("new", 4, 99, age=2) == [3]  # 1 + reserve 3 <= 4 free
    g = p.grow([("old", 5), ("mid", 8)])  # only "old" crosses into a new block
    assert g.preempted == () and g.grown == (("old", 1, 4),)
    assert p.grow([("mid", 9)]).grown == (("mid", 2, 5),)
    assert p.grow([("old", 9)]).grown == (("old", 2, 6),) and p.pool.num_free == 0
    g = p.grow([("new", 5), ("mid", 13)])  # oldest first: "mid" takes the youngest's block
    assert g.preempted == ("new",) and g.grown == (("mid", 3, 3),)
    g = p.grow([("mid", 17), ("old", 13)])
    assert g.preempted == ("mid",) and g.grown == (("old", 3, 1),)
    assert p.pool.owned == {"old": [0, 4, 6, 1]} and p.pool.num_free == 3


def test_a_needing_sequence_that_is_the_youngest_preempts_itself_only():
    p = Paging(4, 2)
    p.admit("a", 2, 9, age=0)
    p.admit("b", 2, 9, age=7)  # 1 + reserve 2 <= 3 free
    p.grow([("a", 5)])  # takes the last two free blocks
    g = p.grow([("b", 3)])
    assert g.preempted == ("b",) and g.grown == () and p.holds("a") and p.pool.num_free == 1


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "release"]), st.integers(0, 10**6), st.integers(0, 40)),
        max_size=80,
    ),
    num_blocks=st.integers(1, 12),
    block_size=st.integers(1, 5),
)
def test_random_operations_keep_blocks_exclusive_and_sufficient(ops, num_blocks, block_size):
    p = Paging(num_blocks, block_size)
    cap = num_blocks * block_size  # the engine never lets a sequence's limit exceed the pool
    tokens: dict[str, int] = {}  # positions each holder must have blocks for
    age: dict[str, int] = {}
    limit: dict[str, int] = {}
    nxt = 0
    for op, pick, n in ops:
        holders = sorted(tokens)
        if op == "admit":
            rid, nxt = f"s{nxt}", nxt + 1
            want = min(cap, n)
            lim = min(cap, want + pick % (3 * block_size))
            free, pool = p.pool.num_free, p.pool
            growing = sum(pool.blocks_for(limit[r]) > pool.blocks_for(t) for r, t in tokens.items())
            growing += pool.blocks_for(lim) > pool.blocks_for(want)
            got = p.admit(rid, want, lim, age=nxt)
            assert (got is not None) == (pool.blocks_for(want) + growing <= free)
            if got is not None:
                tokens[rid], age[rid], limit[rid] = want, nxt, lim
                assert len(got) == pool.blocks_for(want)
        elif op == "grow" and holders:
            needs = [
                (r, min(cap, tokens[r] + (pick >> i) % (2 * block_size + 1))) for i, r in enumerate(holders)
            ]
            needs = needs[: 1 + pick % len(needs)]
            free_before = p.pool.num_free
            g = p.grow(needs)
            for rid in g.preempted:
                del tokens[rid]
            assert all(age[v] > age[s] for v in g.preempted for s in tokens), "preempted an older one"
            for rid, want in needs:
                if rid in tokens:
                    tokens[rid] = max(tokens[rid], want)
            if not g.preempted:
                assert p.pool.num_free == free_before - len(g.grown)
        elif op == "release" and holders:
            rid = holders[pick % len(holders)]
            p.release(rid)
            del tokens[rid]
        owned = [b for blocks in p.pool.owned.values() for b in blocks]
        assert len(owned) == len(set(owned)), "a block owned twice"
        assert sorted(owned + p.pool._free) == list(range(num_blocks)), "a block lost or duplicated"
        assert set(p.pool.owned) == set(tokens) and p.num_holders == len(tokens)
        for rid, n in tokens.items():
            assert len(p.pool.owned[rid]) == p.pool.blocks_for(n), "a held position without its block"


def test_extend_takes_only_spare_blocks_and_shrink_returns_them_in_order():
    p = Paging(8, 4)
    assert p.admit("a", 4, 40, age=0) == [0]  # reserve 1 (itself)
    assert p.admit("b", 4, 40, age=1) == [1]  # reserve 2
    # free 6, reserve 2 (both can grow): 4 spare; "a" wants 3 more blocks, "b" 2 -> b gets 1
    got = p.extend([("a", 16), ("b", 12)])
    assert got == [("a", 1, 2), ("a", 2, 3), ("a", 3, 4), ("b", 1, 5)]
    assert p.held("a") == 16 and p.held("b") == 8 and p.pool.num_free == 2
    assert p.extend([("b", 12)]) == []  # the reserve is untouchable
    p.shrink("a", 5)  # keeps positions [0, 5): two blocks; 3 and 4 return, block 3 on top
    assert p.pool.owned["a"] == [0, 2] and p.pool.num_free == 4
    assert p.pool.allocate("a", 9) == [3]  # handed out again first, as if never taken
    p.shrink("b", 4)
    assert p.pool.owned["b"] == [1] and p.pool.allocate("c", 1) == [5]


def test_kept_blocks_are_adopted_by_a_continuation_and_taken_back_before_anyone_waits():
    p = Paging(8, 4)
    p.admit("a", 6, 12, age=0)  # blocks 0, 1
    p.grow([("a", 11)])  # block 2
    key = p.keep("a", 10)  # a finished at 11 positions, 10 with k/v: its three blocks stay
    assert p.is_kept(key) and p.num_holders == 0 and p.num_kept_blocks == 3 and p.pool.num_free == 5
    # its continuation: 10 cached positions + 4 new ones; only block 3 is new
    assert p.admit("b", 14, 20, age=1, adopt=key, cached=10) == [0, 1, 2, 3]
    assert not p.is_kept(key) and p.num_kept_blocks == 0 and p.pool.num_free == 4
    key = p.keep("b", 13)
    assert p.num_kept_blocks == 4 and p.admit("c", 4, 4, age=2) == [4]
    assert p.admit("d", 28, 32, age=3) is None  # 7 blocks + its reserve > 3 free + 4 kept
    # 6 blocks: more than the 3 free, not more than free + kept: the kept ones come back first
    assert p.admit("d", 24, 24, age=3) == [0, 1, 2, 3, 5, 6]
    assert not p.is_kept(key) and p.pool.num_free == 1
    with pytest.raises(ValueError, match="does not keep"):
        p.admit("e", 4, 4, age=4, adopt=key, cached=4)


def test_growth_takes_kept_blocks_back_before_it_preempts():
    p = Paging(4, 2)
    p.admit("a", 2, 8, age=0)
    p.admit("b", 2, 2, age=1)
    key = p.keep("b", 1)
    assert p.admit("c", 4, 8, age=2) is None  # 2 blocks + reserve 2 > 2 free + 1 kept
    assert p.is_kept(key)  # a refused admission takes nothing back
    g = p.grow([("a", 8)])  # needs 3 blocks: 2 free + the kept one, nobody preempted
    assert g.preempted == () and not p.is_kept(key) and p.held("a") == 8


def test_forgotten_blocks_return_to_the_pool():
    p = Paging(4, 2)
    p.admit("a", 3, 3, age=0)
    key = p.keep("a", 2)
    assert p.pool.num_free == 3  # one block holds its 2 positions; the other came back
    p.forget(key)
    p.forget(key)  # twice: nothing more
    assert p.pool.num_free == 4 and not p.is_kept(key)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "adopt", "grow", "keep", "forget"]), st.integers(0, 10**6)),
        max_size=60,
    ),
    num_blocks=st.integers(1, 10),
    block_size=st.integers(1, 4),
)
def test_random_keeps_and_adoptions_lose_no_block_and_preempt_only_when_kept_blocks_run_out(
    ops, num_blocks, block_size
):
    p = Paging(num_blocks, block_size)
    cap = num_blocks * block_size
    tokens: dict[str, int] = {}  # holder -> positions it has blocks for
    kept: dict[str, int] = {}  # key -> positions kept (as far as the pool has not taken them back)
    nxt = 0
    for op, pick in ops:
        holders, keys = sorted(tokens), [k for k in kept if p.is_kept(k)]
        kept = {k: kept[k] for k in keys}
        if op in ("admit", "adopt"):
            rid, nxt = f"s{nxt}", nxt + 1
            key = keys[pick % len(keys)] if op == "adopt" and keys else None
            cached = kept[key] if key else 0
            want = min(cap, max(cached + 1, pick % (cap + 1)))
            if p.admit(rid, want, want, age=nxt, adopt=key, cached=cached) is not None:
                tokens[rid] = want
                kept.pop(key, None)
        elif op == "grow" and holders:
            rid = holders[pick % len(holders)]
            want = min(cap, tokens[rid] + pick % (2 * block_size + 1))
            short = p.pool.short_by(rid, want)
            room = p.pool.num_free + p.num_kept_blocks
            g = p.grow([(rid, want)])
            assert short > room or not g.preempted, "preempted while kept blocks could serve"
            for r in g.preempted:
                del tokens[r]
            if rid in tokens:
                tokens[rid] = want
        elif op == "keep" and holders:
            rid = holders[pick % len(holders)]
            n = pick % (tokens.pop(rid) + 1)
            kept[p.keep(rid, n)] = n
        elif op == "forget" and keys:
            p.forget(keys[pick % len(keys)])
        owned = [b for blocks in p.pool.owned.values() for b in blocks]
        assert sorted(owned + p.pool._free) == list(range(num_blocks)), "a block lost or duplicated"
        for rid, n in tokens.items():
            assert len(p.pool.owned[rid]) == p.pool.blocks_for(n)
        for k, n in kept.items():
            if p.is_kept(k):
                assert len(p.pool.owned[k]) == p.pool.blocks_for(n)
        assert set(p.pool.owned) == set(tokens) | {k for k in kept if p.is_kept(k)}
