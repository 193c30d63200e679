"""A policy joining a running set of policies (`PolicySet.add`) and one leaving (`Scheduler.stop`), on the
scripted cluster: the engines' space does not move under the versions and ids already out, the
joiner loads its start version everywhere before it dispatches, and every policy's ledger holds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.commands import Generate, LoadWeights
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tests.flow.scripted import prompts
from tests.flow.test_multi import CHURN, MODES, MultiCluster, keys, lengths


def sched(mode: str, steps: int, engines: int = 1, slots: int = 3) -> Scheduler:
    return Scheduler(
        make_policy(mode, max_staleness=1), prompts(), [(slots, 2)] * engines, FlowSpec(4, 2, 2, steps)
    )


class JoinCluster(MultiCluster):
    """The scripted cluster, its per-policy books grown when a policy joins."""

    def add_policy(self, name: str, s: Scheduler) -> int:
        p = self.s.add(name, s)
        for books in (self.trainers, self.trained_by, self.training_ticks, self.running_by):
            books.append(type(books[0])())
        self.left.append(0)
        return p


def test_room_is_fixed_and_the_engines_space_does_not_move():
    s = PolicySet(["a"], [sched("sync", 2)], room=3)
    assert s.translates and s.version(0, 2) == 6 and s.request_id(0, "1.0.0") == "a/1.0.0"
    assert s.add("b", sched("sync", 2)) == 1
    assert s.version(0, 2) == 6 and s.version(1, 2) == 7 and s.policy_version(7) == (1, 2)
    with pytest.raises(ValueError, match="unique"):
        s.add("b", sched("sync", 2))
    s.add("c", sched("sync", 2))
    with pytest.raises(ValueError, match="room for 3 policies.*max_policies"):
        s.add("d", sched("sync", 2))
    one = PolicySet(["a"], [sched("sync", 2)])
    assert not one.translates and one.request_id(0, "1.0.0") == "1.0.0"
    with pytest.raises(ValueError, match="room for 1"):
        one.add("b", sched("sync", 2))


def test_a_joiner_mirrors_the_live_engines_and_loads_before_it_dispatches():
    s = PolicySet(["a"], [sched("pipe", 6, engines=2)], room=2)
    c = JoinCluster(s, lengths(0), slots=3, train_ticks=3, load_ticks=2)
    for _ in range(15):
        c.execute(s.poll(c.t))
        c.tick()
    e2 = c.join_engine()
    c.leave_engine(0)
    for _ in range(3):
        c.execute(s.poll(c.t))
        c.tick()
    p = c.add_policy("b", sched("sync", 2))  # built with one engine: its books become the run's
    assert [e.id for e in s[p].engines] == [1, e2] and s[p].departed == {0}
    assert all(not e.loaded for e in s[p].engines)
    outs = s.poll(c.t)
    first = outs[p].commands
    assert {(c_.engine, c_.version) for c_ in first if isinstance(c_, LoadWeights)} == {(1, 1), (e2, 1)}
    assert not any(isinstance(c_, Generate) for c_ in first), "dispatched before its weights were there"
    c.execute(outs)
    while not s.done and c.t < 5_000:
        c.execute(s.poll(c.t))
        c.tick()
    assert s.done
    assert [t.step for t in c.trained_by[p]] == [0, 1]
    sent = [r for g in c.sent for r in g.requests if s.policy_of(r.id) == p]
    assert sent and all(r.version % 2 == 1 for r in sent)


@settings(max_examples=25, deadline=None)
@given(
    first=st.sampled_from(MODES),
    joiner=st.sampled_from(MODES),
    seed=st.integers(0, 10_000),
    at=st.integers(0, 120),
    stop_at=st.one_of(st.none(), st.integers(0, 200)),
    events=CHURN,
)
def test_a_policy_joining_and_one_leaving_keep_every_ledger(first, joiner, seed, at, stop_at, events):
    """A second policy (any mode) joins at a random tick while engines join, leave and die, and the first
    may be stopped (it leaves, finishing the steps it issued): every policy trains the steps it
    issued, none trains a sample twice, each ledger identity holds at every poll (the schedulers raise
    otherwise) and nothing is sent to an engine that left."""
    s = PolicySet(["a"], [sched(first, 6, engines=2)], room=2)
    c = JoinCluster(s, lengths(seed), slots=3, train_ticks=3, load_ticks=1)
    plan = dict(events)
    while not (s.done and len(s) == 2) and c.t < 20_000:
        if c.t == at:
            c.add_policy("b", sched(joiner, 4))
        if c.t == stop_at:
            s[0].stop()
        what = plan.pop(c.t, None)
        live = [e.id for e in s.engines]
        if what == "join":
            c.join_engine()
        elif what == "leave" and len(live) > 1:
            c.leave_engine(live[-1])
        elif what == "lose" and live:
            c.lose_engine(live[0])
        c.execute(s.poll(c.t))
        c.tick()
    assert s.done and len(s) == 2
    c.execute(s.poll(c.t))
    for p in range(2):
        assert [t.step for t in c.trained_by[p]] == list(range(s[p].spec.total_steps))
        ks = keys(c.trained_by[p])
        assert len(ks) == len(set(ks)) == s[p].ledger.trained
    assert len(c.trained_by[1]) == 4
    assert not any(e.in_flight for p in range(2) for e in s[p].engines)  # the done ones wound down


@pytest.mark.parametrize("mode", ["sync", "async", "multiversion", "partial"])
def test_a_policy_that_leaves_frees_its_slots_once_done(mode):
    """A policy stopped mid-round (it leaves, or its time is up) trains the steps it issued; its requests
    still on the engines then are aborted (partials discarded as "done"), so the policies still
    training get every slot from the next tick on."""
    s = PolicySet(["a", "b"], [sched(mode, 40, engines=2), sched("sync", 12, engines=2)])
    c = JoinCluster(s, lengths(3), slots=3, train_ticks=3, load_ticks=1)
    done_at = stopped = None
    while not s.done and c.t < 5_000:
        if stopped is None and c.t >= 25 and any(e.in_flight for e in s[0].engines):
            stopped = c.t  # while it generates
            s[0].stop()
        c.execute(s.poll(c.t))
        if s[0].done and done_at is None:
            done_at = c.t  # its aborts went out with this poll
        c.tick()
    assert done_at is not None and s.done and s[0].steps_done < 40
    assert not [t for t in c.running_by[0] if t > done_at], "the done policy kept generating"
    assert s[0].ledger.discarded["done"] > 0  # it had work on the engines when it finished (not vacuous)
    assert not any(e.in_flight for e in s[0].engines)
