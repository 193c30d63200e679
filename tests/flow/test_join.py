"""Engines that join and leave a running job (`Scheduler.add_engine` / `remove_engine`), on the
scripted cluster: a joined engine loads the weights the policy needs and then gets work; a departed
one's in-flight samples are requeued, it never gets work again, and whatever it still reports is
ignored. The hypothesis property drives random join/leave schedules in every mode: the ledger
identity holds at every poll (the core raises otherwise), every step trains, and no sample trains twice."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.commands import Generate, LoadWeights
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import ANY_VERSIONS, FlowSpec, InvariantError, Scheduler
from tailrace.types import Capabilities, Finish, GenResult
from tests.flow.scripted import ScriptedCluster, prompts

MODES = ["sync", "pipe", "async", "partial", "multiversion"]
ONE = Capabilities(abort_resume=False, versions_at_once=1, per_request_seed=True, speculative=False)


def cluster(mode="sync", engines=1, slots=4, length=lambda g, i: 3, steps=4, **policy):
    s = Scheduler(make_policy(mode, max_staleness=1, **policy), prompts(), [(slots, 2)] * engines,
                  FlowSpec(4, 2, 2, steps))  # fmt: skip
    return s, ScriptedCluster(s, length, slots=slots, train_ticks=2, load_ticks=1)


def trained_keys(c):
    return [(tr.group, tr.sample_index) for t in c.trained for g in t.groups for tr in g.trajectories]


def spy(c):
    """Keep every Generate the scheduler hands the cluster (`c.sent`)."""
    c.sent = []
    orig = c.execute

    def execute(out, _orig=orig):
        c.sent.extend(x for x in out.commands if isinstance(x, Generate))
        _orig(out)

    c.execute = execute


def test_a_joined_engine_loads_the_newest_weights_before_any_work():
    s, c = cluster("sync")
    spy(c)
    c.execute(s.poll(0))
    while s.newest == 0:  # run to the first published version
        c.tick()
        c.execute(s.poll(c.t))
    e = c.join_engine()
    assert s.engine(e).loaded == set()
    out = s.poll(c.t)
    assert "engine_joined" in [m.kind for m in out.marks]
    loads = [x for x in out.commands if isinstance(x, LoadWeights) and x.engine == e]
    assert [x.version for x in loads] == [s.newest]
    assert not [x for x in out.commands if isinstance(x, Generate) and x.engine == e]
    c.execute(out)
    c.run()
    got = {x.engine for x in c.sent}
    assert e in got, "the joined engine never got work"
    assert len(trained_keys(c)) == len(set(trained_keys(c))) == 4 * 2 * 2


@pytest.mark.parametrize("mode", MODES)
def test_a_starting_engine_gets_no_order_until_it_is_up_then_loads_the_newest(mode):
    """A slow starter (a vLLM engine takes seconds to build) is booked when it joins but asked for
    nothing until it says it is up: the loads it would have missed are never sent."""
    s, c = cluster(mode, length=lambda g, i: 3 + (g + i) % 5, steps=8)
    spy(c)
    c.execute(s.poll(0))
    while s.newest == 0:
        c.tick()
        c.execute(s.poll(c.t))
    e = c.join_engine(started=False)
    assert e not in {x.id for x in s.engines}
    for _ in range(6):  # versions are published meanwhile
        out = s.poll(c.t)
        assert not [x for x in out.commands if getattr(x, "engine", None) == e]
        c.execute(out)
        c.tick()
    s.engine_started(e)
    out = s.poll(c.t)
    assert [x.version for x in out.commands if isinstance(x, LoadWeights) and x.engine == e] == [s.newest]
    c.execute(out)
    c.run()
    assert [m.kind for m in c.marks if m.data.get("engine") == e][:3] == [
        "engine_joined",
        "engine_started",
        "loaded",
    ]
    assert not [m for m in c.marks if m.kind == "load_missed"]
    assert e in {x.engine for x in c.sent}
    keys = trained_keys(c)
    assert len(keys) == len(set(keys)) == 8 * 2 * 2


def test_an_engine_that_leaves_while_starting_is_forgotten():
    s, c = cluster("async", engines=1)
    c.execute(s.poll(0))
    e = c.join_engine(started=False)
    assert c.leave_engine(e) == 0
    s.engine_started(e)  # its Ready crossed the leave: ignored
    assert e not in {x.id for x in s.engines}
    c.run()
    assert len(trained_keys(c)) == 4 * 2 * 2
    with pytest.raises(InvariantError, match="was not starting"):
        s.engine_started(0)


def test_a_leaving_engine_hands_its_samples_back_and_gets_nothing_after():
    s, c = cluster("pipe", engines=2, length=lambda g, i: 6)
    spy(c)
    c.execute(s.poll(0))
    c.tick()
    c.execute(s.poll(c.t))
    held = dict(s.engine(1).in_flight)
    produced = s.ledger.produced
    assert held
    assert c.leave_engine(1) == len(held)
    assert s.ledger.produced == produced  # nothing produced, nothing lost: back to the to-do lists
    assert 1 not in {e.id for e in s.engines} and s.departed == {1}
    late = [GenResult(rid, (7,), (0.0,), (0,), Finish.STOP) for rid in held]
    s.on_results(1, late, [], c.t)  # a report that crossed the leave: ignored, not produced twice
    assert s.ledger.produced == produced
    start = len(c.sent)
    c.run()
    assert all(x.engine == 0 for x in c.sent[start:])
    assert len(trained_keys(c)) == len(set(trained_keys(c))) == 4 * 2 * 2
    assert [m.data["requeued"] for m in c.marks if m.kind == "engine_left"] == [len(held)]


def test_an_engine_that_leaves_while_loading_weights_is_forgotten():
    """A leave while its load is under way: the load that lands later is ignored (no dispatch to it),
    the engine's id is never reused, and the other engine carries the run."""
    s, c = cluster("async", engines=2, length=lambda g, i: 5)
    for _ in range(1000):  # to the first poll that asks an engine to load weights
        c.execute(s.poll(c.t))
        if any(e.loading for e in s.engines):
            break
        c.tick()
    e = next(e.id for e in s.engines if e.loading)
    v = next(iter(s.engine(e).loading))
    c.leave_engine(e)
    s.on_loaded(e, v, c.t)  # its process finished the load after all: too late
    assert e not in {x.id for x in s.engines} and s.in_flight() == sum(len(x.in_flight) for x in s.engines)
    assert c.join_engine() == 2
    c.run()
    assert len(trained_keys(c)) == len(set(trained_keys(c))) == 4 * 2 * 2


