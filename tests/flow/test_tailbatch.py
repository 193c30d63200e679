"""RollPacker's tail batching on the scripted cluster (sync, and pipe): a short round opens eta_p x R prompts with
ceil(eta_r x M) candidates each, keeps each prompt's first M finishers and the first R prompts to
complete; the others are deferred to a queue that runs as one dedicated tail round once R of them wait.
Hand-checked schedules, then the ledger and the queue under random lengths, crashes and resumes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.flow.shaping.tailbatch import TailBatch
from tailrace.records import Deferred, Opened
from tests.flow.scripted import ScriptedCluster, every_third, prompts, random_lengths, restore, run_to_crash


def build(R, G, U, steps, eta=1.25, eta_responses=1.25, zero_signal="train", slots=16, mode="sync"):
    policy = make_policy(mode, zero_signal)
    shape = make_shaping("tailbatch", window=R, eta=eta, eta_responses=eta_responses)
    return Scheduler(policy, prompts(), [(slots, 0)], FlowSpec(R, G, U, steps), shaping=shape)


def trained(c):
    """Per step: (prompt id, sample indices) of each group trained."""
    return [[(g.prompt_id, [tr.sample_index for tr in g.trajectories]) for g in t.groups] for t in c.trained]


def test_a_short_round_keeps_the_first_finishers_and_defers_the_slowest_prompt():
    """R = 4, M = 2, eta 1.25: 5 prompts x 3 candidates. Groups become complete (2 finishers) at ticks
    g1: 4, g0: 5, g3: 6, g2: 7; g4's candidates are all far longer, so once the 4th group is complete
    g4 is deferred: its candidates are aborted and its prompt waits in the tail queue."""
    lengths = {0: [9, 3, 5], 1: [4, 2, 8], 2: [7, 3, 8], 3: [5, 6, 8], 4: [30, 40, 50]}
    s = build(R=4, G=2, U=2, steps=2)
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=16)
    c.run()
    assert trained(c) == [[(0, [1, 2]), (1, [0, 1])], [(2, [0, 1]), (3, [0, 1])]]  # in round order
    # each complete group's third candidate and all three of g4's were cut: produced, not trained
    assert s.ledger.state_dict() == {"produced": 15, "trained": 8, "discarded": {"shaping": 7}}
    assert [p.id for p in s.shaping.queue] == [4]
    assert c.t < 30, "the round waited for the deferred prompt's tail"
    starts = [m.data for m in c.marks if m.kind == "round_start"]
    assert [(len(d["groups"]), d["tail"]) for d in starts] == [(5, False)]


def test_deferred_prompts_run_together_in_a_tail_round_once_r_of_them_wait():
    """R = 2, M = 2, eta_p 1.5 (3 prompts a round, 2 kept), eta_r 1 (no extra candidates): rounds 1
    and 2 each defer their slowest prompt (groups 2 and 5); round 3 is a tail round on those two
    prompts, with M candidates each and no cut: everything it generates is trained."""
    slow = {2, 5, 6, 7}  # groups 6 and 7: the tail round, on the deferred prompts 2 and 5
    s = build(R=2, G=2, U=2, steps=3, eta=1.5, eta_responses=1.0)
    c = ScriptedCluster(s, lambda g, i: 20 + i if g in slow else 3 + g + i, slots=16)
    c.run()
    assert [sorted(p for p, _ in step) for step in trained(c)] == [[0, 1], [3, 4], [2, 5]]
    assert trained(c)[2] == [(2, [0, 1]), (5, [0, 1])]
    starts = [m.data for m in c.marks if m.kind == "round_start"]
    assert [d["tail"] for d in starts] == [False, False, True]
    assert not s.shaping.queue
    assert s.ledger.discarded == {"shaping": 4}  # 2 candidates each of groups 2 and 5
    assert s.ledger.trained == 12


def test_groups_complete_in_the_same_poll_beyond_r_are_deferred_too():
    """Five groups finish at the same tick; only R = 4 are trained: the last to complete (by id at a
    tie) is deferred, so every step still has U groups."""
    s = build(R=4, G=2, U=2, steps=2, eta_responses=1.0)
    c = ScriptedCluster(s, lambda g, i: 5, slots=16)
    c.run()
    assert [sorted(p for p, _ in step) for step in trained(c)] == [[0, 1], [2, 3]]
    assert [p.id for p in s.shaping.queue] == [4]
    assert s.ledger.discarded == {"shaping": 2}


def test_on_pipe_the_first_r_to_complete_train_as_they_complete_and_the_slowest_is_deferred():
    """The first test's schedule on pipe: the groups train U = 2 at a time in completion order (g1 and
    g0 once both are complete, at tick 5, while g2 and g3 still run), the round publishes after R = 4,
    and g4 is deferred as on sync; every token trained is of the round's version 0 (on-policy)."""
    lengths = {0: [9, 3, 5], 1: [4, 2, 8], 2: [7, 3, 8], 3: [5, 6, 8], 4: [30, 40, 50]}
    s = build(R=4, G=2, U=2, steps=2, mode="pipe")
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=16)
    c.run()
    assert trained(c) == [[(1, [0, 1]), (0, [1, 2])], [(3, [0, 1]), (2, [0, 1])]]  # completion order
    assert s.ledger.state_dict() == {"produced": 15, "trained": 8, "discarded": {"shaping": 7}}
    assert [p.id for p in s.shaping.queue] == [4]
    assert {v for t in c.trained for g in t.groups for tr in g.trajectories for v in tr.versions} == {0}
    starts = [m.data for m in c.marks if m.kind == "round_start"]
    assert [(len(d["groups"]), d["tail"]) for d in starts] == [(5, False)]


