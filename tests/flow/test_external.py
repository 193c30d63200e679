"""An external agent's requests and groups (flow/external.py, flow.mode=external) on the scripted
cluster: the agent asks for completions of its own prompts, scores them, and sends groups back; the
policy trains them, U a step, each once, none past its staleness bound."""

import json

import pytest

from tailrace.flow.external import ExternalError
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.records import Opened
from tailrace.types import GenRequest, SamplingParams
from tests.flow.scripted import ScriptedCluster, prompts, restore

G, U = 2, 2


def external_sched(steps=4, K=1, engines=2, mode="external", zero_signal="train"):
    return Scheduler(
        make_policy(mode, zero_signal, max_staleness=K),
        prompts(),
        [(3, 2)] * engines,
        FlowSpec(4, G, U, steps),
    )


class Agent:
    """Keeps `prompts` prompts in flight, G completions each; scores a finished prompt's completions
    (reward: the choice index's parity) and sends them as a group once `hold` ticks have passed."""

    def __init__(self, s, c, prompts=3, hold=0, reward=lambda p, i: float(i % 2)):
        self.s, self.c, self.n, self.hold, self.reward = s, c, prompts, hold, reward
        self.next = 0
        self.waiting: dict[int, set[str]] = {}  # prompt -> its requests not finished
        self.results: dict[str, object] = {}
        self.ready: list[tuple[int, int]] = []  # (tick it finished, prompt)
        self.groups: list[int] = []

    def act(self) -> None:
        for r in self.s.take_external():
            self.results[r.request_id] = r
            p = int(r.request_id.split(".")[1])
            self.waiting[p].discard(r.request_id)
            if not self.waiting[p]:
                del self.waiting[p]
                self.ready.append((self.c.t, p))
        while self.ready and self.ready[0][0] + self.hold <= self.c.t and not self.s.done:
            _, p = self.ready.pop(0)
            ids = [f"x.{p}.{i}" for i in range(G)]
            self.groups.append(self.s.submit_group(ids, [self.reward(p, i) for i in range(G)]))
        while len(self.waiting) < self.n and not self.s.done:
            p, self.next = self.next, self.next + 1
            self.waiting[p] = {f"x.{p}.{i}" for i in range(G)}
            for i in range(G):
                self.s.submit_external(GenRequest(f"x.{p}.{i}", (1, 2, p % 7 + 3), SamplingParams(seed=i), 0))


def drive(s, c, agent, ticks=5000):
    while not s.done and c.t < ticks:
        agent.act()
        c.execute(s.poll(c.t))
        c.tick()
    assert s.done
    c.execute(s.poll(c.t))


def test_an_agents_groups_train_each_once_u_a_step_and_nothing_of_the_policys_own():
    s = external_sched(steps=4)
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, train_ticks=3, pregen_len=4)
    a = Agent(s, c)
    drive(s, c, a)
    trained = [g.id for t in c.trained for g in t.groups]
    assert len(trained) == len(set(trained)) == 4 * U and set(trained) <= set(a.groups)
    assert s.ledger.trained == 4 * U * G
    opened = [e for e in c.journal if isinstance(e, Opened)]
    assert opened and all(e.external for e in opened)  # the policy opened no group of the task's
    for t in c.trained:  # each completion under a version the trainer had published, K = 1 at most
        for g in t.groups:
            assert all(t.trainer_version - x.oldest_version <= 1 for x in g.trajectories)
            assert [x.reward for x in g.trajectories] == [0.0, 1.0]
    assert max(x.result.versions[0] for t in c.trained for g in t.groups for x in g.trajectories) >= 2


@pytest.mark.parametrize("hold", [6, 40])
def test_the_engines_take_only_requests_whose_groups_can_train_and_late_groups_are_dropped(hold):
    """K = 0: a group must train at the version it was made by. An agent that sends its groups 6 ticks
    after they finish: the engines take no more requests than the next step can train (the finished
    ones on their way count), so none goes stale. One that holds them 40 ticks, past the lease
    (`LEASE_S`, ticks here): the engines move on without them, and they are dropped as stale at the
    store's exit."""
    s = external_sched(steps=3, K=0)
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, train_ticks=3, pregen_len=4)
    a = Agent(s, c, prompts=4, hold=hold)
    drive(s, c, a)
    led = s.ledger_record()
    assert led["discarded"].get("stale", 0) == G * s.groups_dropped["stale"]
    assert (s.groups_dropped["stale"] > 0) == (hold > 30)
    assert s.ledger.trained == 3 * U * G


def test_zero_signal_groups_are_dropped_at_the_exit_within_the_allowance_and_the_agent_sends_more():
    """flow.zero_signal=replace: every third prompt's completions all score 0; such groups leave untrained
    (at most U a step), the steps train the groups with signal."""
    s = external_sched(steps=4, zero_signal="replace")
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, train_ticks=3, pregen_len=4)
    a = Agent(s, c, reward=lambda p, i: 0.0 if p % 3 == 0 else float(i % 2))
    drive(s, c, a)
    assert s.groups_dropped["zero-signal"] > 0
    assert s.ledger_record()["discarded"]["zero-signal"] == G * s.groups_dropped["zero-signal"]
    trained = [g for t in c.trained for g in t.groups]
    assert len(trained) == 4 * U and all(len({x.reward for x in g.trajectories}) > 1 for g in trained)


