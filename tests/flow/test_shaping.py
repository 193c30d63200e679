"""Shaping inside the scheduler: DARTS' candidates, selection and early stop on the scripted cluster,
in every overlap mode; the ledger accounts every unselected sample; resume keeps the statistics."""

import copy
import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import check_mode, make_shaping
from tailrace.records import journal_from_json
from tailrace.types import Prompt
from tests.flow.scripted import ScriptedCluster

MODES = ["sync", "pipe", "async", "partial", "multiversion"]


def cycled(n):
    """A finite training set seen again epoch after epoch (so per-prompt statistics accumulate)."""
    i = 0
    while True:
        yield Prompt(id=i % n, token_ids=(1, 2, 3), answer=str(i % n))
        i += 1


def build(mode, R, G, U, steps, shaping="darts", zero_signal="train", slots=4, K=1, **options):
    policy = make_policy(mode, zero_signal, max_staleness=K)
    shape = make_shaping(shaping, window=R, **options)
    return Scheduler(policy, cycled(5), [(slots, 2)], FlowSpec(R, G, U, steps), shaping=shape)


def trained(c):
    return [[tr.sample_index for tr in g.trajectories] for t in c.trained for g in t.groups]


def test_sync_darts_trains_the_shortest_and_the_longest_of_each_prompts_candidates():
    """R = 2 prompts, M = 2, every prompt at 2M = 4 candidates: keep the shortest + the longest."""
    lengths = {0: [9, 3, 5, 7], 1: [2, 8, 4, 6]}
    s = build("sync", R=2, G=2, U=2, steps=1, extra=1.0, early_stop=0.0)
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=8)
    c.run()
    assert trained(c) == [[0, 1], [0, 1]]  # group 0: 3 (idx 1) and 9 (idx 0); group 1: 2 and 8
    assert s.ledger.state_dict() == {"produced": 8, "trained": 4, "discarded": {"shaping": 4}}
    assert s.shaping_tokens == 5 + 7 + 4 + 6


def test_truncated_candidates_are_not_trained_while_others_finished():
    lengths = {0: [9, 3, 50, 7], 1: [2, 50, 4, 6]}  # 50 > max_len: cut off
    s = build("sync", R=2, G=2, U=2, steps=1, extra=1.0, early_stop=0.0)
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=8, max_len=20)
    c.run()
    assert trained(c) == [[0, 1], [0, 3]]  # the longest kept is 9 and 6, never the truncated 20s


