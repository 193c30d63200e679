"""Multi-turn samples in the scheduler: a turn ending in a tool call parks (its engine slot free) until
the observation comes; the continuation carries the whole context; the ledger stays exact."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import SyncPolicy, make_policy
from tailrace.flow.scheduler import FlowSpec, InvariantError, Scheduler
from tailrace.records import Finished, trajectory_from_json, trajectory_to_json
from tailrace.types import SamplingParams
from tests.flow.scripted import ScriptedCluster, prompts

OBS = (5, 5)


def make(R=2, K=2, U=2, steps=2, engines=((2, 0),), max_new=100):
    return Scheduler(
        SyncPolicy(),
        prompts(),
        list(engines),
        FlowSpec(R, K, U, steps),
        SamplingParams(max_new_tokens=max_new),
    )


def trained(c):
    return [t for step in c.trained for g in step.groups for t in g.trajectories]


def test_a_trajectory_holds_every_turn_and_masks_its_observations():
    s = make()
    c = ScriptedCluster(s, length=None, slots=2, turns=lambda g, i: [3, 2, 4], observation=OBS)
    c.run()
    for t in trained(c):
        r = t.result
        assert r.token_ids == (7,) * 3 + OBS + (7,) * 2 + OBS + (7,) * 4
        assert t.observed == ((3, 5), (7, 9))
        assert all(r.logprobs[i] == 0.0 for a, b in t.observed for i in range(a, b))
        assert set(r.versions) == {0} or set(r.versions) == {1}
        assert t.tool_s == 6  # two calls of 3 ticks each
    assert c.calls == 2 * 8 and s.at_tool == 0
    assert s.ledger.produced == s.ledger.trained == 8  # one trajectory per sample, however many turns


def test_the_continuation_keeps_the_episode_seed_and_the_turns_budget():
    s = make(R=1, K=1, U=1, steps=1)
    sent = []
    c = ScriptedCluster(s, length=None, slots=1, turns=lambda g, i: [3, 2], observation=OBS)
    while not s.done:
        out = s.poll(c.t)
        sent += [r for cmd in out.commands for r in getattr(cmd, "requests", ())]
        c.execute(out)
        c.tick()
    first, cont = sent
    assert cont.params.seed == first.params.seed and cont.id != first.id
    assert cont.resume_ids == (7, 7, 7) + OBS and cont.resume_logprobs[3:] == (0.0, 0.0)
    assert cont.resume_versions == (0,) * 5 and cont.prompt_ids == first.prompt_ids
    assert cont.resume_routes == bytes(3)  # the turn's routes (routing replay), for its continuation


def test_a_parked_sample_frees_its_slot_for_others():
    """One slot, two samples: the first's tool takes 20 ticks; the second runs to its end meanwhile."""
    s = make(R=1, K=2, U=1, steps=1, engines=((1, 1),))
    slow = {0: 20, 1: 1}
    c = ScriptedCluster(
        s,
        length=None,
        slots=1,
        turns=lambda g, i: [2, 2] if i == 0 else [4],
        tool_ticks=lambda g, i, k: slow[i],
    )
    c.run()
    a = next(t for t in trained(c) if t.sample_index == 0)
    finished = [e.trajectory.sample_index for e in c.journal if isinstance(e, Finished)]
    assert finished == [1, 0] and a.tool_s == 20


def test_observation_cut_to_the_response_budget():
    s = make(R=1, K=1, U=1, steps=1, max_new=6)
    c = ScriptedCluster(s, length=None, slots=1, turns=lambda g, i: [4, 1], observation=(5, 5, 5))
    c.run()
    (t,) = trained(c)
    assert t.observed == ((4, 5),) and t.result.token_ids == (7, 7, 7, 7, 5, 7)


def test_engine_lost_mid_episode_regenerates_the_sample_from_its_prompt():
    s = make(R=1, K=2, U=1, steps=1, engines=((2, 0), (2, 0)))
    c = ScriptedCluster(s, length=None, slots=2, turns=lambda g, i: [2, 3], tool_ticks=lambda g, i, k: 2)
    lost = False
    while not s.done:
        c.execute(s.poll(c.t))
        if not lost and any(r.key.attempt == 1 for e in c.running for r in e):
            e = next(i for i, run in enumerate(c.running) if any(r.key.attempt == 1 for r in run))
            assert c.lose_engine(e) >= 1
            lost = True
        c.tick()
    c.execute(s.poll(c.t))
    assert lost
    for t in trained(c):
        assert t.observed == ((2, 4),) and t.length == 7
    assert s.ledger.produced == s.ledger.trained == 2


