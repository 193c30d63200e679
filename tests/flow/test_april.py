"""APRIL's over-provisioning on the scripted cluster (sync): a round opens `over` x R prompts, stops at
the first R complete groups, and carries the rest into the next round — open groups with their
aborted partials parked and resumed under the new weights (tokens keep their versions), complete
ones as they are. Nothing is discarded; a group is never carried past the staleness bound K."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.flow.shaping.april import April
from tests.flow.scripted import ScriptedCluster, every_third, prompts, random_lengths, restore, run_to_crash


def build(R, G, U, steps, over=2.0, K=1, zero_signal="train", slots=16):
    policy = make_policy("sync", zero_signal, max_staleness=K)
    return Scheduler(
        policy, prompts(), [(slots, 0)], FlowSpec(R, G, U, steps), shaping=make_shaping("april", over=over)
    )


def trained(c):
    return [[g.prompt_id for g in t.groups] for t in c.trained]


def test_a_round_stops_at_r_groups_and_carries_the_rest_with_their_tokens():
    """R = 2, M = 2, over 2: round 1 opens g0-g3; g0 and g1 complete first (ticks 4 and 6), so g2 and
    g3 are carried, their partials parked at 6 tokens. Round 2 (version 1) resumes them and opens g4
    and g5; g4 and g5 finish first, but g2 and g3 are at the bound (K = 1) and are the two trained;
    the complete g4 and g5 are carried as they are and trained in round 3."""
    lengths = {0: [3, 4], 1: [5, 6], 2: [20, 21], 3: [30, 31], 4: [2, 2], 5: [3, 3]}
    s = build(R=2, G=2, U=2, steps=3)
    c = ScriptedCluster(s, lambda g, i: lengths.get(g, [9, 9])[i], slots=16)
    c.run()
    assert trained(c) == [[0, 1], [2, 3], [4, 5]]
    g2 = c.trained[1].groups[0].trajectories[0]
    assert g2.versions == (0,) * 6 + (1,) * 14  # 6 tokens under version 0, resumed under 1
    assert s.ledger.discarded == {} and s.ledger.trained == 12
    assert {v for t in c.trained[2].groups for tr in t.trajectories for v in tr.versions} == {1}
    assert s.staleness == {0: 4, 1: 8}  # g2, g3 (oldest token) and g4, g5 trained one version behind


def test_nothing_is_carried_without_over_provisioning():
    s = build(R=2, G=2, U=2, steps=2, over=1.0)
    c = ScriptedCluster(s, lambda g, i: 3 + g + i, slots=16)
    c.run()
    assert trained(c) == [[0, 1], [2, 3]] and s.staleness == {0: 8}


def test_april_needs_a_staleness_bound_and_sane_over_provisioning():
    with pytest.raises(ValueError, match="shaping.over=0.5"):
        April(over=0.5)
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        build(R=2, G=2, U=2, steps=2, K=0)


def run_random(seed, R, G, U, steps, slots, over, K, zero_signal):
    length = random_lengths(seed)
    s = build(R, G, U, steps, over, K, zero_signal, slots)
    c = ScriptedCluster(s, length, slots=slots, train_ticks=3, max_len=40,
                        reward=every_third)  # fmt: skip
    return s, c, length


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    slots=st.integers(2, 12),
    over=st.sampled_from([1.0, 1.5, 2.0]),
    K=st.sampled_from([1, 2]),
    zero_signal=st.sampled_from(["train", "replace"]),
)
def test_every_run_trains_whole_steps_within_the_bound_and_discards_nothing(
    seed, slots, over, K, zero_signal
):
    R, G, U, steps = 4, 2, 2, 10
    s, c, _ = run_random(seed, R, G, U, steps, slots, over, K, zero_signal)
    c.run(max_ticks=50_000)
    assert len(c.trained) == steps and all(len(t.groups) == U for t in c.trained)
    assert all(len(g.trajectories) == G for t in c.trained for g in t.groups)
    s.ledger.check(s.in_store())
    assert set(s.ledger.discarded) <= {"zero-signal"}
    assert max(s.staleness) <= K
    for t in c.trained:
        for g in t.groups:
            for tr in g.trajectories:
                assert list(tr.versions) == sorted(tr.versions), "a resumed sample's versions go back"
    keys = [(tr.group, tr.sample_index) for t in c.trained for g in t.groups for tr in g.trajectories]
    assert len(keys) == len(set(keys))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), crash_tick=st.integers(10, 300), over=st.sampled_from([1.5, 2.0]))
def test_crash_and_resume_regenerates_parked_partials_and_trains_nothing_twice(seed, crash_tick, over):
    R, G, U, steps = 4, 2, 2, 12
    s, c, length = run_random(seed, R, G, U, steps, 3, over, 1, "train")
    ckpt = run_to_crash(s, c, lambda s, c, ckpt: c.t >= crash_tick)
    if ckpt is None:
        return
    s2 = build(R, G, U, steps, over, 1, slots=3)
    restore(s2, ckpt, c.journal)
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, max_len=40, reward=every_third)
    c2.t, c2.loaded = c.t, [{ckpt["version"]}]
    c2.run(max_ticks=50_000)
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], steps))
    before = [t for t in c.trained if t.step < ckpt["steps_done"]]
    keys = [
        (tr.group, tr.sample_index) for t in before + c2.trained for g in t.groups for tr in g.trajectories
    ]
    assert len(keys) == len(set(keys)), "a trajectory was trained twice"
    assert s2.ledger.trained == steps * U * G and max(s2.staleness) <= 1
    s2.ledger.check(s2.in_store())