def test_the_last_engine_leaves_and_another_joins():
    for mode in MODES:
        s, c = cluster(mode, length=lambda g, i: 4)
        for _ in range(5):
            c.execute(s.poll(c.t))
            c.tick()
        c.leave_engine(0)
        for _ in range(20):  # nobody to work: the job waits, nothing breaks
            c.execute(s.poll(c.t))
            c.tick()
        assert not s.engines and s.in_flight() == 0
        c.join_engine()
        c.run()
        keys = trained_keys(c)
        assert len(keys) == len(set(keys)) == 4 * 2 * 2, mode
        s.ledger.check(s.in_store())


def test_multiversion_reloads_an_old_version_whose_only_holder_left():
    """dedicated placement: the one engine serving an old version leaves while samples of that version
    are in flight; they are requeued, and the next poll has a live engine load the old version for them
    (nothing is dropped for staleness, nothing regenerated under other weights)."""
    s, c = cluster("multiversion", engines=2, slots=2, length=lambda g, i: 2 + 12 * (g % 3 == 0), steps=8,
                   placement="dedicated")  # fmt: skip

    def lone_holder():
        for g in s.open.values():
            holders = [e for e in s.engines if g.version in e.loaded]
            if g.version < s.newest and g.in_flight and len(holders) == 1:
                others = [e for e in s.engines if e is not holders[0]]
                if all(g.version not in e.loaded | e.loading for e in others):
                    return g.version, holders[0].id
        return None

    for _ in range(2000):
        c.execute(s.poll(c.t))
        c.tick()
        if lone_holder():
            break
    old, holder = lone_holder()
    c.leave_engine(holder)
    c.join_engine()
    out = s.poll(c.t)
    assert old in {x.version for x in out.commands if isinstance(x, LoadWeights)}
    c.execute(out)
    c.run()
    assert s.ledger.total_discarded == 0
    assert len(trained_keys(c)) == len(set(trained_keys(c))) == 8 * 2 * 2