def test_early_stop_takes_the_first_m_finishers_and_aborts_the_rest():
    lengths = {0: [9, 3, 50, 7], 1: [2, 8, 4, 60]}
    s = build("sync", R=2, G=2, U=2, steps=1, extra=1.0, early_stop=1.0)
    c = ScriptedCluster(s, lambda g, i: lengths[g][i], slots=8)
    c.run()
    assert trained(c) == [[1, 3], [0, 2]]  # the first two finishers of each group
    assert s.ledger.trained == 4 and s.ledger.discarded == {"shaping": 4}
    assert c.t < 20, "the run waited for the 50- and 60-token tails"
    assert not s._cut, "every aborted candidate came back"


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    shaping=st.sampled_from(["none", "darts"]),
    seed=st.integers(0, 10_000),
    extra=st.sampled_from([0.0, 0.5, 1.0, None]),
    early_stop=st.sampled_from([0.0, 0.5, 1.0]),
    slots=st.integers(2, 8),
    zero_signal=st.sampled_from(["train", "replace"]),
)
def test_every_mode_with_shaping_trains_whole_groups_and_keeps_the_ledger(
    mode, shaping, seed, extra, early_stop, slots, zero_signal
):
    """The core checks produced = trained + in_store + discarded at every poll; here: the run
    finishes, every trained group has M samples, and the only discards are the expected ones."""
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, int(rng.lognormvariate(1.6, 0.9))))

    R, G, U, steps = 4, 2, 2, 4
    options = {"extra": extra, "early_stop": early_stop} if shaping == "darts" else {}
    s = build(mode, R, G, U, steps, shaping, zero_signal, slots, **options)
    c = ScriptedCluster(s, length, slots=slots, train_ticks=3, max_len=25,
                        reward=lambda g, i: float((g + i) % 3 == 0))  # fmt: skip
    c.run(max_ticks=20_000)
    assert len(c.trained) == steps and all(len(g.trajectories) == G for t in c.trained for g in t.groups)
    s.ledger.check(s.in_store())
    assert s.ledger.trained == steps * U * G
    assert set(s.ledger.discarded) <= {"shaping", "zero-signal"}
    if shaping == "none" or extra == 0.0:
        assert "shaping" not in s.ledger.discarded


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    crash_tick=st.integers(10, 150),
    extra=st.sampled_from([0.5, 1.0, None]),
    early_stop=st.sampled_from([0.0, 0.25, 1.0]),
)
def test_crash_and_resume_keeps_the_statistics_and_the_planned_window(seed, crash_tick, extra, early_stop):
    """Checkpoint after every step, crash anywhere, restore and replay the journal: the per-prompt
    statistics and the planned prompts are those of the run that crashed, and the resumed run
    finishes without a step repeated or a trajectory trained twice."""
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), rng.randint(1, 15))

    R, G, U, steps = 4, 2, 2, 8
    s = build("sync", R, G, U, steps, extra=extra, early_stop=early_stop)
    c = ScriptedCluster(s, length, slots=3, train_ticks=3, max_len=12)
    ckpt = None
    while not s.done and c.t < crash_tick:
        c.execute(s.poll(c.t))
        journaled = copy.deepcopy(s.shaping.stats)  # what the journal holds: results since are lost
        before = s.steps_done
        c.tick()
        if s.steps_done > before:
            c.execute(s.poll(c.t))
            journaled = copy.deepcopy(s.shaping.stats)
            ckpt = json.loads(json.dumps(s.state_dict()))
    if ckpt is None or s.done:
        return
    s2 = build("sync", R, G, U, steps, extra=extra, early_stop=early_stop)
    s2.load_state_dict(ckpt)
    assert s2.shaping.stats.state_dict() == ckpt["shaping"]["stats"]
    tail = c.journal[ckpt["journal_seq"] :]
    s2.replay([journal_from_json(json.loads(json.dumps(e.to_json()))) for e in tail])
    # the journal's completions updated them as live; a group cut with samples still in flight at the
    # crash completes at the end of the replay instead (live, when they came back)
    if not any(not g.todo and g.in_flight for g in s.open.values()):
        assert s2.shaping.stats == journaled
    assert [(p.id, n) for p, n in s2._upcoming] == [(p.id, n) for p, n in s._upcoming]
    c2 = ScriptedCluster(s2, length, slots=3, train_ticks=3, max_len=12)
    c2.t, c2.loaded = c.t, [{ckpt["version"]}]
    c2.run()
    assert [t.step for t in c2.trained] == list(range(ckpt["steps_done"], steps))
    keys = [(tr.group, tr.sample_index) for t in c2.trained for g in t.groups for tr in g.trajectories]
    assert len(keys) == len(set(keys)), "a trajectory was trained twice"
    assert s2.ledger.trained == steps * U * G
    s2.ledger.check(s2.in_store())


@settings(max_examples=30, deadline=None)
@given(
    mode=st.sampled_from(["sync", "pipe"]),
    shaping=st.sampled_from(["tailbatch", "april", "sorted", "darts"]),
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 5),
)
def test_round_shapings_train_exactly_the_steps_asked_when_they_cut_the_last_round(
    mode, shaping, seed, steps
):
    """flow.steps not a multiple of a round's R / U = 2 steps: the last round, cut to the steps left,
    still opens, defers, carries or sorts as its shaping says, and the run trains `steps` steps."""
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, int(rng.lognormvariate(1.6, 0.9))))

    try:
        check_mode(shaping, mode)
    except ValueError:  # a pairing the run refuses (april and sorted are sync's)
        return
    s = build(mode, 4, 2, 2, steps, shaping)
    c = ScriptedCluster(s, length, slots=4, train_ticks=3, max_len=25)
    c.run(max_ticks=20_000)
    assert [t.step for t in c.trained] == list(range(steps))
    assert c.trained[-1].publish is not None
    s.ledger.check(s.in_store())
    assert s.ledger.trained == steps * 2 * 2
