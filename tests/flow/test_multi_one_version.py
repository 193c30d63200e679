"""Several policies on engines that hold one weight version at a time (vLLM, rollout.max_versions=1):
each engine serves one policy at a time, its owner, and moves to another policy only once its owner
has no use for it (flow/multi.py). The scripted cluster's one-version engines refuse a load while
busy and a request of a version they do not hold, so a run that finishes kept those rules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.types import Capabilities
from tests.flow.scripted import prompts
from tests.flow.test_multi import CHURN, MultiCluster, churn, keys, lengths

ONE = Capabilities(abort_resume=False, versions_at_once=1, per_request_seed=True, speculative=False)
MODES = ["sync", "pipe", "multiversion"]  # the modes one-version engines take (multiversion: dedicated)


def one_version_set(modes, steps, engines=2, slots=3, R=4, G=2, U=2):
    """`R`: prompts a round, or one count per policy."""
    rounds = R if isinstance(R, tuple) else (R,) * len(modes)
    scheds = [
        Scheduler(
            make_policy(m, max_staleness=1, placement="dedicated"),
            prompts(),
            [(slots, 2)] * engines,
            FlowSpec(r, G, U, n),
            capabilities=ONE,
        )
        for m, n, r in zip(modes, steps, rounds)
    ]
    return PolicySet([f"p{i}" for i in range(len(modes))], scheds)


class OneVersionCluster(MultiCluster):
    """The shared scripted engines, each starting with its owner's weights only; it checks after every
    tick that each engine holds at most one engine version and runs its owner's requests only."""

    def __init__(self, s: PolicySet, *args, **kw):
        super().__init__(s, *args, one_version=True, **kw)
        self.loaded = [{s.version(s.owner(e), 0)} for e in range(len(self.loaded))]
        self.owners_seen: set[tuple[int, int]] = set()  # (engine, policy) pairs seen

    def tick(self) -> None:
        super().tick()
        for e in self.s.engines:
            p = self.s.owner(e.id)
            self.owners_seen.add((e.id, p))
            assert len(self.loaded[e.id]) <= 1
            running = self.running[e.id] + self.queue[e.id]
            assert {self.s.policy_of(r.request.id) for r in running} <= {p}


def finish(s, seed=0, **kw):
    c = OneVersionCluster(s, lengths(seed), slots=3, train_ticks=kw.pop("train_ticks", 6), load_ticks=2, **kw)
    c.run()
    return c


def assert_exact(s, c, steps):
    for p, n in enumerate(steps):
        assert [t.step for t in c.trained_by[p]] == list(range(n))
        ks = keys(c.trained_by[p])
        assert len(ks) == len(set(ks)) == s[p].ledger.trained


@pytest.mark.parametrize("modes", [("sync", "sync"), ("sync", "multiversion"), ("pipe", "sync", "sync")])
def test_each_policy_trains_exactly_on_engines_that_hold_one_version(modes):
    steps = tuple(4 + 2 * i for i in range(len(modes)))
    s = one_version_set(modes, steps, engines=len(modes))
    c = finish(s)
    assert_exact(s, c, steps)
    for p in range(len(modes)):  # its own weights only, each engine one version at a time (the cluster)
        assert set(s[p].staleness) <= {0, 1}


def test_a_policy_whose_engines_left_takes_one_another_policy_can_spare():
    """Engines 0 and 2 serve policy 0, 1 and 3 policy 1. Both of policy 0's leave: it takes one of
    policy 1's once that one is idle (never policy 1's last), loads its own weights there, and both
    policies train every step."""
    s = one_version_set(["sync", "pipe"], (6, 6), engines=4)
    c = OneVersionCluster(s, lengths(1), slots=3, train_ticks=4, load_ticks=2)
    while s[0].steps_done < 2:
        c.execute(s.poll(c.t))
        c.tick()
    assert [s.owner(e) for e in range(4)] == [0, 1, 0, 1]
    c.leave_engine(0)
    c.leave_engine(2)
    c.run()
    assert_exact(s, c, (6, 6))
    lent = [m.data for m in c.marks if m.kind == "engine_lent"]
    assert len(lent) == 1 and lent[0]["to"] == "p0"
    assert sorted(s.owner(e.id) for e in s.engines) == [0, 1]


def test_fewer_engines_than_policies_is_refused_naming_the_fix():
    s = one_version_set(["sync", "sync"], (2, 2), engines=1)
    with pytest.raises(ValueError, match="raise rollout.engines to 2"):
        s.poll(0.0)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(MODES), min_size=2, max_size=3), st.integers(0, 10_000), CHURN)
def test_join_leave_and_loss_keep_every_policys_ledger_on_one_version_engines(modes, seed, events):
    """Engines join, leave and die at random ticks: every policy still trains each of its steps once,
    on engines that hold one version at a time (a policy left without an engine waits for one)."""
    steps = tuple(4 + 2 * i for i in range(len(modes)))
    s = one_version_set(modes, steps, engines=len(modes) + 1)
    c = OneVersionCluster(s, lengths(seed), slots=3, train_ticks=3, load_ticks=1)
    churn(s, c, events, keep=len(modes))
    assert_exact(s, c, steps)
