"""Engines that hold one weight version at a time (`Capabilities.versions_at_once == 1`, e.g. vLLM): the
modes that can run on them keep every invariant on a scripted cluster whose engines refuse a load
while busy, and never serve two versions at once; the modes that cannot are refused by name, with
the fix."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.types import Capabilities
from tests.flow.scripted import ScriptedCluster, every_third, prompts

ONE = Capabilities(abort_resume=False, versions_at_once=1, per_request_seed=True, speculative=False)
# (mode, its options, shaping): sync with APRIL carries partials into the next round (resumed under
# the new weights), with sorted it trains a round's groups as they complete
RUNNABLE = [
    ("sync", {}, "none"),
    ("pipe", {}, "none"),
    ("async", {}, "none"),
    ("multiversion", {"placement": "dedicated"}, "none"),
    ("sync", {}, "april"),
    ("sync", {}, "sorted"),
    ("sync", {}, "darts"),
    ("sync", {}, "tailbatch"),
]


@pytest.mark.parametrize("case", RUNNABLE, ids=lambda c: f"{c[0]}-{c[2]}")
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    K=st.integers(1, 3),
    engines=st.integers(1, 3),
    slots=st.integers(2, 6),
    train_ticks=st.integers(1, 10),
    zero_signal=st.sampled_from(["train", "replace"]),
)
def test_modes_that_run_on_one_version_engines_keep_their_promises(
    case, seed, K, engines, slots, train_ticks, zero_signal
):
    """`replace`: zero-signal groups (every_third's rewards leave some) are swapped for fresh ones, at a
    version some engine holds or is loading."""
    mode, options, shaping = case
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, min(60, int(rng.lognormvariate(1.6, 0.9)))))

    s = Scheduler(make_policy(mode, zero_signal, max_staleness=K, **options), prompts(), [(slots, 2)] * engines,
                  FlowSpec(4, 2, 2, 6), shaping=make_shaping(shaping, window=4), capabilities=ONE)  # fmt: skip
    c = ScriptedCluster(s, length, slots=slots, train_ticks=train_ticks, one_version=True, reward=every_third)
    poll = s.poll

    def checked_poll(now):
        out = poll(now)
        assert all(len(held) <= 1 for held in c.loaded), c.loaded
        assert all(len(set(e.in_flight.values())) <= 1 for e in s.engines)
        return out

    s.poll = checked_poll
    c.run(max_ticks=20_000)
    trained = [tr for t in c.trained for g in t.groups for tr in g.trajectories]
    assert len(c.trained) == 6 and len(trained) == 24
    s.ledger.check(s.in_store())
    assert all(len(set(tr.versions)) == 1 for tr in trained) or shaping == "april"  # resumed partials
    bound = 0 if mode in ("sync", "pipe") and shaping == "none" else K
    assert all(t.trainer_version - min(tr.versions) <= bound for t in c.trained for g in t.groups
               for tr in g.trajectories)  # fmt: skip
    if mode == "multiversion":  # nothing sampled is dropped but zero-signal groups replaced
        assert set(s.ledger.discarded) <= ({"zero-signal"} if zero_signal == "replace" else set())


@pytest.mark.parametrize(
    "mode,options,fix",
    [
        ("partial", {}, "flow.placement=dedicated"),
        ("multiversion", {"placement": "shared"}, "flow.placement=dedicated"),
    ],
)
def test_modes_that_need_two_versions_per_engine_are_refused_with_the_fix(mode, options, fix):
    with pytest.raises(ValueError, match=f"flow.mode={mode} .*{fix}.*one weight version at a time"):
        Scheduler(make_policy(mode, **options), prompts(), [(4, 2)], FlowSpec(4, 2, 2, 6), capabilities=ONE)
