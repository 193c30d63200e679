"""Zero-signal groups (all rewards equal): counted, and with zero_signal=replace swapped for fresh
prompts within the per-step allowance, in every mode; the ledger accounts each drop."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tests.flow.scripted import ScriptedCluster, prompts

MODES = ["sync", "pipe", "async", "partial", "multiversion"]


def informative(g, i):
    return float(i % 2)


def run(mode, reward, zero_signal="replace", extra=1, R=4, G=2, U=2, steps=2, seed=0, K=1, slots=4, **keep):
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, min(40, int(rng.lognormvariate(1.6, 0.9)))))

    policy = make_policy(mode, zero_signal, extra, max_staleness=K, **keep)  # keep: store.filter's
    s = Scheduler(policy, prompts(), [(slots, 2)], FlowSpec(R, G, U, steps))
    c = ScriptedCluster(s, length, slots=slots, train_ticks=3, reward=reward)
    c.run(max_ticks=20_000)
    return s, c


def trained_groups(c):
    return [[g.id for g in t.groups] for t in c.trained]


def test_sync_replaces_a_zero_signal_group_in_its_slot():
    s, c = run("sync", lambda g, i: 0.0 if g == 1 else informative(g, i))
    assert trained_groups(c) == [[0, 4], [2, 3]]  # group 4, a fresh prompt, took group 1's slot
    assert s.ledger.state_dict() == {"produced": 10, "trained": 8, "discarded": {"zero-signal": 2}}
    assert s.ledger_record()["groups"] == {"complete": 5, "zero_signal": 1, "dropped": {"zero-signal": 1}}
    assert [m.data for m in c.marks if m.kind == "group_dropped"] == [{"group": 1, "reason": "zero-signal"}]


def test_sync_trains_zero_signal_groups_once_the_allowance_is_spent():
    """All rewards 0: the round (2 steps, 1 extra group each) replaces slots 0 and 1 in one wave,
    then trains what it has."""
    s, c = run("sync", lambda g, i: 0.0)
    assert trained_groups(c) == [[4, 5], [2, 3]]
    assert s.ledger_record()["groups"] == {"complete": 6, "zero_signal": 6, "dropped": {"zero-signal": 2}}


def test_sync_replacement_waves_repeat_until_the_round_is_informative():
    """Group 1 and its first replacement (4) are zero-signal; the second replacement (5) is not."""
    s, c = run("sync", lambda g, i: 0.0 if g in (1, 4) else informative(g, i), extra=2)
    assert trained_groups(c) == [[0, 5], [2, 3]]
    assert s.ledger_record()["groups"]["dropped"] == {"zero-signal": 2}


def test_train_mode_counts_zero_signal_groups_and_trains_them_as_today():
    s, c = run("sync", lambda g, i: 0.0 if g == 1 else informative(g, i), zero_signal="train")
    assert trained_groups(c) == [[0, 1], [2, 3]]
    assert s.ledger.total_discarded == 0
    assert s.ledger_record()["groups"] == {"complete": 4, "zero_signal": 1, "dropped": {}}


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000), K=st.integers(1, 3), slots=st.integers(2, 8))
def test_every_mode_completes_its_steps_with_informative_groups(mode, seed, K, slots):
    """A third of the prompts give equal rewards; with room to replace them all, every step trains U
    informative groups, and each drop is G samples discarded as zero-signal."""
    G, U, steps = 2, 2, 6
    s, c = run(mode, lambda g, i: 0.0 if g % 3 == 1 else informative(g, i), extra=100, G=G, U=U,
               steps=steps, seed=seed, K=K, slots=slots)  # fmt: skip
    assert len(c.trained) == steps and all(len(t.groups) == U for t in c.trained)
    assert all(g.id % 3 != 1 for t in c.trained for g in t.groups), "a zero-signal group was trained"
    dropped = s.ledger_record()["groups"]["dropped"].get("zero-signal", 0)
    assert dropped > 0 and s.ledger.discarded == {"zero-signal": G * dropped}
    assert s.ledger.trained == steps * U * G
    s.ledger.check(s.in_store())
    for t in c.trained:  # the modes' own promises still hold with replacements
        for g in t.groups:
            for tr in g.trajectories:
                assert t.trainer_version - min(tr.versions) <= (0 if mode in ("sync", "pipe") else K)


@settings(max_examples=30, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000), extra=st.integers(0, 3))
def test_a_task_without_signal_still_finishes_with_bounded_replacements(mode, seed, extra):
    steps = 6
    s, c = run(mode, lambda g, i: 1.0, extra=extra, steps=steps, seed=seed, K=2)
    assert len(c.trained) == steps and all(len(t.groups) == 2 for t in c.trained)
    groups = s.ledger_record()["groups"]
    assert groups["complete"] == groups["zero_signal"]
    assert groups["dropped"].get("zero-signal", 0) <= extra * (steps + 1)
    s.ledger.check(s.in_store())
