"""The closed-form segment sum against the step-by-step sum it replaces."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.sim.segment import Segment

pos = st.floats(0.0, 1.0, allow_nan=False)
slope = st.floats(0.0, 1e-3, allow_nan=False)
term = st.tuples(pos, slope, pos, slope)


@settings(max_examples=300, deadline=None)
@given(base=st.floats(1e-4, 1e-2), terms=st.lists(term, min_size=0, max_size=3), n=st.integers(0, 3000))
def test_time_equals_sum_of_step_times(base, terms, n):
    seg = Segment(base, tuple(terms))
    naive = sum(seg.step_time(k) for k in range(n))
    assert seg.time(n) == pytest.approx(naive, rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(base=st.floats(1e-4, 1e-2), terms=st.lists(term, min_size=1, max_size=3), dt=st.floats(0.0, 50.0))
def test_steps_within_is_the_inverse(base, terms, dt):
    seg = Segment(base, tuple(terms))
    n = seg.steps_within(dt)
    assert seg.time(n) <= dt < seg.time(n + 1)


def test_crossing_from_memory_to_compute_bound():
    # memory 1 + 0k, compute 0 + 0.5k: memory-bound for k <= 2, compute-bound after
    seg = Segment(0.0, ((1.0, 0.0, 0.0, 0.5),))
    assert [seg.step_time(k) for k in range(5)] == [1.0, 1.0, 1.0, 1.5, 2.0]
    assert seg.time(5) == 6.5


def test_host_gap_delays_each_step_but_is_not_busy_time():
    seg = Segment(0.5, ((1.0, 0.0, 0.0, 0.0),), gap=0.25)
    assert seg.step_time(0) == 1.75 and seg.time(4) == 7.0 and seg.busy(4) == 6.0
    assert seg.scaled(2.0).time(4) == 14.0 and seg.scaled(2.0).busy(4) == 12.0