def test_an_engine_lost_with_an_agents_requests_generates_them_again():
    s = external_sched(steps=2)
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, train_ticks=3, pregen_len=6)
    a = Agent(s, c)
    for _ in range(3):
        a.act()
        c.execute(s.poll(c.t))
        c.tick()
    held = set(s.engine(0).in_flight)
    assert held and all(rid.startswith("x.") for rid in held)
    assert c.lose_engine(0) == len(held)
    assert {r.id for r in s.external.todo} == held  # back in the queue, to go elsewhere
    drive(s, c, a)
    assert s.ledger.trained == 2 * U * G


def test_a_group_is_refused_in_one_line_naming_the_problem():
    s = external_sched()
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, pregen_len=2)
    for i in range(3):
        s.submit_external(GenRequest(f"x.a.{i}", (1, 2, 3), SamplingParams(), 0))
    s.submit_external(GenRequest("x.b.0", (1, 2, 4), SamplingParams(), 0))
    with pytest.raises(ExternalError, match="in use"):
        s.submit_external(GenRequest("x.a.0", (1, 2, 3), SamplingParams(), 0))
    with pytest.raises(ExternalError, match="must start with 'x.'"):
        s.submit_external(GenRequest("a.0", (1, 2, 3), SamplingParams(), 0))
    for _ in range(4):
        c.execute(s.poll(c.t))
        c.tick()
    assert sorted(r.request_id for r in s.take_external()) == ["x.a.0", "x.a.1", "x.a.2", "x.b.0"]
    with pytest.raises(ExternalError, match="2 completions of one prompt .* got 3"):
        s.submit_group(["x.a.0", "x.a.1", "x.a.2"], [1, 0, 1])
    with pytest.raises(ExternalError, match="different prompts"):
        s.submit_group(["x.a.0", "x.b.0"], [1, 0])
    with pytest.raises(ExternalError, match="finite number"):
        s.submit_group(["x.a.0", "x.a.1"], [1, float("nan")])
    with pytest.raises(ExternalError, match="not finished completions"):
        s.submit_group(["x.a.0", "x.zz"], [1, 0])
    s.submit_group(["x.a.0", "x.a.1"], [1, 0])
    with pytest.raises(ExternalError, match=r"\['x.a.1'\] are not finished .* already in a group"):
        s.submit_group(["x.a.2", "x.a.1"], [1, 0])
    assert s.ledger_record()["produced"] == 2  # the group's; completions outside groups are none
    sync = external_sched(mode="sync")
    with pytest.raises(ExternalError, match="flow.mode=sync makes its own groups"):
        sync.submit_group(["x.a.0", "x.a.1"], [1, 0])


def test_an_agents_groups_survive_a_resume_through_checkpoint_and_journal():
    """Groups sent after the last checkpoint come back from the journal, whole; the resumed run trains
    every step, each group once across both runs."""
    s = external_sched(steps=6)
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, train_ticks=4, pregen_len=4)
    a = Agent(s, c, prompts=4)
    ckpt = None
    while s.steps_done < 3:
        a.act()
        c.execute(s.poll(c.t))
        before = s.steps_done
        c.tick()
        if s.steps_done > before == 1:  # the checkpoint after step 2; the crash after step 3
            out = s.poll(c.t)
            ckpt, at = json.loads(json.dumps(s.state_dict())), len(c.trained)
            c.execute(out)
    sent_after = [e.group for e in c.journal[ckpt["journal_seq"] :] if isinstance(e, Opened)]
    assert sent_after  # groups the checkpoint does not hold
    s2 = external_sched(steps=6)
    restore(s2, ckpt, c.journal)
    c2 = ScriptedCluster(s2, lambda g, i: 4, slots=3, train_ticks=4, pregen_len=4)
    c2.loaded = [set(e.loaded) for e in s2.engines]  # the engines start with the checkpoint's weights
    a2 = Agent(s2, c2, prompts=4)
    a2.next = 1000  # its own prompt ids (the first run's requests are gone with it)
    drive(s2, c2, a2)
    trained = [g.id for t in c.trained[:at] + c2.trained for g in t.groups]
    assert len(trained) == len(set(trained)) == 6 * U
    assert set(sent_after) & set(trained)  # journaled groups trained after the resume
    assert c2.trained[0].step == 2  # the step the crash lost, trained again


def test_a_cancelled_request_stops_and_leaves_nothing_behind():
    """The agent's client went away: a waiting request never goes, a running one is aborted, and neither
    comes back, is generated again or stays in the books; the other request finishes."""
    s = external_sched(engines=1)
    c = ScriptedCluster(s, lambda g, i: 4, slots=3, pregen_len=20)
    for rid in ("x.a", "x.b"):
        s.submit_external(GenRequest(rid, (1, 2, 3), SamplingParams(), 0))
    for _ in range(2):
        c.execute(s.poll(c.t))
        c.tick()
    s.submit_external(GenRequest("x.c", (1, 2, 3), SamplingParams(), 0))
    s.cancel_external(["x.a", "x.c"])  # x.a running, x.c not yet dispatched
    for _ in range(25):
        c.execute(s.poll(c.t))
        c.tick()
    assert [r.request_id for r in s.take_external()] == ["x.b"]
    assert not s.external.todo and not s.external.flight and not s.external.cancelled
    assert list(s.external.kept) == ["x.b"] and not s.engine(0).in_flight
