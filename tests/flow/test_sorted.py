"""SortedRL's early updates on the scripted cluster (sync + shaping sorted): a round's groups are
trained U at a time as they complete, first finished first, each step publishing; a group that could
no longer be trained within K versions is given up and its prompt generated again under fresher
weights. Hand-checked schedules, then the ledger and the bound under random lengths and crashes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tests.flow.scripted import ScriptedCluster, every_third, prompts, random_lengths, restore, run_to_crash


def build(R, G, U, steps, K=1, zero_signal="train", slots=16, over=1.0, engines=1):
    policy = make_policy("sync", zero_signal, max_staleness=K)
    shaping = make_shaping("sorted", over=over)
    return Scheduler(policy, prompts(), [(slots, 0)] * engines, FlowSpec(R, G, U, steps), shaping=shaping)


def per_step(c):
    return [[(g.id, g.prompt_id) for g in t.groups] for t in c.trained]


LENGTHS = {0: [2, 2], 1: [3, 3], 2: [10, 10], 3: [20, 20]}


def test_steps_start_as_groups_complete_shortest_first():
    """K = 3: nothing is given up. The trainer starts at tick 2 (sync would wait for tick 20), and the
    four steps train the groups in completion order, each one version staler than the last."""
    s = build(R=4, G=2, U=1, steps=4, K=3)
    c = ScriptedCluster(s, lambda g, i: LENGTHS[g][i], slots=16, train_ticks=3)
    c.run()
    assert per_step(c) == [[(0, 0)], [(1, 1)], [(2, 2)], [(3, 3)]]
    issued = [m.t for m in c.marks if m.kind == "train_issued"]
    assert issued[:2] == [2, 3] and issued[2] < 20
    assert s.staleness == {0: 2, 1: 2, 2: 2, 3: 2}
    assert s.ledger.discarded == {}


def test_a_group_past_the_cap_is_generated_again_under_fresher_weights():
    """K = 1. Steps 0 and 1 (g0 at tick 2, g1 at 3) take the trainer to version 2, so g2 and g3
    (version 0) could only be trained 2 behind: given up, their prompts opened again under version 1
    once it is loaded (g4, g5). Step 2 trains g4 (prompt 2) and takes the trainer to 3, so g5 (version
    1) is given up too and prompt 3 is opened again (g6) under the newest loaded version."""
    lengths = {**LENGTHS, 4: [10, 10], 5: [20, 20], 6: [20, 20]}
    s = build(R=4, G=2, U=1, steps=4, K=1)
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=16, train_ticks=3)
    c.run()
    assert per_step(c) == [[(0, 0)], [(1, 1)], [(4, 2)], [(6, 3)]]
    assert s.ledger.discarded == {"shaping": 6} and s.ledger.trained == 8
    assert max(s.staleness) <= 1


def test_the_rollout_batch_is_over_x_r_in_whole_steps():
    s = build(R=4, G=2, U=3, steps=6, K=3, over=2.0)  # 8 groups: 6, the whole steps it makes
    c = ScriptedCluster(s, lambda g, i: 3 + g, slots=16)
    c.run()
    starts = [m.data["groups"] for m in c.marks if m.kind == "round_start"]
    assert [len(g) for g in starts] == [6, 6, 6]  # 2 steps a round


def test_sorted_needs_a_bound_of_at_least_one():
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        build(R=4, G=2, U=1, steps=4, K=0)


def run_random(seed, R, G, U, steps, slots, K, zero_signal, over=2.0, engines=1):
    length = random_lengths(seed)
    s = build(R, G, U, steps, K, zero_signal, slots, over, engines)
    c = ScriptedCluster(s, length, slots=slots, train_ticks=3, max_len=40,
                        reward=every_third)  # fmt: skip
    return s, c, length


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    slots=st.integers(2, 12),
    K=st.sampled_from([1, 2, 3]),
    U=st.sampled_from([1, 2]),
    zero_signal=st.sampled_from(["train", "replace"]),
    over=st.sampled_from([1.0, 2.0, 4.0]),
    engines=st.sampled_from([1, 3]),
)
def test_every_run_trains_whole_steps_within_the_cap(seed, slots, K, U, zero_signal, over, engines):
    R, G, steps = 4, 2, 10
    s, c, _ = run_random(seed, R, G, U, steps, slots, K, zero_signal, over, engines)
    c.run(max_ticks=50_000)
    assert len(c.trained) == steps and all(len(t.groups) == U for t in c.trained)
    assert all(len(g.trajectories) == G for t in c.trained for g in t.groups)
    s.ledger.check(s.in_store())
    assert set(s.ledger.discarded) <= {"shaping", "zero-signal"} and max(s.staleness) <= K
    prompt_ids = [g.prompt_id for t in c.trained for g in t.groups]
    assert len(prompt_ids) == len(set(prompt_ids)), "a prompt was trained twice"
    assert not s._cut


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), crash_tick=st.integers(10, 300), K=st.sampled_from([1, 2]))
def test_crash_and_resume_trains_nothing_twice(seed, crash_tick, K):
    R, G, U, steps = 4, 2, 1, 12
    s, c, length = run_random(seed, R, G, U, steps, 3, K, "train")
    ckpt = run_to_crash(s, c, lambda s, c, ckpt: c.t >= crash_tick)
    if ckpt is None:
        return
    s2 = build(R, G, U, steps, K, slots=3, over=2.0)
    restore(s2, ckpt, c.journal)
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, max_len=40, reward=every_third)
    c2.t, c2.loaded = c.t, [{ckpt["version"]}]
    c2.run(max_ticks=50_000)
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], steps))
    before = [t for t in c.trained if t.step < ckpt["steps_done"]]
    groups = [g for t in before + c2.trained for g in t.groups]
    assert len({g.prompt_id for g in groups}) == len(groups), "a prompt was trained twice"
    assert s2.ledger.trained == steps * U * G and max(s2.staleness) <= K
    s2.ledger.check(s2.in_store())
