"""DARTS' redundancy budget from measured costs: the fit of a step's cost from engine and trainer
reports, and darts planning with it (extra = null), restored from its checkpointed state."""

import json

import pytest

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.flow.shaping.benefit import Costs, best_budget
from tailrace.flow.shaping.redundancy import LengthStats, StepCost, by_spread
from tailrace.types import Prompt


def test_the_fit_recovers_a_steps_fixed_and_per_token_cost():
    fit = StepCost()
    for steps, dec, pre in [(3, 40, 0), (10, 90, 200), (1, 64, 0), (7, 20, 30), (5, 300, 0), (2, 2, 500)]:
        fit.add(steps, dec, pre, 0.003 * steps + 0.0002 * dec + 0.00005 * pre)
    fixed, per_token, _ = fit.fit()
    assert fixed == pytest.approx(0.003, rel=1e-9) and per_token == pytest.approx(0.0002, rel=1e-9)


def test_without_prefill_two_parts_are_fitted():
    fit = StepCost()
    for steps, dec in [(3, 40), (10, 90), (1, 64), (7, 20)]:
        fit.add(steps, dec, 0, 0.001 * steps + 0.0004 * dec)
    assert fit.fit() == pytest.approx((0.001, 0.0004, 0.0), rel=1e-9)


def test_no_fit_until_the_parts_can_be_told_apart():
    fit = StepCost()
    for _ in range(3):
        fit.add(4, 40, 0, 0.1)
    assert fit.fit() is None  # fewer than four reports
    fit.add(8, 80, 0, 0.2)
    assert fit.fit() is None  # always 10 rows a step: fixed and per-token cost are one number


def test_a_part_fitted_negative_is_dropped_and_the_rest_refitted():
    fit = StepCost(decay=1.0)
    for tokens in (10, 20, 30, 40):
        fit.add(1, tokens, 0, 0.001 * tokens * tokens)  # convex: a line through it crosses below 0
    # without the fixed part, the per-token cost is the fit through the origin, not the steeper line
    assert fit.fit() == pytest.approx((0.0, fit.per_token_bound(), 0.0))
    assert fit.per_token_bound() == pytest.approx(0.001 * 100_000 / 3000)  # sum x^3 / sum x^2


def test_before_the_parts_are_told_apart_a_token_carries_the_whole_cost():
    fit = StepCost(decay=1.0)
    assert fit.per_token_bound() is None
    fit.add(1, 100, 0, 3.0)  # 1 s fixed + 0.02 s a token: 3 s for 100 tokens
    assert fit.per_token_bound() == pytest.approx(0.03)
    fit.add(1, 50, 0, 2.0)  # (100 x 3 + 50 x 2) / (100^2 + 50^2) = 400 / 12500
    assert fit.per_token_bound() == pytest.approx(0.032) and fit.fit() is None


def test_the_truncated_fraction_counts_samples_over_groups():
    stats = LengthStats()
    assert stats.truncated() == 0.0
    stats.observe(0, [1, 2, 12, 12], truncated=2)
    stats.observe(1, [3, 4], truncated=0)
    assert stats.truncated() == pytest.approx(0.99 * 2 / (0.99 * 4 + 2))  # not the last group's 0
    assert stats.cap == 12


def prompts():
    i = 0
    while True:
        yield Prompt(id=i % 4, token_ids=(1, 2), answer="0")
        i += 1


def test_darts_with_a_null_extra_plans_the_budget_of_least_predicted_time():
    s = Scheduler(make_policy("sync"), prompts(), [(16, 0)], FlowSpec(4, 4, 4, 2),
                  shaping=make_shaping("darts", window=4, extra=None, early_stop=0.25))  # fmt: skip
    d = s.shaping
    window = [Prompt(i, (1,), "0") for i in range(4)]
    assert [p.candidates for p in d.plan(window, 4)] == [4] * 4  # no data
    for pid, lengths in enumerate([[2, 4, 6, 8], [5, 5, 5, 5], [1, 9, 1, 19], [3, 3, 4, 4]]):
        d.stats.observe(pid, lengths)
    for rows in (16, 9, 4, 1, 12):
        s.on_engine_steps(1, rows, 0, 0.01 + 0.001 * rows)
    for lengths in [[10, 20, 30], [5, 5, 40, 1], [8, 12], [7, 7, 7, 7, 50]]:
        s.on_train_step(
            lengths, 0.05 * len(lengths) + 0.02 * sum(lengths) + 0.001 * sum(n * n for n in lengths)
        )
    assert d.cost.fit() == pytest.approx((0.01, 0.001, 0.0))
    assert d.train_cost.fit() == pytest.approx((0.05, 0.02, 0.001))
    var = [d.stats.variance(i) for i in range(4)]
    want = best_budget([d.stats.mean_length(i) for i in range(4)], var, 19, 0.0, 4, 1, 1,
                       Costs(0.01, 0.001, 0.05, 0.02, 0.001, 1, 16), by_spread(var))  # fmt: skip
    plans = d.plan(window, 4)
    assert want > 0 and sum(p.candidates for p in plans) == 16 + want
    assert plans[2].candidates == 8 and plans[2].early_stop  # prompt 2's lengths spread widest
    assert all(4 <= p.candidates <= 8 for p in plans)
    restored = make_shaping("darts", window=4, extra=None, early_stop=0.25)
    restored.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert restored.plan(window, 4) == plans