def test_checkpoint_sends_parked_samples_back_to_do_and_journal_keeps_the_mask():
    s = make(R=1, K=2, U=1, steps=1)
    c = ScriptedCluster(s, length=None, slots=2, turns=lambda g, i: [2, 3], tool_ticks=lambda g, i, k: 50)
    while s.at_tool < 2:
        c.execute(s.poll(c.t))
        c.tick()
    state = json.loads(json.dumps(s.state_dict()))
    assert state["open"][0]["todo"] == [0, 1] and state["open"][0]["dispatched"] == 0
    s2 = make(R=1, K=2, U=1, steps=1)
    s2.load_state_dict(state)  # a resumed run: the parked samples are generated again, whole
    c2 = ScriptedCluster(s2, length=None, slots=2, turns=lambda g, i: [2, 3], tool_ticks=lambda g, i, k: 1)
    c2.run()
    assert s2.ledger.produced == s2.ledger.trained == 2
    c.run()
    t = trained(c)[0]
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))), t.prompt_ids)
    assert back == replace(t, result=replace(t.result, routes=b"")) and back.observed == ((2, 4),)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.integers(1, 4), K=st.integers(1, 4), slots=st.integers(1, 5))
def test_ledger_identity_holds_in_multi_turn_runs(seed, R, K, slots):
    rng = random.Random(seed)
    turns, ticks = {}, {}
    s = Scheduler(
        SyncPolicy(), prompts(), [(slots, rng.randint(0, 2))] * rng.randint(1, 3), FlowSpec(R, K, R, 3),
        SamplingParams(max_new_tokens=1000),
    )  # fmt: skip
    c = ScriptedCluster(
        s, length=None, slots=slots,
        turns=lambda g, i: turns.setdefault((g, i), [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]),
        tool_ticks=lambda g, i, k: ticks.setdefault((g, i, k), rng.randint(0, 8)),
    )  # fmt: skip
    c.run()  # the scheduler checks produced = trained + in_store + discarded at every poll
    led = s.ledger
    assert led.produced == led.trained + s.in_store() + sum(led.discarded.values())
    assert led.trained == 3 * R * K and s.at_tool == 0
    for t in trained(c):
        n = len(turns[(t.group, t.sample_index)])
        assert len(t.observed) == n - 1 and t.length == sum(turns[(t.group, t.sample_index)]) + 2 * (n - 1)


def test_a_call_on_the_last_token_of_the_budget_cannot_park():
    """Its continuation would have no token left: the engine would finish it without a step (and so
    without reporting it); the driver scores such a turn instead, and the scheduler refuses to wait."""
    s = make(R=1, K=1, U=1, steps=1, max_new=4)
    c = ScriptedCluster(s, length=None, slots=1, turns=lambda g, i: [4, 1], tool_ticks=lambda g, i, k: 1)
    with pytest.raises(InvariantError, match="last token of its budget"):
        c.run(max_ticks=50)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["sync", "pipe", "async", "partial", "multiversion", "multiversion-dedicated"]),
    seed=st.integers(0, 10_000),
    engines=st.integers(1, 2),
    slots=st.integers(1, 5),
    train_ticks=st.integers(1, 10),
)
def test_tool_turns_run_in_every_mode_within_its_promises(mode, seed, engines, slots, train_ticks):
    """A sample parked at a tool comes back under the weights its mode allows: its own version (every
    mode but partial: one version per trajectory), or the newest (partial: tokens keep their versions);
    the staleness bound and the ledger hold, and every sample's turns all reach the trainer."""
    rng = random.Random(seed)
    turns, ticks = {}, {}
    name, _, placement = mode.partition("-")
    policy = make_policy(name, max_staleness=2, placement=placement or "shared")
    s = Scheduler(
        policy, prompts(), [(slots, 1)] * engines, FlowSpec(4, 2, 2, 6), SamplingParams(max_new_tokens=1000)
    )
    c = ScriptedCluster(
        s, length=None, slots=slots, train_ticks=train_ticks,
        turns=lambda g, i: turns.setdefault((g, i), [rng.randint(1, 8) for _ in range(rng.randint(1, 3))]),
        tool_ticks=lambda g, i, k: ticks.setdefault((g, i, k), rng.randint(0, 12)),
    )  # fmt: skip
    c.run(max_ticks=20_000)
    assert len(c.trained) == 6 and s.ledger.trained == 6 * 2 * 2 and s.at_tool == 0
    s.ledger.check(s.in_store())
    # no engine leaves here, so every parked sample continues: none starts over from its prompt
    assert not [m for m in c.marks if m.kind == "continuation_requeued"]
    for step in c.trained:
        for g in step.groups:
            for t in g.trajectories:
                assert step.trainer_version - min(t.versions) <= (0 if name in ("sync", "pipe") else 2)
                if name == "partial":
                    assert list(t.versions) == sorted(t.versions)
                else:
                    assert len(set(t.versions)) == 1, "a trajectory mixed versions"
                n = len(turns[(t.group, t.sample_index)])
                assert len(t.observed) == n - 1
                assert t.length == sum(turns[(t.group, t.sample_index)]) + 2 * (n - 1)