def test_on_pipe_deferred_prompts_run_together_in_a_tail_round():
    """The second test's schedule on pipe: rounds 1 and 2 defer their slowest prompt, round 3 is the
    tail round on prompts 2 and 5, trained whole."""
    slow = {2, 5, 6, 7}
    s = build(R=2, G=2, U=2, steps=3, eta=1.5, eta_responses=1.0, mode="pipe")
    c = ScriptedCluster(s, lambda g, i: 20 + i if g in slow else 3 + g + i, slots=16)
    c.run()
    assert [sorted(p for p, _ in step) for step in trained(c)] == [[0, 1], [3, 4], [2, 5]]
    starts = [m.data for m in c.marks if m.kind == "round_start"]
    assert [d["tail"] for d in starts] == [False, False, True]
    assert not s.shaping.queue and s.ledger.discarded == {"shaping": 4} and s.ledger.trained == 12


def test_tail_batching_options_are_checked():
    with pytest.raises(ValueError, match="shaping.eta=0.9"):
        TailBatch(eta=0.9)
    with pytest.raises(ValueError, match="shaping.eta_responses=3"):
        TailBatch(eta_responses=3.0)


def run_random(seed, R, G, U, steps, slots, eta, eta_r, zero_signal, mode="sync"):
    length = random_lengths(seed)
    s = build(R, G, U, steps, eta, eta_r, zero_signal, slots, mode)
    c = ScriptedCluster(s, length, slots=slots, train_ticks=3, max_len=40,
                        reward=every_third)  # fmt: skip
    return s, c, length


def deferred_prompts(c):
    return [m.data["prompt"] for m in c.marks if m.kind == "group_deferred"]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    slots=st.integers(2, 12),
    eta=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    eta_r=st.sampled_from([1.0, 1.25, 2.0]),
    zero_signal=st.sampled_from(["train", "replace"]),
    mode=st.sampled_from(["sync", "pipe"]),
)
def test_every_deferred_prompt_is_trained_once_or_still_waits(seed, slots, eta, eta_r, zero_signal, mode):
    R, G, U, steps = 4, 2, 2, 10
    s, c, _ = run_random(seed, R, G, U, steps, slots, eta, eta_r, zero_signal, mode)
    c.run(max_ticks=50_000)
    assert len(c.trained) == steps and all(len(g.trajectories) == G for t in c.trained for g in t.groups)
    assert all(len(t.groups) == U for t in c.trained)
    s.ledger.check(s.in_store())
    assert s.ledger.trained == steps * U * G
    assert set(s.ledger.discarded) <= {"shaping", "zero-signal"}
    prompt_ids = [g.prompt_id for t in c.trained for g in t.groups]
    assert len(prompt_ids) == len(set(prompt_ids)), "a prompt was trained twice"
    waiting = {p.id for p in s.shaping.queue}
    prompt_of = {e.group: e.prompt.id for e in c.journal if isinstance(e, Opened)}
    dropped = {prompt_of[m.data["group"]] for m in c.marks if m.kind == "group_dropped"}  # zero-signal
    for p in deferred_prompts(c):
        fates = [p in prompt_ids, p in waiting, p in dropped]
        assert sum(fates) == 1, f"deferred prompt {p}: trained, waiting, dropped = {fates}"
    assert not s._cut, "every aborted candidate came back"


