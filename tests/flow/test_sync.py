import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import SyncPolicy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tests.flow.scripted import ScriptedCluster, prompts


def make(R=4, K=3, U=2, steps=6, engines=((4, 2),)):
    return Scheduler(SyncPolicy(), prompts(), list(engines), FlowSpec(R, K, U, steps))


def test_sync_round_trains_every_group_once_on_policy():
    s = make()
    c = ScriptedCluster(s, length=lambda g, i: 1 + (g * 7 + i * 3) % 9, slots=4)
    c.run()
    trained = [g for t in c.trained for g in t.groups]
    assert [g.id for g in trained] == list(range(12))  # 3 rounds x R=4, in order, once each
    assert all(len(g.trajectories) == 3 for g in trained)
    # strictly on-policy: every token was produced by the version the trainer started from
    for t in c.trained:
        for g in t.groups:
            for tr in g.trajectories:
                assert set(tr.versions) == {t.trainer_version}
    # one publish per round, after its last step
    assert [t.publish for t in c.trained] == [None, 1, None, 2, None, 3]
    assert s.ledger.produced == s.ledger.trained == 36
    assert dict(s.staleness) == {0: 36}


def test_sync_does_not_generate_while_training():
    s = make(R=2, K=2, U=2, steps=3)
    c = ScriptedCluster(s, length=lambda g, i: 3, slots=8, train_ticks=4)
    busy = []
    while not s.done:
        c.execute(s.poll(c.t))
        generating = any(c.running[0]) or any(c.queue[0])
        busy.append((generating, bool(c.trainer)))
        c.tick()
    assert not any(gen and tr for gen, tr in busy), "sync overlapped generation with training"


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    R=st.integers(1, 5),
    K=st.integers(1, 4),
    engines=st.integers(1, 3),
    slots=st.integers(1, 6),
)
def test_sync_ledger_and_on_policy_under_random_lengths(seed, R, K, engines, slots):
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, int(rng.lognormvariate(1.5, 1.0))))

    s = Scheduler(SyncPolicy(), prompts(), [(slots, rng.randint(0, 3))] * engines, FlowSpec(R, K, R, 3))
    c = ScriptedCluster(
        s, length=length, slots=slots, train_ticks=rng.randint(1, 6), load_ticks=rng.randint(0, 3)
    )
    c.run()
    assert s.ledger.trained == 3 * R * K
    assert s.ledger.produced == s.ledger.trained + s.in_store() + s.ledger.total_discarded
    assert set(s.staleness) == {0}


def test_sync_metrics_are_deterministic():
    def once():
        s = make()
        c = ScriptedCluster(s, length=lambda g, i: 1 + (g * 5 + i) % 6, slots=3)
        c.run()
        return [(m.t, m.kind, sorted(m.data.items())) for m in c.marks]

    assert once() == once()


def test_stop_finishes_with_the_steps_already_issued():
    s = make(R=4, K=2, U=2, steps=100)
    c = ScriptedCluster(s, length=lambda g, i: 3, slots=4, train_ticks=5)
    while s.steps_issued < 3:
        c.execute(s.poll(c.t))
        c.tick()
    s.stop()
    c.run()
    assert s.steps_done == s.steps_issued == 4  # the round's second step was issued with the first
    s.ledger.check(s.in_store())
