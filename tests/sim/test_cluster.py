"""The real scheduler and policies on simulated engines: closed-form step times, and the same
invariants a real run enforces (the core's own checks raise inside the simulation)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.flow.policies import GROUP_MODES, SyncPolicy, make_policy
from tailrace.flow.scheduler import FlowSpec, InvariantError, Scheduler
from tailrace.sim.cluster import SimCluster, SimStalled
from tailrace.sim.costs import CostModel
from tailrace.sim.engine import SimEngine
from tailrace.sim.hardware import GPUS
from tailrace.sim.lengths import ConstantLengths, LognormalLengths
from tailrace.sim.models import MODELS
from tailrace.sim.recorder import Recorder
from tailrace.sim.scenario import prompt_stream

COST = CostModel(GPUS["h100"], MODELS["qwen3-1.7b"], engine_gpus=1, trainer_gpus=4)


class Capture(Recorder):
    def __init__(self):
        super().__init__()
        self.trains = []

    def on_train_issued(self, c, now):
        super().on_train_issued(c, now)
        self.trains.append(c)


def cluster(policy, lengths, R, K, U, steps, engines=1, slots=64, lookahead=0, cost=COST):
    sched = Scheduler(
        policy, prompt_stream(lengths), [(slots, lookahead)] * engines, FlowSpec(R, K, U, steps)
    )
    engs = [SimEngine(i, slots, cost, lengths) for i in range(engines)]
    return SimCluster(sched, engs, cost, Capture())


@pytest.mark.parametrize("engines", [1, 2])
def test_sync_constant_lengths_gives_the_closed_form_step_time(engines):
    R, K, U, P, L, rounds = 8, 4, 4, 100, 700, 3
    N = R * K // engines  # samples per engine per round; every engine admits its share at once
    cl = cluster(
        SyncPolicy(), ConstantLengths(L, prompt=P), R, K, U, steps=rounds * R // U, engines=engines, slots=N
    )
    cl.run()
    prefill = COST.prefill_time([P] * N)
    decode = COST.decode_segment({0: (N, N * P)}).time(L)
    train = COST.train_time([P + L] * (U * K))
    per_round = prefill + decode + (R // U) * train + COST.publish_time()
    expected = rounds * per_round + (rounds - 1) * COST.load_time()
    assert cl.now == pytest.approx(expected, rel=1e-9)
    s = cl.rec.summary
    assert s["trainer_wait_ratio"] == pytest.approx(1 - rounds * (R // U) * train / expected, rel=1e-9)
    # every slot is held through its prefill and decode
    assert s["bubble_ratio"] == pytest.approx(1 - rounds * (prefill + decode) / expected, rel=1e-9)
    assert s["length_bubble"] == 0.0
    assert s["first_dispatch_s"] == pytest.approx(prefill + decode, rel=1e-9)
    # every slot is held while the engine works, except through weight loads
    busy = rounds * (prefill + decode) + (rounds - 1) * COST.load_time()
    assert cl.rec.steps[-1].time["mean_active_batch"] == pytest.approx(
        N * rounds * (prefill + decode) / busy, rel=1e-9
    )


def _check_trained(cl, policy):
    s = cl.sched
    assert s.ledger.produced == s.ledger.trained + s.in_store() + s.ledger.total_discarded
    for c in cl.rec.trains:
        for g in c.groups:
            for t in g.trajectories:
                assert 0 <= c.trainer_version - t.oldest_version <= policy.max_staleness
                if not policy.mixed_versions:
                    assert len(set(t.versions)) == 1


@pytest.mark.parametrize("mode", GROUP_MODES)  # (external: an agent's groups, no agent here)
def test_every_registered_policy_runs_and_keeps_its_invariants(mode):
    policy = make_policy(mode, max_staleness=1)
    lengths = LognormalLengths(median=300, max_len=2000, runaway=0.05, prompt=64, seed=1)
    cl = cluster(policy, lengths, R=8, K=4, U=2, steps=12, engines=2, slots=8, lookahead=4)
    cl.run()
    assert cl.sched.steps_done == 12
    _check_trained(cl, policy)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    median=st.floats(2, 400),
    sp=st.floats(0, 1.5),
    ss=st.floats(0, 1.0),
    runaway=st.floats(0, 0.3),
    max_len=st.integers(1, 3000),
    engines=st.integers(1, 3),
    slots=st.integers(1, 16),
    lookahead=st.integers(0, 4),
    K=st.integers(1, 4),
    U=st.integers(1, 3),
    per_round=st.integers(1, 3),
)
def test_sync_invariants_under_random_length_distributions(
    seed, median, sp, ss, runaway, max_len, engines, slots, lookahead, K, U, per_round
):
    lengths = LognormalLengths(
        median=median,
        max_len=max_len,
        sigma_prompt=sp,
        sigma_sample=ss,
        runaway=runaway,
        prompt=32,
        seed=seed,
    )
    R = U * per_round
    cl = cluster(
        SyncPolicy(), lengths, R, K, U, steps=2 * per_round, engines=engines, slots=slots, lookahead=lookahead
    )
    cl.run()
    assert cl.sched.ledger.trained == 2 * R * K
    assert set(cl.sched.staleness) == {0}
    _check_trained(cl, cl.sched.policy)
    # the engines' books and the scheduler's agree: every generated token was trained
    assert sum(e.gen_tokens for e in cl.engines) == sum(
        t.length for c in cl.rec.trains for g in c.groups for t in g.trajectories
    )


class EagerSync(SyncPolicy):
    """Claims to be on-policy but starts the next round on the weights the engines still hold."""

    name = "eager"

    def _start_round(self, core):
        v = min(core.engines[0].loaded)
        self.round = [core.open_group(v).id for _ in range(core.spec.groups_per_round)]
        self.fill(core, [core.open[g] for g in self.round])


def test_staleness_violation_raises_inside_the_simulation():
    cl = cluster(EagerSync(), ConstantLengths(50, prompt=10), R=2, K=2, U=2, steps=3)
    with pytest.raises(InvariantError, match="staleness 1 > bound 0"):
        cl.run()


class Hasty(SyncPolicy):
    """Aborts a sample in the same poll that dispatches it (then resumes it)."""

    name = "hasty"

    def decide(self, core):
        super().decide(core)
        for e in core.engines:
            core.abort(e.id, [s for s in e.in_flight if s.endswith(".0")][:1], "test")

    def on_aborted(self, core, partial):
        core.resume(0, partial, partial.dispatch_version)


def test_an_abort_in_the_same_poll_as_its_generate_reaches_the_engine_after_it():
    """The engines raise on an abort of a sample never sent; the core flushes Generates first."""
    cl = cluster(Hasty(), ConstantLengths(50, prompt=10), R=2, K=2, U=2, steps=2)
    cl.run()
    assert cl.sched.steps_done == 2


class Idle(SyncPolicy):
    name = "idle"

    def decide(self, core):
        pass


def test_a_policy_that_issues_no_work_stalls_with_a_message():
    cl = cluster(Idle(), ConstantLengths(50, prompt=10), R=2, K=2, U=2, steps=2)
    with pytest.raises(SimStalled, match="issued no work"):
        cl.run()


def test_colocated_training_pauses_the_engines():
    lengths = LognormalLengths(median=400, max_len=3000, prompt=64, seed=2)

    def run(mode, colocated):
        sched = Scheduler(make_policy(mode), prompt_stream(lengths), [(16, 0)] * 2, FlowSpec(8, 4, 2, 8))
        cl = SimCluster(
            sched, [SimEngine(i, 16, COST, lengths) for i in range(2)], COST, Capture(), colocated=colocated
        )
        cl.run()
        return cl

    # sync never overlaps, so sharing the devices costs nothing
    assert run("sync", True).now == pytest.approx(run("sync", False).now, rel=1e-9)
    apart, shared = run("pipe", False), run("pipe", True)
    assert shared.now > apart.now
    waits = [sp for e in shared.engines for sp in e.spans if sp.phase == "wait"]
    trains = [(sp.t0, sp.t1) for sp in shared.trainer_spans]  # train, then publish
    assert waits and all(
        any(t0 - 1e-9 <= w.t1 <= t1 + 1e-9 for t0, t1 in trains) for w in waits
    )  # end with a step
    for e in shared.engines:  # no decoding while the trainer holds the devices
        for sp in e.spans:
            if sp.phase == "generate":
                assert not any(t0 + 1e-9 < sp.t0 < t1 - 1e-9 for t0, t1 in trains)


def two_engines(mode, cost, lengths):
    """A mode on two 16-slot engines (R=8, K=4, U=2, 8 steps), run to the end."""
    cl = cluster(make_policy(mode), lengths, 8, 4, 2, 8, engines=2, slots=16, cost=cost)
    cl.run()
    return cl


def test_co_running_training_slows_only_the_decode_steps_it_overlaps():
    import dataclasses

    lengths = LognormalLengths(median=400, max_len=3000, prompt=64, seed=2)
    slow = CostModel(
        dataclasses.replace(GPUS["h100"], corun_slowdown=1.5),
        MODELS["qwen3-1.7b"],
        engine_gpus=1,
        trainer_gpus=4,
    )
    # sync never decodes while it trains: nothing to slow
    assert two_engines("sync", slow, lengths).now == pytest.approx(
        two_engines("sync", COST, lengths).now, rel=1e-9
    )
    base, co = two_engines("pipe", COST, lengths), two_engines("pipe", slow, lengths)
    busy = lambda cl: sum(e.busy_time for e in cl.engines)  # noqa: E731
    assert co.now > base.now and busy(co) > busy(base)
    assert busy(co) < 1.5 * busy(base)  # only the overlapped part is slowed
    assert co.trainer_busy == pytest.approx(base.trainer_busy, rel=1e-9)  # training itself is not


def test_the_driver_takes_the_engines_core_only_while_the_trainer_computes():
    import dataclasses

    lengths = LognormalLengths(median=400, max_len=3000, prompt=64, seed=3)
    hw = dataclasses.replace(GPUS["h100"], driver_report_s=0.05, driver_result_s=0.01)
    drv = CostModel(hw, MODELS["qwen3-1.7b"], engine_gpus=1, trainer_gpus=4)
    # sync never generates while it trains: the driver has the trainer's core
    assert two_engines("sync", drv, lengths).now == pytest.approx(
        two_engines("sync", COST, lengths).now, rel=1e-9
    )
    base, slow = two_engines("multiversion", COST, lengths), two_engines("multiversion", drv, lengths)
    stalled = sum(e.stalled for e in slow.engines)
    assert stalled > 0 and slow.now > base.now
    assert sum(e.stalled for e in base.engines) == 0.0
    # each stall is one report's cost, charged only for reports that arrive while the trainer computes
    trains = [(sp.t0, sp.t1) for sp in slow.trainer_spans if sp.phase == "train"]
    for e in slow.engines:
        for sp in e.spans:
            if sp.phase == "wait":
                assert sp.t1 - sp.t0 >= 0.06 - 1e-12
                assert any(t0 - 1e-9 <= sp.t0 <= t1 + 1.0 for t0, t1 in trains)
    assert slow.rec.summary["bubble_ratio"] > base.rec.summary["bubble_ratio"]


def test_a_scaled_segment_takes_proportionally_longer():
    from tailrace.sim.segment import Segment

    seg = Segment(0.002, ((0.001, 1e-6, 0.0005, 3e-6),))
    assert seg.scaled(1.25).time(700) == pytest.approx(1.25 * seg.time(700), rel=1e-12)


class Times:
    """A failure clock with given failure times (then none)."""

    def __init__(self, *times):
        self.times = list(times)

    def next(self):
        return self.times.pop(0) if self.times else float("inf")


def _with_failures(cl_args, engine_times=(), trainer_times=(), detect=1.0, restart=2.0):
    from tailrace.sim.failures import FailureSpec

    spec = FailureSpec(engine_mtbf_s=1.0, trainer_mtbf_s=1.0, detect_s=detect, restart_s=restart)
    spec.arrivals = lambda worker, mtbf: Times(
        *(trainer_times if worker == cl_args["engines"] else engine_times)
    )
    return spec


def test_a_trainer_failure_costs_the_restart_and_the_steps_since_the_checkpoint():
    """Sync, constant lengths, 2 steps per round: a failure in the second step of the first round loses
    that step's part done and the first step (not checkpointed: only publishing steps are), plus
    detection and restart; the run is that much longer, and trains the same samples."""
    R, K, U, P, L, rounds = 4, 2, 2, 100, 300, 2
    args = dict(engines=1)
    clean = cluster(SyncPolicy(), ConstantLengths(L, prompt=P), R, K, U, steps=rounds * R // U, slots=R * K)
    clean.run()
    train = COST.train_time([P + L] * (U * K))
    first_round_gen = clean.rec.step_log[0]["t0"]
    t_fail = first_round_gen + train + 0.25 * train  # a quarter into the round's second step
    spec = _with_failures(args, trainer_times=[t_fail])
    sched = Scheduler(
        SyncPolicy(), prompt_stream(ConstantLengths(L, prompt=P)), [(R * K, 16)], FlowSpec(R, K, U, 4)
    )
    cl = SimCluster(
        sched, [SimEngine(0, R * K, COST, ConstantLengths(L, prompt=P))], COST, Capture(), failures=spec
    )
    cl.run()
    log = cl.failure_log
    assert log.trainer == 1 and log.trainer_down_s == pytest.approx(3.0)
    assert log.trainer_redo_s == pytest.approx(0.25 * train + train, rel=1e-9)
    assert cl.now == pytest.approx(clean.now + 3.0 + 0.25 * train + train, rel=1e-9)
    assert [t.step for t in cl.rec.trains] == [t.step for t in clean.rec.trains]


@settings(max_examples=15, deadline=None)
@given(mode=st.sampled_from(GROUP_MODES), seed=st.integers(0, 1000), engines=st.integers(1, 2))
def test_engine_and_trainer_failures_lose_no_sample_in_any_mode(mode, seed, engines):
    import random

    from tailrace.sim.failures import FailureSpec

    rng = random.Random(seed)
    lengths = LognormalLengths(median=300, max_len=2000, seed=seed)
    sched = Scheduler(make_policy(mode), prompt_stream(lengths), [(16, 4)] * engines, FlowSpec(8, 4, 2, 8))
    engs = [SimEngine(i, 16, COST, lengths) for i in range(engines)]
    spec = FailureSpec(engine_mtbf_s=rng.uniform(8, 30), trainer_mtbf_s=rng.uniform(8, 30), detect_s=0.5,
                       restart_s=1.0, seed=seed)  # fmt: skip
    cl = SimCluster(sched, engs, COST, Capture(), failures=spec)
    cl.run()
    trained = [(t.group, t.sample_index) for c in cl.rec.trains for g in c.groups for t in g.trajectories]
    assert len(trained) == len(set(trained)) == 8 * 2 * 4
    sched.ledger.check(sched.in_store())
    assert len(cl.failure_log.events) == cl.failure_log.engine + cl.failure_log.trainer


def test_failures_faster_than_any_sample_finishes_stop_the_simulation_with_the_figures_to_change():
    from tailrace.sim.failures import FailureSpec

    lengths = ConstantLengths(2000, prompt=64)
    sched = Scheduler(make_policy("sync"), prompt_stream(lengths), [(16, 4)], FlowSpec(8, 4, 2, 8))
    spec = FailureSpec(engine_mtbf_s=0.5, detect_s=0.1, restart_s=0.1, seed=1)
    cl = SimCluster(sched, [SimEngine(0, 16, COST, lengths)], COST, Capture(), failures=spec)
    with pytest.raises(SimStalled, match=r"livelocked.*failures.engine_mtbf_s=0.5"):
        cl.run()


def test_simulate_reports_the_effective_training_time_ratio(tmp_path):
    from tailrace.sim.scenario import load_scenario, simulate

    base = ["--cluster.hardware=h100", "--cluster.model=qwen3-1.7b", "--cluster.engines=4",
            "--flow.prompts_per_round=16", "--flow.samples_per_prompt=8", "--flow.train_batch=64",
            "--flow.steps=16", "--lengths={kind: lognormal, median: 1000, max_len: 8000, prompt: 128}"]  # fmt: skip
    s = simulate(load_scenario(None, [*base, "--failures.engine_mtbf_s=60", "--failures.trainer_mtbf_s=120"]))
    f = s["failures"]
    assert f["count"] > 0 and 0 < f["ettr"] < 1
    assert f["clean_wall_s"] == pytest.approx(simulate(load_scenario(None, base))["wall_s"])
