"""Attention chunk planning (pure): chunks tile the rows, cover every row's position, and cut work."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from tailrace.engine import chunks


@given(st.lists(st.integers(0, 500), min_size=1, max_size=64))
def test_chunks_tile_rows_and_cover_positions(positions):
    plan = chunks.plan(positions)
    assert plan[0][0] == 0 and plan[-1][1] == len(positions)
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for lo, hi, S, first in plan:
        assert lo < hi and S > max(positions[lo:hi]) and first == min(positions[lo:hi])
    one = [(0, len(positions), max(positions) + 1)]  # the plan never costs more than a single chunk
    assert chunks.work(plan) + chunks.CHUNK_COST * len(plan) <= chunks.work(one) + chunks.CHUNK_COST


def test_sorted_long_tail_gets_close_to_ideal_and_unsorted_asks_for_a_sort():
    rng = random.Random(0)
    pos = sorted((int(rng.lognormvariate(4, 0.8)) for _ in range(64)), reverse=True)
    plan = chunks.plan(pos)
    assert len(plan) > 1 and chunks.overhead(pos, plan) < 1.3
    shuffled = pos[:]
    rng.shuffle(shuffled)
    ratio = chunks.overhead(shuffled, chunks.plan(shuffled))
    assert ratio > 1.6
    assert chunks.needs_sort(ratio, chunks.overhead(pos, plan), chunks.SORT_EVERY)
    assert not chunks.needs_sort(ratio, chunks.overhead(pos, plan), 0)
