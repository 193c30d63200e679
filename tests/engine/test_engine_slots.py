"""`Slots` alone: random admit / start_decoding / release sequences keep the layout invariants, and
the returned moves, replayed on a model of the cache, keep every request's data in its row."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.slots import Slots


def _check(s: Slots, data: list, versions: dict[str, int]) -> None:
    n = s.num_decoding
    assert all(s.owner[r] is not None for r in range(n)), "decode region has a hole"
    assert s.owner[s.spare] is None, "the spare row is only a swap buffer"
    assert sum(len(g) for g in s.groups) == n and all(len(g) for g in s.groups)
    pos = 0
    for g in s.groups:  # groups tile [0, n) in order, one version each
        assert g.start == pos
        assert {versions[s.owner[r]] for r in range(g.start, g.stop)} == {g.version}
        pos = g.stop
    assert len({g.version for g in s.groups}) == len(s.groups)
    for rid, r in s.row.items():
        assert s.owner[r] == rid and data[r] == rid, "a request's data is not in its row"
        assert s.is_decoding(rid) == (r < n)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "decode", "release", "reorder"]),
            st.integers(0, 10**6),
            st.integers(0, 2),
        ),
        max_size=120,
    ),
    num_slots=st.integers(1, 9),
)
def test_random_operations_keep_invariants(ops, num_slots):
    s = Slots(num_slots)
    data: list = [None] * (num_slots + 1)  # what each cache row holds
    versions: dict[str, int] = {}
    nxt = 0
    for op, pick, version in ops:
        live = sorted(s.row)
        if op == "admit" and s.num_free:
            rid = f"r{nxt}"
            nxt += 1
            r = s.admit(rid)
            assert r >= s.num_decoding and data[r] is None
            data[r] = rid
            versions[rid] = version
            continue
        prefilling = [r for r in live if not s.is_decoding(r)]
        if op == "decode" and prefilling:
            rid = prefilling[pick % len(prefilling)]
            moves = s.start_decoding(rid, versions[rid])
            assert len(moves) <= 3 + len(s.groups)
        elif op == "reorder" and s.groups:
            g = s.groups[pick % len(s.groups)]
            order = list(s.owner[g.start : g.stop])
            random.Random(pick).shuffle(order)
            moves = s.reorder(g.version, order)
            assert s.owner[g.start : g.stop] == order
            assert len(moves) <= len(g) + len(g) // 2
        elif op == "release" and live:
            rid = live[pick % len(live)]
            data[s.row[rid]] = None
            moves = s.release(rid)
            assert len(moves) <= len(s.groups) + 1
        else:
            continue
        for src, dst, mover in moves:
            assert data[src] == mover
            data[dst], data[src] = data[src], None
        _check(s, data, versions)


def test_release_compacts_with_one_move_per_later_group():
    s = Slots(6)
    for i, v in enumerate([0, 0, 1, 1, 2]):
        s.admit(f"r{i}")
        s.start_decoding(f"r{i}", v)
    assert [(g.version, g.start, g.stop) for g in s.groups] == [(0, 0, 2), (1, 2, 4), (2, 4, 5)]
    moves = s.release(s.owner[0])  # first row of group 0: its last row fills it, then 2 slides
    assert len(moves) == 3
    assert [(g.version, g.start, g.stop) for g in s.groups] == [(0, 0, 1), (1, 1, 3), (2, 3, 4)]
    with pytest.raises(ValueError):
        Slots(0)
