"""The store's replay buffer (flow/replay.py): hand-checked picks (largest reward variance first, newest
first among equals, the staleness filter on exit, uses, capacity, zero-signal groups never held, a
group held by an unfinished step not picked twice); and, on the scripted cluster in every mode, the
promises a run with replay keeps: the ledger identity, every fresh sample trained once, every replay a
group trained by an earlier finished step, at most `uses` times, never older than `max_age`; a crash
and resume anywhere gives the same steps as the run that never stopped."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.replay import ReplayBuffer, ReplayOptions
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.types import Finish, GenResult, Prompt, Trajectory
from tests.flow.scripted import ScriptedCluster, prompts, random_lengths, restore, run_to_crash


def traj(group: int, i: int, reward: float, version: int) -> Trajectory:
    r = GenResult(f"{group}.{i}.0", (7, 8), (-0.5, -0.5), (version, version), Finish.STOP)
    return Trajectory(group=group, sample_index=i, prompt_id=group, prompt_ids=(1,), result=r, reward=reward,
                      correct=reward > 0, dispatch_version=version)  # fmt: skip


def trained(group: int, rewards: list[float], version: int) -> tuple[Prompt, int, list[Trajectory]]:
    return Prompt(group, (1,), str(group)), group, [traj(group, i, r, version) for i, r in enumerate(rewards)]


def buffer(**kw) -> ReplayBuffer:
    return ReplayBuffer(ReplayOptions(**{"ratio": 0.5, "capacity": 8, "max_age": 2, "uses": 1, **kw}))


def test_picks_the_largest_reward_variance_then_the_newest_and_never_zero_signal_groups():
    b = buffer(ratio=1.0)
    b.on_trained(0, [trained(1, [1, 0, 0, 0], 0), trained(2, [1, 1, 1, 1], 0), trained(3, [1, 0, 1, 0], 0)])
    b.on_trained(1, [trained(4, [0, 0, 0, 1], 1)])
    assert [e.group for e in b.entries] == [1, 3, 4]  # group 2 has no signal: never held
    # variances: 3 -> 0.25, 1 and 4 -> 0.1875 (4 is newer)
    assert [g.id for g in b.pick(2, fresh=2, trainer_version=2)] == [3, 4]
    assert [g.id for g in b.pick(3, fresh=2, trainer_version=2)] == [1]  # 3 and 4 are held by step 2


def test_ratio_rounds_per_step_and_uses_bound_the_replays():
    b = buffer(ratio=0.5, uses=2)
    b.on_trained(0, [trained(g, [1, 0], 0) for g in (1, 2, 3)])
    assert len(b.pick(1, fresh=3, trainer_version=1)) == 2  # round(0.5 x 3)
    b.on_trained(1, [])
    assert b.record()["replayed"] == 4 and [e.uses for e in b.entries] == [0, 1, 1]
    assert [g.id for g in b.pick(2, fresh=4, trainer_version=1)] == [3, 2]  # newest first
    b.on_trained(2, [])
    assert [e.group for e in b.entries] == [1]  # 2 and 3 used twice: gone


def test_the_staleness_filter_evicts_on_exit_untrained():
    b = buffer(ratio=1.0, max_age=2)
    b.on_trained(0, [trained(1, [1, 0], 0), trained(2, [1, 0], 2)])
    assert [g.id for g in b.pick(1, fresh=2, trainer_version=3)] == [2]  # 3 - 0 > 2: group 1 evicted
    assert b.record() == {"replayed": 0, "held": 1, "expired": 1}


def test_capacity_keeps_the_newest():
    b = buffer(capacity=2)
    b.on_trained(0, [trained(g, [1, 0], 0) for g in (1, 2, 3)])
    assert [e.group for e in b.entries] == [2, 3]


def test_a_checkpoint_between_a_pick_and_its_step_books_nothing():
    b = buffer(ratio=1.0)
    b.on_trained(0, [trained(1, [1, 0], 0)])
    b.pick(1, fresh=1, trainer_version=1)
    b2 = buffer(ratio=1.0)
    b2.load_json(json.loads(json.dumps(b.to_json())))
    assert [(e.group, e.uses) for e in b2.entries] == [(1, 0)] and b2.record()["replayed"] == 0
    assert [g.id for g in b2.pick(1, fresh=1, trainer_version=1)] == [1]  # the same step picks it again
    assert b2.entries[0].done == b.entries[0].done


MODES = ["sync", "pipe", "async", "partial", "multiversion"]
OPTS = ReplayOptions(ratio=0.5, capacity=6, max_age=3, uses=2)
R, G, U, STEPS = 4, 2, 2, 8


def build(mode: str) -> Scheduler:
    policy = make_policy(mode, max_staleness=1)
    return Scheduler(policy, prompts(), [(4, 2)], FlowSpec(R, G, U, STEPS), replay=OPTS)


def reward(g: int, i: int) -> float:
    return float((g + i) % 2) if g % 3 else 1.0  # every third group has no signal


def fresh_ids(c: ScriptedCluster, step: int) -> set[int]:
    """The groups step `step` trained fresh, as its (last) train_issued mark names them."""
    return set([m for m in c.marks if m.kind == "train_issued" and m.data["step"] == step][-1].data["groups"])


def check_replays(c: ScriptedCluster, s: Scheduler) -> None:
    first: dict[int, int] = {}  # group -> the step that trained it fresh
    uses: dict[int, int] = {}
    fresh = []
    for t in c.trained:
        ids = fresh_ids(c, t.step)
        for g in t.groups:
            if g.id in ids:
                first[g.id] = t.step
                fresh += [(g.id, tr.sample_index) for tr in g.trajectories]
                continue
            assert first[g.id] < t.step, "a replay of a group no earlier step trained"
            assert len({tr.reward for tr in g.trajectories}) > 1, "a zero-signal group replayed"
            assert t.trainer_version - min(min(tr.versions) for tr in g.trajectories) <= OPTS.max_age
            uses[g.id] = uses.get(g.id, 0) + 1
    assert len(fresh) == len(set(fresh)) == s.ledger.trained == STEPS * U * G
    assert all(n <= OPTS.uses for n in uses.values())
    s.ledger.check(s.in_store())
    assert s.replay_buffer.record()["replayed"] == G * sum(uses.values())


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000))
def test_every_mode_keeps_its_promises_with_replay(mode, seed):
    s = build(mode)
    c = ScriptedCluster(s, random_lengths(seed), slots=4, train_ticks=3, reward=reward)
    c.run(max_ticks=20_000)
    check_replays(c, s)
    assert s.replay_buffer.record()["replayed"] > 0


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 10_000), crash=st.integers(5, 150))
def test_a_resume_replays_what_the_run_that_never_stopped_replays(mode, seed, crash):
    whole = build(mode)
    cw = ScriptedCluster(whole, random_lengths(seed), slots=4, train_ticks=3, reward=reward)
    cw.run(max_ticks=20_000)
    s = build(mode)
    c = ScriptedCluster(s, random_lengths(seed), slots=4, train_ticks=3, reward=reward)
    ckpt = run_to_crash(s, c, lambda s, c, ckpt: c.t >= crash)
    if ckpt is None:
        return
    s2 = build(mode)
    restore(s2, ckpt, c.journal)
    s2.restart_groups(
        s2.pending_versions() - {ckpt["version"]}, ckpt["version"]
    )  # as the driver, no older weights
    c2 = ScriptedCluster(s2, random_lengths(seed), slots=4, train_ticks=3, reward=reward)
    c2.t, c2.loaded = c.t, [{ckpt["version"]}]
    c2.run(max_ticks=20_000)
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], STEPS))
    s2.ledger.check(s2.in_store())
    if mode == "sync":  # deterministic schedule: the same groups are replayed at the same steps
        assert [[g.id for g in t.groups] for t in c2.trained] == [
            [g.id for g in t.groups] for t in cw.trained[ckpt["steps_done"] :]
        ]


def test_replay_with_no_correction_is_refused_in_one_line():
    from tailrace.common import ConfigError
    from tailrace.config import load_config

    with pytest.raises(ConfigError, match="store.replay=0.25 with train.loss.correction=none"):
        load_config(None, ["--store.replay=0.25", "--train.loss.correction=none"])
    cfg = load_config(None, ["--store.replay=0.25", "--flow.mode=sync"])
    from tailrace.flow.policies import POLICIES

    assert POLICIES["sync"].own_correction(1, replay=cfg.store.replay > 0) == "behaviour"
    assert POLICIES["sync"].own_correction(1) == "none"
