"""Several policies in one run (`flow.multi.PolicySet`) on the scripted cluster: the engines are
shared, each policy has its own scheduler (mode, staleness bound, versions, ledger) and its own
trainer. Each scheduler checks its own staleness bound and ledger identity at every poll, so a run
that finishes has kept them per policy; the assertions add what the set promises."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.commands import Generate, LoadWeights, Train
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, InvariantError, Scheduler
from tailrace.types import Finish, GenResult
from tests.flow.scripted import ScriptedCluster, prompts

MODES = ["sync", "pipe", "async", "partial", "multiversion"]
CHURN = st.lists(
    st.tuples(st.integers(1, 60), st.sampled_from(["join", "leave", "lose"])), max_size=6
)  # `churn`


class MultiCluster(ScriptedCluster):
    """The scripted cluster's engines, shared by the policies of `s` (a PolicySet); one trainer per
    policy, each `train_ticks` a step."""

    def __init__(self, s: PolicySet, *args, **kw):
        super().__init__(s, *args, **kw)
        self.loaded = [{s.version(p, 0) for p in range(len(s))} for _ in self.loaded]  # every policy's start
        self.trainers: list[list[Train]] = [[] for _ in range(len(s))]
        self.left = [0] * len(s)
        self.trained_by: list[list[Train]] = [[] for _ in range(len(s))]
        self.training_ticks: list[set[int]] = [set() for _ in range(len(s))]  # ticks each trainer worked
        self.running_by: list[dict[int, int]] = [{} for _ in range(len(s))]  # tick -> its rows running
        self.sent: list[Generate] = []

    def execute(self, outs) -> None:
        for out in outs:
            for c in out.commands:
                if isinstance(c, Generate):
                    self.sent.append(c)
            trains = [c for c in out.commands if isinstance(c, Train)]
            out.commands = [c for c in out.commands if not isinstance(c, Train)]
            for c in trains:
                self.trainers[c.policy].append(c)
            super().execute(out)

    def tick(self) -> None:
        super().tick()
        for e in range(len(self.running)):
            for r in self.running[e]:
                p = self.s.policy_of(r.request.id)
                self.running_by[p][self.t] = self.running_by[p].get(self.t, 0) + 1
        for p, queue in enumerate(self.trainers):
            if not queue:
                continue
            self.training_ticks[p].add(self.t)
            self.left[p] += 1
            if self.left[p] >= self.train_ticks:
                c = queue.pop(0)
                self.left[p] = 0
                self.trained_by[p].append(c)
                self.s[p].on_trained(c.step, self.t)
                if c.publish is not None:
                    self.s[p].on_published(c.publish, self.t)


def policy_set(modes, steps=None, engines=1, slots=4, K=1, R=4, G=2, U=2):
    scheds = [
        Scheduler(make_policy(m, max_staleness=K), prompts(), [(slots, 2)] * engines, FlowSpec(R, G, U, n))
        for m, n in zip(modes, steps or (4,) * len(modes))
    ]
    return PolicySet([f"p{i}" for i in range(len(modes))], scheds)


def lengths(seed):
    rng, memo = random.Random(seed), {}
    return lambda g, i: memo.setdefault((g, i), max(1, min(40, int(rng.lognormvariate(1.5, 0.8)))))


def churn(s, c, events, keep: int = 1) -> None:
    """Drive `s` on `c` to its end while engines join, leave (never below `keep` live) and die at the
    ticks `events` names ((tick, "join" | "leave" | "lose") pairs)."""
    plan = dict(events)
    while not s.done and c.t < 20_000:
        what = plan.pop(c.t, None)
        live = [e.id for e in s.engines]
        if what == "join":
            c.join_engine()
        elif what == "leave" and len(live) > keep:
            c.leave_engine(live[-1])
        elif what == "lose" and live:
            c.lose_engine(live[0])
        c.execute(s.poll(c.t))
        c.tick()
    assert s.done
    c.execute(s.poll(c.t))


def keys(trains):
    return [(t.group, t.sample_index) for c in trains for g in c.groups for t in g.trajectories]


def run(s, seed=0, slots=4, train_ticks=4):
    c = MultiCluster(s, lengths(seed), slots=slots, train_ticks=train_ticks, load_ticks=1)
    c.run()
    return c


def test_versions_and_ids_map_one_to_one():
    s = policy_set(["sync", "sync", "sync"])
    assert [s.version(p, v) for v in range(2) for p in range(3)] == [0, 1, 2, 3, 4, 5]
    assert all(s.policy_version(s.version(p, v)) == (p, v) for p in range(3) for v in range(5))
    assert s.split(s.request_id(2, "3.1.0")) == (2, "3.1.0")
    with pytest.raises(InvariantError, match="belongs to no policy"):
        s.split("q9/3.1.0")
    with pytest.raises(ValueError, match="unique"):
        PolicySet(["a", "a"], [s[0], s[1]])
    with pytest.raises(ValueError, match="without '/'"):
        PolicySet(["a/b"], [s[0]])


@pytest.mark.parametrize("modes", [("sync", "sync"), ("sync", "multiversion"), ("partial", "async")])
def test_each_policy_trains_its_own_steps_on_shared_engines(modes):
    s = policy_set(modes, steps=(4, 6))
    c = run(s)
    for p, n in enumerate((4, 6)):
        assert [t.step for t in c.trained_by[p]] == list(range(n))
        published = [t.publish for t in c.trained_by[p] if t.publish is not None]
        assert published == list(range(1, len(published) + 1))  # its own counter
        assert s[p].done_version == published[-1]
        ks = keys(c.trained_by[p])
        assert len(ks) == len(set(ks)) == n * 2 * 2  # U groups x G samples a step, none twice
        assert s[p].ledger.trained == n * 4
    # every engine request is in the engines' space: its version one of its own policy's, loaded
    for g in c.sent:
        for r in g.requests:
            p, _ = s.split(r.id)
            assert s.policy_version(r.version)[0] == p
    assert s.ledger_record()["p1"]["trained"] == 24


@pytest.mark.parametrize("modes", [("sync", "multiversion"), ("partial", "async")])
def test_parked_samples_of_two_policies_continue_under_their_own_versions(modes):
    """Multi-turn samples of two policies park at their tool calls and continue, each continuation in
    its own policy's engine versions (its resumed tokens' too), each trajectory whole and masked."""
    s = policy_set(modes, steps=(4, 6))
    c = MultiCluster(s, None, slots=4, train_ticks=3, load_ticks=1, turns=lambda g, i: [3, 2, 4])
    c.run()
    conts = [r for g in c.sent for r in g.requests if r.resume_ids]
    assert conts and c.calls == 2 * (4 + 6) * 4  # two calls a sample, U x G = 4 samples a step
    for r in conts:
        p = s.policy_of(r.id)
        assert {s.policy_version(v)[0] for v in (r.version, *r.resume_versions)} == {p}
    for p, n in enumerate((4, 6)):
        trajs = [t for step in c.trained_by[p] for g in step.groups for t in g.trajectories]
        assert len(trajs) == n * 4 and s[p].ledger.trained == n * 4
        assert all(t.observed == ((3, 5), (7, 9)) and len(t.result.token_ids) == 13 for t in trajs)


def test_a_result_carrying_another_policys_version_is_refused():
    s = policy_set(["sync", "sync"])
    out = s.poll(0.0)
    req = next(c for c in out[0].commands if isinstance(c, Generate)).requests[0]
    bad = GenResult(req.id, (5,), (0.0,), (s.version(1, 0),), Finish.STOP)
    with pytest.raises(InvariantError, match="policy p1's"):
        s.on_results(0, [bad], [], 1.0)


def test_loads_are_in_the_engines_space_and_reach_their_policy():
    s = policy_set(["sync", "sync"], steps=(4, 4))  # two rounds: version 1 is loaded for the second
    c = MultiCluster(s, lambda g, i: 3, slots=4, train_ticks=2, load_ticks=1)
    seen = []
    orig = c.execute

    def execute(outs):
        seen.extend(x for o in outs for x in o.commands if isinstance(x, LoadWeights))
        orig(outs)

    c.execute = execute
    c.run()
    assert {(x.version % 2, x.version // 2) for x in seen} >= {(0, 1), (1, 1)}
    assert s.loaded(0) >= {s.version(0, 1), s.version(1, 1)}


def test_two_on_policy_runs_share_the_engines_in_less_time_than_one_after_the_other():
    """Sync policies alone leave the engine idle while they train; together one generates while the
    other trains (each still strictly on-policy: its scheduler checks staleness 0)."""
    alone = [run(policy_set(["sync"], steps=(6,)), seed=3, train_ticks=12).t for _ in range(2)]
    c = run(policy_set(["sync", "sync"], steps=(6, 6)), seed=3, train_ticks=12)
    assert c.t < 0.8 * sum(alone)
    overlap = [t for t in c.training_ticks[0] if c.running_by[1].get(t)]
    assert overlap  # policy 1 generated while policy 0's trainer worked
    for p in range(2):
        assert set(c.s[p].staleness) == {0}


@settings(max_examples=25, deadline=None)
@given(
    modes=st.lists(st.sampled_from(MODES), min_size=2, max_size=3),
    seed=st.integers(0, 10_000),
    events=CHURN,
)
def test_join_leave_and_loss_keep_every_policys_ledger(modes, seed, events):
    """Engines join, leave and die at random ticks while several policies (any modes) share them: every
    policy trains all its steps, none trains a sample twice, each ledger identity holds at every poll
    (its scheduler raises otherwise), and nothing is ever sent to an engine that left."""
    steps = tuple(4 + 2 * i for i in range(len(modes)))  # whole rounds (2 steps each)
    s = policy_set(modes, steps=steps, engines=2)
    c = MultiCluster(s, lengths(seed), slots=3, train_ticks=3, load_ticks=1)
    churn(s, c, events)
    for p, n in enumerate(steps):
        assert [t.step for t in c.trained_by[p]] == list(range(n))
        ks = keys(c.trained_by[p])
        assert len(ks) == len(set(ks))
        led = s[p].ledger
        assert led.trained == len(ks)