EVENT = st.tuples(
    st.integers(1, 300), st.sampled_from(["join", "join-slow", "leave", "leave-loading", "leave-all", "miss"])
)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 10_000),
    engines=st.integers(1, 2),
    one_version=st.booleans(),
    events=st.lists(EVENT, min_size=1, max_size=6),
)
def test_join_leave_schedules_keep_the_ledger_and_train_nothing_twice(
    mode, seed, engines, one_version, events
):
    """Engines join and leave at random ticks (a leave picks a random live engine; `leave-loading` one
    whose weights are loading, when there is one; `leave-all` every engine, then one joins; `miss`: a
    random engine's next weight load finds its weights gone, as a slow joined engine's may;
    `join-slow`: an engine joins that is up 1-30 ticks later, or leaves first). The
    cluster raises if any command reaches a departed engine; the core checks the ledger every poll."""
    if one_version and mode in ("partial", "multiversion"):
        policy = {"placement": "dedicated"} if mode == "multiversion" else None
        if policy is None:
            return  # partial refuses one-version engines
    else:
        policy = {}
    rng = random.Random(seed)
    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, min(40, int(rng.lognormvariate(1.6, 0.9)))))

    caps = ONE if one_version else ANY_VERSIONS
    s = Scheduler(make_policy(mode, max_staleness=1, **policy), prompts(), [(4, 2)] * engines,
                  FlowSpec(4, 2, 2, 6), capabilities=caps)  # fmt: skip
    c = ScriptedCluster(s, length, slots=4, train_ticks=4, load_ticks=2, one_version=one_version)
    at: dict[int, list[str]] = {}
    for t, kind in events:
        at.setdefault(t, []).append(kind)
    requeued, up_at = 0, {}
    while not s.done and c.t < 20_000:
        c.execute(s.poll(c.t))
        c.tick()
        for e in [e for e, t in up_at.items() if t <= c.t]:
            del up_at[e]
            s.engine_started(e)  # (one that left while starting stays gone)
        for kind in at.get(c.t, []):
            live = [e.id for e in s.engines]
            if kind == "join-slow":
                up_at[c.join_engine(started=False)] = c.t + rng.randint(1, 30)
            elif kind == "join" or not live:
                c.join_engine()
            elif kind == "leave":
                requeued += c.leave_engine(rng.choice(live + sorted(s.starting)))
            elif kind == "miss":
                c.miss.add(rng.choice(live))
            elif kind == "leave-loading":
                loading = [e.id for e in s.engines if e.loading]
                requeued += c.leave_engine(rng.choice(loading or live))
            else:
                for e in live:
                    requeued += c.leave_engine(e)
                c.execute(s.poll(c.t))  # a poll with no engine at all
                c.join_engine()
        if not s.engines:  # the schedule left nobody: one joins later, as an operator would
            if rng.random() < 0.1:
                c.join_engine()
    assert s.done, f"stuck at tick {c.t}"
    c.execute(s.poll(c.t))
    keys = trained_keys(c)
    assert len(keys) == len(set(keys)) == 6 * 2 * 2
    led = s.ledger
    assert led.produced == led.trained + s.in_store() + led.total_discarded
    assert all(reason for reason in led.discarded)
    if mode == "multiversion":
        assert led.total_discarded == 0
    assert sum(m.data["requeued"] for m in c.marks if m.kind == "engine_left") == requeued


def test_a_tool_answer_for_a_sample_whose_engines_all_left_starts_it_over():
    """Multi-turn: the only engine leaves while a sample's tool runs; the engine that joins is still
    loading when the answer comes, so no engine holds the sample's version: it starts over from its
    prompt (as a lost engine's samples do), and the episode trains whole, once."""
    from tailrace.types import SamplingParams

    s = Scheduler(
        make_policy("sync"), prompts(), [(2, 0)], FlowSpec(1, 2, 1, 1), SamplingParams(max_new_tokens=100)
    )
    c = ScriptedCluster(s, length=None, slots=2, turns=lambda g, i: [2, 3], tool_ticks=lambda g, i, k: 2,
                        load_ticks=4)  # fmt: skip
    while s.at_tool == 0:
        c.execute(s.poll(c.t))
        c.tick()
    c.leave_engine(0)
    c.join_engine()
    c.run()
    assert [m.kind for m in c.marks].count("continuation_requeued") >= 1
    trained = [t for step in c.trained for g in step.groups for t in g.trajectories]
    assert len(trained) == 2 and all(t.observed == ((2, 4),) and t.length == 7 for t in trained)
    assert s.ledger.produced == s.ledger.trained == 2


