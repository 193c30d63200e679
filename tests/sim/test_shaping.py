"""Shaping in the simulator: every shaping on every overlap mode finishes its steps with the ledger
whole (the core checks it at every poll), and `tailrace sim` prints the shaping's per-step figures."""

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tailrace.cli.sim import shaping_lines
from tailrace.common import ConfigError
from tailrace.flow.policies import GROUP_MODES
from tailrace.flow.shaping import SHAPINGS
from tailrace.sim.scenario import load_scenario, simulate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim-shaping.yaml"
SMALL = [
    "--flow.prompts_per_round=4", "--flow.samples_per_prompt=4", "--flow.train_batch=8", "--flow.steps=4",
    "--train_size=6", "--journal=false", "--cluster.slots=8",
    "--lengths={kind: lognormal, median: 12, max_len: 48, sigma_prompt: 0.8, runaway: 0.05, prompt: 4}",
]  # fmt: skip


@settings(max_examples=12, deadline=None)
@given(
    mode=st.sampled_from(GROUP_MODES),
    shaping=st.sampled_from(sorted(SHAPINGS)),
    seed=st.integers(0, 1000),
    extra=st.sampled_from([0.25, 1.0]),
    early_stop=st.sampled_from([0.0, 0.5]),
)
def test_every_shaping_on_every_mode_finishes_with_the_ledger_whole(mode, shaping, seed, extra, early_stop):
    assume(SHAPINGS[shaping].modes is None or mode in SHAPINGS[shaping].modes)
    scn = load_scenario(
        None,
        SMALL + [f"--flow.mode={mode}", f"--shaping.name={shaping}", f"--seed={seed}",
                 f"--shaping.extra={extra}", f"--shaping.early_stop={early_stop}"],
    )  # fmt: skip
    s = simulate(scn)  # raises SimStalled on a livelock, LedgerError on a broken identity
    ledger = s["ledger"]
    assert s["steps"] == 4 and ledger["trained"] == 4 * 8
    assert ledger["produced"] == ledger["trained"] + sum(
        ledger["discarded"].values()
    )  # nothing left in store
    assert set(ledger["discarded"]) <= {"shaping", "zero-signal"}
    if shaping == "none":
        assert "shaping" not in ledger["discarded"]


def test_sim_prints_generated_and_trained_lengths_per_step(tmp_path):
    small = ["--flow.steps=3", "--journal=false", "--flow.prompts_per_round=4", "--flow.train_batch=32"]
    simulate(load_scenario(EXAMPLE, ["--shaping.name=darts", "--shaping.extra=0.5", *small]), tmp_path)
    lines = shaping_lines(tmp_path / "metrics.jsonl")  # what `tailrace sim` prints with a shaping on
    assert lines[0].startswith("step  generated p50/p99/max   trained p50/p99/max")
    rows = [line.split() for line in lines[1:]]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert all(int(r[7]) > 0 and int(r[8]) > 0 for r in rows)  # extra tokens, shaping discards


def test_sim_darts_sizes_its_redundancy_from_the_simulated_step_cost(tmp_path):
    """shaping.extra null (the default): nothing extra until the engines' reports and a finished group
    say what a step and a response cost, then the budget the step cost affords."""
    small = ["--flow.steps=3", "--journal=false", "--flow.prompts_per_round=4", "--flow.train_batch=32"]
    simulate(load_scenario(EXAMPLE, ["--shaping.name=darts", *small]), tmp_path)
    rows = [line.split() for line in shaping_lines(tmp_path / "metrics.jsonl")[1:]]
    assert int(rows[0][7]) == 0 and all(int(r[7]) > 0 and int(r[8]) > 0 for r in rows[1:])


def test_a_shaping_on_a_mode_it_does_not_support_is_refused():
    scn = load_scenario(None, SMALL + ["--flow.mode=multiversion", "--shaping.name=tailbatch"])
    with pytest.raises(ConfigError, match="tailbatch works with flow.mode=sync or pipe"):
        simulate(scn)


def test_tail_batching_in_the_sim_defers_and_runs_tail_rounds(tmp_path):
    scn = load_scenario(EXAMPLE, ["--shaping.name=tailbatch", "--flow.steps=24", "--journal=false"])
    s = simulate(scn, tmp_path)
    assert s["steps"] == 24 and s["ledger"]["discarded"]["shaping"] > 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    rounds = [(e["tail"], len(e["groups"])) for e in events if e.get("kind") == "round_start"]
    # 16 prompts a round: short rounds open 20 and keep 16; the deferred 4 a round make a tail round
    # of 16 after every four short ones (RollPacker's cadence)
    assert rounds[:5] == [(False, 20)] * 4 + [(True, 16)]
