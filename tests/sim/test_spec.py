"""Speculative decoding in the simulator: a verify step runs gamma + 1 query tokens per row (the
weights and KV read once) and yields (1 - alpha^(gamma+1)) / (1 - alpha) tokens per row in
expectation; the toggle turns it on only where that predicts >= min_speedup, so it pays in the
memory-bound tail and stays off where the batch is compute-bound."""

import pytest

from tailrace.sim.costs import CostModel
from tailrace.sim.hardware import GPUS
from tailrace.sim.models import MODELS
from tailrace.sim.scenario import load_scenario, simulate

COST = CostModel(GPUS["h800"], MODELS["qwen2.5-7b"])


def test_the_time_per_token_factor_against_a_hand_computation():
    batch = {0: (4, 4 * 1000)}
    a, b, c, d = COST.version_terms(4, 4000)
    plain = COST.forward_overhead + max(a, c)
    verify = COST.forward_overhead + max(a, 6 * c)
    tokens = (1 - 0.8**6) / (1 - 0.8)
    assert COST.spec_factor(batch, alpha=0.8, gamma=5) == pytest.approx(verify / (tokens * plain), rel=1e-12)
    assert COST.spec_factor(batch, alpha=0.0, gamma=5) >= 1.0  # nothing accepted: never faster


def test_speculation_pays_at_a_small_batch_and_not_at_a_large_one():
    small = COST.spec_factor({0: (2, 2000)}, alpha=0.8, gamma=5)
    large = COST.spec_factor({0: (512, 512 * 1000)}, alpha=0.8, gamma=5)
    assert small < 1 / 1.5 and large > 1.0


def test_a_run_with_speculation_is_faster_and_says_how_often_it_was_on():
    base = ["--flow.steps=4", "--journal=false", "--cluster.hardware=h800", "--cluster.model=qwen2.5-7b",
            "--lengths={kind: lognormal, median: 800, max_len: 4096, sigma_sample: 0.8, prompt: 128}"]  # fmt: skip
    off = simulate(load_scenario(None, base))
    on = simulate(load_scenario(None, [*base, "--spec.alpha=0.8"]))
    assert on["wall_s"] < off["wall_s"]
    assert 0 < on["spec_on_fraction"] <= 1 and off["spec_on_fraction"] == 0
    assert on["ledger"] == off["ledger"]