SHAPED = [("sync", "tailbatch"), ("pipe", "tailbatch"), ("sync", "april"), ("sync", "sorted"), ("sync", "darts"),
          ("multiversion", "darts"), ("async", "darts"), ("partial", "darts")]  # fmt: skip


def shaped_run(mode, shaping, rng, engines, events):
    """A run with shaping on under a join/leave schedule ({tick: join | leave | leave-all})."""
    from tailrace.flow.shaping import make_shaping
    from tests.flow.scripted import every_third

    lengths = {}

    def length(g, i):
        return lengths.setdefault((g, i), max(1, min(40, int(rng.lognormvariate(1.6, 0.9)))))

    s = Scheduler(make_policy(mode, "replace", max_staleness=2), prompts(), [(4, 2)] * engines,
                  FlowSpec(4, 2, 2, 6), shaping=make_shaping(shaping, window=4))  # fmt: skip
    c = ScriptedCluster(s, length, slots=4, train_ticks=4, load_ticks=2, reward=every_third)
    while not s.done and c.t < 20_000:
        c.execute(s.poll(c.t))
        c.tick()
        kind, live = events.get(c.t), [e.id for e in s.engines]
        if kind == "join" or (kind and not live):
            c.join_engine()
        elif kind == "leave":
            c.leave_engine(rng.choice(live))
        elif kind == "leave-all":
            for e in live:
                c.leave_engine(e)
            c.execute(s.poll(c.t))
            c.join_engine()
        if not s.engines and rng.random() < 0.1:
            c.join_engine()
    assert s.done, f"stuck at tick {c.t}"
    c.execute(s.poll(c.t))
    keys = trained_keys(c)
    assert len(keys) == len(set(keys))
    s.ledger.check(s.in_store())
    assert all(reason for reason in s.ledger.discarded)


@settings(max_examples=120, deadline=None)
@given(
    case=st.sampled_from(SHAPED),
    seed=st.integers(0, 10_000),
    engines=st.integers(1, 2),
    events=st.lists(
        st.tuples(st.integers(1, 200), st.sampled_from(["join", "leave", "leave-all"])),
        min_size=1,
        max_size=5,
    ),
)
def test_join_leave_under_shaping_keeps_the_ledger(case, seed, engines, events):
    """As above with shaping on (its cuts abort candidates, tailbatch defers groups, april carries
    them, zero-signal groups are replaced). The cluster raises on any command sent to a departed
    engine."""
    shaped_run(*case, random.Random(seed), engines, dict(events))


@pytest.mark.parametrize("mode,seed", [("sync", 6), ("sync", 19), ("pipe", 19)])
def test_a_leave_whose_requeue_completes_a_cut_group_aborts_nothing_on_it(mode, seed):
    """tailbatch: the leaving engine held candidates shaping had cut; requeueing them completes their
    group, whose other candidates are aborted, never on the engine that left (these schedules sent
    such an Abort before the fix)."""
    rng = random.Random(seed)
    engines = rng.randint(1, 2)
    rng2 = random.Random(seed)  # the schedule comes from its own draws, as the search that found it
    rng2.randint(1, 2)
    shaped_run(mode, "tailbatch", rng, engines, _schedule(rng2))


def _schedule(rng):
    return {rng.randint(1, 200): rng.choice(["join", "leave", "leave-all"]) for _ in range(rng.randint(1, 5))}


@pytest.mark.parametrize("mode", MODES)
def test_a_joined_engine_whose_first_load_misses_is_asked_again_and_gets_work(mode):
    """Its weights were replaced in the ring before it read them (newer versions published meanwhile):
    the scheduler forgets the load and asks it for the newest, and the run trains every sample once."""
    s, c = cluster(mode, length=lambda g, i: 3 + (g + i) % 5)
    spy(c)
    c.execute(s.poll(0))
    while s.newest == 0:
        c.tick()
        c.execute(s.poll(c.t))
    e = c.join_engine()
    c.miss.add(e)
    c.run()
    missed = [m for m in c.marks if m.kind == "load_missed"]
    assert [m.data["engine"] for m in missed] == [e]
    asked = [m for m in c.marks if m.kind == "loaded" and m.data["engine"] == e]
    assert asked and asked[0].t > missed[0].t  # loaded after the miss: asked again
    assert e in {x.engine for x in c.sent}
    keys = trained_keys(c)
    assert len(keys) == len(set(keys)) == 4 * 2 * 2
