"""Several policies in one simulated run (`policies`, as a real run's; flow/multi.py's PolicySet): the
engines are shared, each policy has its own scheduler, staleness bound, version counter, ledger and trainer. Each
scheduler checks its bound and ledger at every poll inside the simulation; the assertions add the
times, checked by hand where the lengths are constant."""

import json
from pathlib import Path

import pytest
import yaml

from tailrace.cli import main
from tailrace.common import ConfigError
from tailrace.flow.multi import PolicySet
from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.sim.cluster import SimCluster
from tailrace.sim.engine import SimEngine
from tailrace.sim.lengths import ConstantLengths, make_lengths
from tailrace.sim.runs import Runs
from tailrace.sim.scenario import build, cost_model, engine_slots, load_scenario, prompt_stream, simulate
from tests.sim.test_cluster import COST, Capture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim-multi.yaml"

SMALL = [
    "--cluster.hardware=h100",
    "--cluster.model=qwen3-1.7b",
    "--cluster.engines=2",
    "--cluster.slots=32",
    "--cluster.trainer_gpus=1",
    "--flow.mode=sync",
    "--flow.prompts_per_round=8",
    "--flow.samples_per_prompt=4",
    "--flow.train_batch=16",
    "--flow.steps=8",
    "--lengths={kind: lognormal, median: 100, max_len: 600, prompt: 64}",
    "--journal=false",
]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def one_engine(modes, lengths, R, K, U, steps, slots):
    scheds = [
        Scheduler(
            make_policy(m, max_staleness=1), prompt_stream(lengths), [(slots, 0)], FlowSpec(R, K, U, steps)
        )
        for m in modes
    ]
    s = PolicySet([f"p{i}" for i in range(len(modes))], scheds)
    engine = SimEngine(0, slots, COST, lengths, start_versions=[s.version(p, 0) for p in range(len(s))])
    return SimCluster(s, [engine], COST, [Capture() for _ in modes])