def crash_and_resume(seed, eta, eta_r, crash_when, mode="sync"):
    """Run with a checkpoint after every step until `crash_when(sched, cluster, ckpt)`, restore a fresh
    scheduler from the checkpoint and the journal after it, run it to the end; check the tail queue,
    the steps and that no prompt is trained twice. Returns whether the journal replayed a deferral."""
    R, G, U, steps = 4, 2, 2, 12
    s, c, length = run_random(seed, R, G, U, steps, 3, eta, eta_r, "train", mode)
    ckpt = run_to_crash(s, c, crash_when)
    if ckpt is None:
        return False
    tail = c.journal[ckpt["journal_seq"] :]
    s2 = build(R, G, U, steps, eta, eta_r, slots=3, mode=mode)
    restore(s2, ckpt, c.journal)
    if not [g for g in s.open.values() if g.version > s.done_version]:  # nothing un-opened by replay
        assert [p.id for p in s2.shaping.queue] == [p.id for p in s.shaping.queue]
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, max_len=40, reward=every_third)
    c2.t, c2.loaded = c.t, [{ckpt["version"]}]
    c2.run(max_ticks=50_000)
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], steps))
    before = [t for t in c.trained if t.step < ckpt["steps_done"]]
    groups = [g for t in before + c2.trained for g in t.groups]
    assert len({g.prompt_id for g in groups}) == len(groups), "a prompt was trained twice"
    assert s2.ledger.trained == steps * U * G
    s2.ledger.check(s2.in_store())
    return any(isinstance(e, Deferred) for e in tail)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 1000),
    crash_tick=st.integers(10, 300),
    eta=st.sampled_from([1.25, 1.5]),
    eta_r=st.sampled_from([1.0, 1.5]),
    mode=st.sampled_from(["sync", "pipe"]),
)
def test_crash_and_resume_keeps_the_tail_queue(seed, crash_tick, eta, eta_r, mode):
    """Checkpoint after every step, crash anywhere, restore and replay the journal: the tail queue is
    the crashed run's, and the resumed run repeats no step and trains no trajectory or prompt twice."""
    crash_and_resume(seed, eta, eta_r, lambda s, c, ckpt: c.t >= crash_tick, mode)


@pytest.mark.parametrize("seed", range(8))
def test_a_deferral_after_the_checkpoint_is_replayed(seed):
    """The crash comes as soon as a group was deferred past the last checkpoint, its aborts still in
    flight (rare at a random tick: a cut happens once a round, checkpoints after every step)."""

    def after_a_deferral(s, c, ckpt):
        return ckpt is not None and any(isinstance(e, Deferred) for e in c.journal[ckpt["journal_seq"] :])

    assert crash_and_resume(seed, 1.5, 1.5, after_a_deferral)


def test_tail_batching_on_a_streaming_mode_is_refused_with_the_fix():
    from tailrace.cli.choices import check
    from tailrace.common import ConfigError
    from tailrace.config import load_config

    cfg = load_config(
        None, ["--shaping.name=tailbatch", "--flow.mode=multiversion", "--flow.max_staleness=2"]
    )
    with pytest.raises(
        ConfigError, match="shaping.name=tailbatch works with flow.mode=sync.*set --flow.mode=sync"
    ):
        check(cfg)
    check(load_config(None, ["--shaping.name=tailbatch"]))  # sync: fine
