"""Crash anywhere, resume from the last checkpoint + journal: nothing lost, no step repeated."""

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.records import Finished, dumps, journal_from_json
from tests.flow.scripted import ScriptedCluster, prompts

R, K, STEPS = 3, 2, 6


def build(U, zero_signal="train"):
    return Scheduler(make_policy("sync", zero_signal), prompts(), [(3, 1)], FlowSpec(R, K, U, STEPS))


def reward(g, i):
    """Every third group gives equal rewards (zero-signal)."""
    return float(i % 2) if g % 3 else 0.0


def run_until_crash(s, c, every, crash_tick):
    """Returns the journal as written (JSON lines) and the last checkpoint (as JSON)."""
    ckpt = None
    while not s.done and c.t < crash_tick:
        c.execute(s.poll(c.t))
        before = s.steps_done
        c.tick()
        if s.steps_done > before and s.steps_done % every == 0:
            c.execute(s.poll(c.t))  # as the driver: the outbox is recorded before the checkpoint
            ckpt = json.loads(json.dumps(s.state_dict()))  # the moment that step is durable
    return [dumps(e) for e in c.journal], ckpt


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    crash_tick=st.integers(5, 120),
    every=st.sampled_from([1, 2]),
    U=st.sampled_from([1, 3]),
    zero_signal=st.sampled_from(["train", "replace"]),
)
def test_crash_and_resume(seed, crash_tick, every, U, zero_signal):
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), rng.randint(1, 12))

    s = build(U, zero_signal)
    c = ScriptedCluster(s, length, slots=3, train_ticks=3, reward=reward)
    journal, ckpt = run_until_crash(s, c, every, crash_tick)
    if ckpt is None or s.done:
        return
    s2 = build(U, zero_signal)
    s2.load_state_dict(ckpt)
    tail = [journal_from_json(json.loads(line)) for line in journal[ckpt["journal_seq"] :]]
    s2.replay(tail)
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, reward=reward)
    c2.t = c.t
    c2.loaded = [{ckpt["version"]}]  # engines restart holding the checkpointed weights
    c2.run()

    steps = [t.step for t in c2.trained]
    assert steps == list(range(ckpt["steps_done"], STEPS)), "a step was repeated or skipped"
    trained = [(tr.group, tr.sample_index) for t in c2.trained for g in t.groups for tr in g.trajectories]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    s2.ledger.check(s2.in_store())
    assert s2.ledger.trained == STEPS * U * K
    # trajectories finished after the checkpoint came back from the journal instead of being regenerated,
    # unless their weights were lost with the crash (then they are discarded with a reason)
    replayed = {
        (e.trajectory.group, e.trajectory.sample_index)
        for e in tail
        if isinstance(e, Finished) and max(e.trajectory.versions) <= ckpt["version"]
    }
    regenerated = {(k.group, k.index) for k in c2.generated}
    assert not (replayed & regenerated)
    lost = len([e for e in tail if isinstance(e, Finished)]) - len(replayed)
    assert s2.ledger.discarded.get("resume:weights-lost", 0) == lost
    dropped = s2.ledger_record()["groups"]["dropped"].get("zero-signal", 0)
    assert s2.ledger.discarded.get("zero-signal", 0) == K * dropped
    if zero_signal == "train":
        assert dropped == 0
    if every == 1:
        assert lost == 0, "with a checkpoint per step, no finished trajectory may be lost"
    # strictly on-policy after resume too
    assert set(s2.staleness) == {0}


def test_trajectory_records_round_trip_through_json_with_every_field():
    import dataclasses

    from tailrace.records import trajectory_from_json, trajectory_to_json
    from tailrace.types import Finish, GenResult, Trajectory

    r = GenResult("3.1.0", (5, 6, 7), (-0.5, -1.25, -0.125), (2, 2, 3), Finish.ABORTED, 1.0, 2.0, 3.0)
    t = Trajectory(
        group=3,
        sample_index=1,
        prompt_id=17,
        prompt_ids=(1, 9),
        result=r,
        reward=0.5,
        correct=False,
        dispatch_version=2,
        observed=((1, 2),),
        tool_s=0.25,
    )
    # every field above is set to a value other than its default, so equality after the round trip
    # proves each one is serialized; a new field fails here until it is added above (and serialized)
    assert {f.name for f in dataclasses.fields(Trajectory)} == set(
        "group sample_index prompt_id prompt_ids result reward correct dispatch_version observed tool_s".split()
    )
    assert {f.name for f in dataclasses.fields(GenResult)} == set(
        "request_id token_ids logprobs versions finish submitted first_token finished routes".split()
    )
    d = json.loads(json.dumps(trajectory_to_json(t)))
    assert trajectory_from_json(d, t.prompt_ids) == t  # prompt ids live with the group's prompt
    # but an MoE's routes (routing replay: bytes per position) stay out of the journal, by design
    routed = dataclasses.replace(t, result=dataclasses.replace(r, routes=bytes(range(8))))
    assert trajectory_from_json(json.loads(json.dumps(trajectory_to_json(routed))), t.prompt_ids) == t


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    crash_tick=st.integers(5, 120),
    on_disk=st.booleans(),
    zero_signal=st.sampled_from(["train", "replace"]),
    every=st.sampled_from([1, 2]),
)
def test_multiversion_resumes_groups_of_older_versions(seed, crash_tick, on_disk, zero_signal, every):
    """A multiversion checkpoint holds open groups of the version before it. Their pending samples are
    dispatched under that version once a kept checkpoint gives it back (`restore_version`); without
    one the groups start over under the checkpoint's (`restart_groups`). Groups the journal opened
    under weights newer than the checkpoint are un-opened, their prompts served again (every=2). Either
    way the run ends: no step repeated, no trajectory trained twice, every trajectory of one version
    within the bound."""
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), rng.randint(1, 12))

    def mv():
        policy = make_policy("multiversion", zero_signal, max_staleness=1)
        return Scheduler(policy, prompts(), [(3, 1)], FlowSpec(4, K, 2, STEPS))

    s = mv()
    c = ScriptedCluster(s, length, slots=3, train_ticks=3, reward=reward)
    journal, ckpt = run_until_crash(s, c, every, crash_tick)
    if ckpt is None or s.done:
        return
    s2 = mv()
    s2.load_state_dict(ckpt)
    s2.replay([journal_from_json(json.loads(line)) for line in journal[ckpt["journal_seq"] :]])
    older = s2.pending_versions() - {ckpt["version"]}
    loaded = {ckpt["version"]}
    if on_disk:
        for v in older:
            s2.restore_version(v)
        loaded |= older
    else:
        restarted = s2.restart_groups(older, ckpt["version"])
        assert (restarted > 0) == bool(older) and not s2.pending_versions() - {ckpt["version"]}
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, reward=reward)
    c2.t = c.t
    c2.loaded = [set(loaded)]
    c2.run(max_ticks=20_000)
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], STEPS))
    trained = [(tr.group, tr.sample_index) for t in c2.trained for g in t.groups for tr in g.trajectories]
    assert len(trained) == len(set(trained))
    s2.ledger.check(s2.in_store())
    for t in c2.trained:
        for g in t.groups:
            for tr in g.trajectories:
                assert len(set(tr.versions)) == 1 and t.trainer_version - tr.versions[0] <= 1