def test_one_round_of_two_sync_policies_costs_one_prefill_a_two_version_decode_and_parallel_training():
    """Both policies' samples reach the engine in the first poll and are prefilled together; each
    decode step runs a forward per policy's weights; then each trains its R/U steps on its own
    trainer at the same time. Alone, a policy's round is the same with one version's forwards."""
    R, K, U, P, L = 4, 4, 2, 100, 700
    N, lengths = R * K, ConstantLengths(L, prompt=P)
    train = (R // U) * COST.train_time([P + L] * (U * K)) + COST.publish_time()
    alone = one_engine(["sync"], lengths, R, K, U, R // U, slots=2 * N)
    alone.run()
    assert alone.now == pytest.approx(
        COST.prefill_time([P] * N) + COST.decode_segment({0: (N, N * P)}).time(L) + train, rel=1e-9
    )
    both = one_engine(["sync", "sync"], lengths, R, K, U, R // U, slots=2 * N)
    both.run()
    decode = COST.decode_segment({0: (N, N * P), 1: (N, N * P)}).time(L)
    assert both.now == pytest.approx(COST.prefill_time([P] * 2 * N) + decode + train, rel=1e-9)
    assert alone.now < both.now < 2 * alone.now
    for p, name in enumerate(("p0", "p1")):
        fig = both.summary["policies"][name]
        assert fig["steps"] == R // U and fig["wall_s"] == pytest.approx(both.now, rel=1e-9)
        assert [c.policy for c in both.recs[p].trains] == [p] * (R // U)
        assert both.trainers[p].busy == pytest.approx(alone.trainer_busy, rel=1e-9)
        for c in both.recs[p].trains:  # translated back run by run: the simulator's versions stay compact
            assert all(isinstance(t.result.versions, Runs) for g in c.groups for t in g.trajectories)


def test_two_sync_policies_together_finish_sooner_than_one_after_the_other():
    """Both policies see the same prompts and lengths, so either alone is the single-policy run. Here
    the slots hold both rounds: the two generate in the same decode steps (a forward each) and train
    at once, each on its own trainer, so together cost about two generations and one training (alone:
    training is 38% of the time; two after each other cost two of each)."""
    alone = simulate(load_scenario(None, SMALL))
    both = simulate(load_scenario(None, [*SMALL, "--policies=[{name: a}, {name: b}]"]))
    assert alone["trainer_wait_ratio"] == pytest.approx(0.62, abs=0.01)
    assert alone["wall_s"] < both["wall_s"] < 0.85 * 2 * alone["wall_s"]
    assert both["steps"] == 16 and both["gpus"] == alone["gpus"] + 1  # a trainer device each
    for fig in both["policies"].values():
        assert fig["steps"] == 8 and fig["staleness"] == {"0": 8 * 16}
        assert alone["wall_s"] < fig["wall_s"] <= both["wall_s"]
    assert max(f["wall_s"] for f in both["policies"].values()) == both["wall_s"]


def test_a_multiversion_policy_beside_a_sync_one_keeps_its_bound_and_each_ledger_holds():
    mv = "{name: mv, flow: {mode: multiversion, max_staleness: 2, steps: 10}}"
    scn = load_scenario(None, [*SMALL, f"--policies=[{{name: sync}}, {mv}]"])
    cl = build(scn)
    cl.run()
    sync, mv = cl.policies
    assert set(sync.staleness) == {0}
    assert max(mv.staleness) <= 2 and max(mv.staleness) > 0
    for s, steps in ((sync, 8), (mv, 10)):
        assert s.steps_done == steps and s.ledger.trained == steps * 16
        s.ledger.check(s.in_store())
    figs = cl.summary["policies"]
    assert (
        cl.summary["ledger"]["trained"] == figs["sync"]["ledger"]["trained"] + figs["mv"]["ledger"]["trained"]
    )
    assert cl.summary["staleness"]["0"] == figs["sync"]["staleness"]["0"] + figs["mv"]["staleness"].get(
        "0", 0
    )
    assert cl.summary["policy"] == "sync+multiversion"


def test_trainer_and_engine_failures_lose_no_sample_of_any_policy():
    fail = ["--failures.engine_mtbf_s=30", "--failures.trainer_mtbf_s=10", "--failures.detect_s=1",
            "--failures.restart_s=2"]  # fmt: skip
    cl = build(load_scenario(None, [*SMALL, "--policies=[{name: a}, {name: b, flow: {mode: pipe}}]", *fail]))
    cl.run()
    assert {w for _, kind, w in cl.failure_log.events if kind == "trainer"} == {0, 1}  # each its own clock
    for s in cl.policies:
        assert s.steps_done == 8 and s.ledger.trained == 8 * 16
        s.ledger.check(s.in_store())


def test_policies_are_validated_with_the_key_and_the_fix():
    """As a real run's `policies` (config.load.policy_configs), with the sections a simulated policy has."""
    for bad, match in (
        ("[{flow: {mode: sync}}]", r"policies\[0\]: each policy is a mapping with a name"),
        ("[{name: a}, {name: a}]", r"policies\[1\].name='a': give each policy a unique name"),
        (
            "[{name: a, seed: 3}]",
            r"policies\[0\].seed: a policy sets only flow, shaping, store, policy_options",
        ),
        (
            "[{name: a, flow: {mde: sync}}]",
            r"policies\[0\] \(a\): unknown config key flow.mde; did you mean flow.mode",
        ),
        (
            "[{name: a, flow: {train_batch: 10}}]",
            r"policies\[0\] \(a\): flow.train_batch=10 is not a multiple",
        ),
        (
            "[{name: a, flow: {time_limit_s: 60}}]",
            r"policies\[0\].flow.time_limit_s: the run's, not a policy's",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            load_scenario(None, [*SMALL, f"--policies={bad}"])
    with pytest.raises(ConfigError, match="cluster.colocated: false"):
        load_scenario(None, [*SMALL, "--policies=[{name: a}, {name: b}]", "--cluster.colocated=true"])
    named = load_scenario(EXAMPLE).policy_scenarios()  # the documented example
    assert [(n, s.flow.mode, s.flow.max_staleness) for n, s in named] == [
        ("solver", "sync", 1),
        ("verifier", "multiversion", 2),
    ]


def test_slots_sized_from_memory_leave_room_for_every_policys_weights():
    args = [*SMALL, "--cluster.slots=0", "--cluster.model=qwen2.5-7b", "--cluster.hardware=a100-80g",
            "--lengths={kind: lognormal, median: 8000, max_len: 30000, prompt: 512}"]  # fmt: skip
    one, two = load_scenario(None, args), load_scenario(None, [*args, "--policies=[{name: a}, {name: b}]"])
    lengths = make_lengths(one.lengths)
    cost = cost_model(one)
    per_seq = lengths.prompt_len(0) + lengths.mean()
    assert engine_slots(two, cost, lengths) == int(
        (cost.kv_capacity_tokens() - cost.version_kv_tokens()) / per_seq
    )
    assert engine_slots(two, cost, lengths) < engine_slots(one, cost, lengths)


def test_tailrace_sim_lays_out_a_run_of_several_policies_as_a_real_run(tmp_path):
    """RUN/policies/<name>/ per policy (its config, metrics, journal, its scheduler's marks, a report),
    the engines' and trainers' timeline in RUN/events.jsonl; `tailrace report RUN` compares them."""
    path = tmp_path / "s.yaml"
    policies = [{"name": "solver"}, {"name": "verifier", "flow": {"mode": "pipe", "steps": 4}}]
    path.write_text(yaml.safe_dump({"policies": policies}))
    out = tmp_path / "run"
    over = [o for o in SMALL if not o.startswith("--journal")]
    assert main(["sim", "--config", str(path), "--out", str(out), *over]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and list(summary["policies"]) == ["solver", "verifier"]
    for name, steps in (("solver", 8), ("verifier", 4)):
        run = out / "policies" / name
        for f in ("config.yaml", "metrics.jsonl", "events.jsonl", "journal.jsonl", "report.html"):
            assert (run / f).is_file(), f
        assert [r["step"] for r in lines(run / "metrics.jsonl")] == list(range(steps))
        assert {e["lane"] for e in lines(run / "events.jsonl")} == {"scheduler"}
        own = load_scenario(run / "config.yaml")
        assert own.flow.steps == steps and not own.policies
    lanes = {e["lane"] for e in lines(out / "events.jsonl")}
    assert lanes == {"engine0", "engine1", "trainer-solver", "trainer-verifier"}
    assert load_scenario(out / "config.yaml").policies == policies
    assert main(["report", str(out), "--out", str(tmp_path / "compare.html")]) == 0


def test_a_real_run_of_several_policies_is_simulated_one_policy_at_a_time(tmp_path):
    from tailrace.config import RunConfig, dump_config
    from tailrace.sim.scenario import scenario_from_run

    cfg = RunConfig(policies=[{"name": "sums"}, {"name": "calc", "task": {"seed": 1}}])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    with pytest.raises(ConfigError, match=r"trained 2 policies: .* --like .*policies/sums"):
        scenario_from_run(tmp_path)


def test_a_policy_that_joins_mid_run_starts_then_and_every_ledger_holds():
    """`join_at_s` (a policy's own key): the policy joins the running set at that virtual second, as
    `tailrace policy join` does: its first request goes out after it, in its own versions (v * room + p),
    and it trains all its steps; the run ends when every policy, joiners included, is done."""
    policies = "[{name: a}, {name: late, join_at_s: 30, flow: {mode: multiversion, steps: 4}}, {name: b}]"
    cl = build(load_scenario(None, [*SMALL, f"--policies={policies}", "--flow.steps=12"]))
    sent = []
    post = cl._post
    cl._post = lambda engine, c: (sent.append((cl.now, c)), post(engine, c))[1]
    cl.run()
    assert cl.policies.names == ("a", "b", "late") and cl.policies.room == 3
    late = cl.policies[2]
    assert late.steps_done == 4 and late.ledger.trained == 4 * 16
    for s in cl.policies:
        s.ledger.check(s.in_store())
    gens = [(t, r) for t, c in sent if type(c).__name__ == "Generate" for r in c.requests]
    mine = [(t, r) for t, r in gens if r.id.startswith("late/")]
    assert mine and min(t for t, _ in mine) >= 30.0
    assert all(r.version % 3 == 2 for _, r in mine)
    assert any(t < 30.0 for t, _ in gens)  # the others ran before it came
    assert cl.summary["policies"]["late"]["steps"] == 4
    with pytest.raises(ConfigError, match="at least one policy starts at 0"):
        build(load_scenario(None, [*SMALL, "--policies=[{name: a, join_at_s: 5}]"]))
