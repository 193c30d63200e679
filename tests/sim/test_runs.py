"""Runs is an exact sequence: everything a tuple answers, it answers the same."""

import copy
import json

from hypothesis import given
from hypothesis import strategies as st

from tailrace.sim.runs import Runs

seqs = st.lists(st.integers(0, 3), max_size=60)


@given(a=seqs, b=seqs)
def test_runs_behave_like_the_tuple(a, b):
    ra, rb = Runs.from_seq(a), Runs.from_seq(b)
    ta, tb = tuple(a), tuple(b)
    assert len(ra) == len(ta) and tuple(ra) == ta and ra == ta and ta == ra
    assert ra + rb == ta + tb and ta + rb == ta + tb and ra + tb == ta + tb
    assert set(ra) == set(ta) and (not ta or (ra.min() == min(ta) and ra.values() == set(ta)))
    assert [ra[i] for i in range(len(ta))] == list(ta) and (not ta or ra[-1] == ta[-1])
    assert hash(ra) == hash(ta) and ra[1:5] == ta[1:5]
    assert copy.deepcopy(ra) == ta and json.dumps(list(ra)) == json.dumps(list(ta))


def test_runs_store_a_long_constant_sequence_in_one_run():
    r = Runs.of(7, 30_000) + Runs.of(7, 10) + Runs.of(8, 5)
    assert r.runs == ((7, 30_010), (8, 5)) and len(r) == 30_015
