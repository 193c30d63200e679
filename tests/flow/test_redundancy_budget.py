"""DARTS' redundancy budget from the engines' step cost: the rule on hand-checked numbers, the fit of
a step's cost from engine reports, and darts planning with it (extra = null)."""

import json

import pytest

from tailrace.flow.policies import make_policy
from tailrace.flow.scheduler import FlowSpec, Scheduler
from tailrace.flow.shaping import make_shaping
from tailrace.flow.shaping.redundancy import StepCost, cost_budget
from tailrace.types import Prompt


def test_the_budget_is_what_a_tenth_more_time_affords():
    # T0 = 0.002 x 200 + 0.0001 x 128 x 40 = 0.912 s; an extra costs 0.0001 x 40 = 0.004 s:
    # 0.0912 / 0.004 = 22.8 extras; the slots hold 64 x 200 / 40 = 320 samples' tokens, 192 more
    assert cost_budget(128, 64, 0.002, 0.0001, 40, 200, 0.1) == 22
    assert cost_budget(128, 64, 0.002, 0.0001, 40, 200, 0.0) == 0


def test_a_weight_bound_step_makes_redundancy_cheap_up_to_two_m():
    # fixed 50 ms a step: T0 = 10.512 s, 262 extras by time; the slots allow 192, the group size 128
    assert cost_budget(128, 64, 0.05, 0.0001, 40, 200, 0.1) == 128
    assert cost_budget(128, 64, 0.05, 0.0, 40, 200, 0.1) == 128  # rows cost nothing: only 2M bounds


def test_full_slots_leave_no_room_for_extras():
    assert cost_budget(128, 16, 0.05, 0.0001, 40, 200, 0.1) == 0  # 16 x 200 / 40 = 80 < 128 samples
    assert cost_budget(128, 40, 0.05, 0.0001, 40, 200, 0.1) == 72  # 40 x 200 / 40 - 128


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="mean_len <= max_len"):
        cost_budget(8, 8, 0.1, 0.1, 10, 5, 0.1)
    with pytest.raises(ValueError, match="non-negative"):
        cost_budget(8, 8, -0.1, 0.1, 10, 20, 0.1)


def test_the_fit_recovers_a_steps_fixed_and_per_token_cost():
    fit = StepCost()
    for steps, dec, pre in [(3, 40, 0), (10, 90, 200), (1, 64, 0), (7, 20, 30), (5, 300, 0), (2, 2, 500)]:
        fit.add(steps, dec, pre, 0.003 * steps + 0.0002 * dec + 0.00005 * pre)
    fixed, per_token = fit.fit()
    assert fixed == pytest.approx(0.003, rel=1e-9) and per_token == pytest.approx(0.0002, rel=1e-9)


def test_without_prefill_two_parts_are_fitted():
    fit = StepCost()
    for steps, dec in [(3, 40), (10, 90), (1, 64), (7, 20)]:
        fit.add(steps, dec, 0, 0.001 * steps + 0.0004 * dec)
    assert fit.fit() == pytest.approx((0.001, 0.0004), rel=1e-9)


def test_no_fit_until_the_parts_can_be_told_apart():
    fit = StepCost()
    for _ in range(3):
        fit.add(4, 40, 0, 0.1)
    assert fit.fit() is None  # fewer than four reports
    fit.add(8, 80, 0, 0.2)
    assert fit.fit() is None  # always 10 rows a step: fixed and per-token cost are one number


def prompts():
    i = 0
    while True:
        yield Prompt(id=i % 4, token_ids=(1, 2), answer="0")
        i += 1


def test_darts_with_a_null_extra_plans_the_budget_the_step_cost_affords():
    s = Scheduler(make_policy("sync"), prompts(), [(16, 0)], FlowSpec(4, 4, 4, 2),
                  shaping=make_shaping("darts", window=4, extra=None, extra_time=0.5))  # fmt: skip
    d = s.shaping
    assert [p.candidates for p in d.plan([Prompt(i, (1,), "0") for i in range(4)], 4)] == [4] * 4  # no data
    for pid, lengths in enumerate([[2, 4, 6, 8], [5, 5, 5, 5], [1, 9, 1, 9], [3, 3, 4, 4]]):
        d.stats.observe(pid, lengths)
    for rows in (16, 9, 4, 1, 12):
        s.on_engine_steps(1, rows, 0, 0.01 + 0.001 * rows)
    fixed, per_token = d.cost.fit()
    assert (fixed, per_token) == (pytest.approx(0.01), pytest.approx(0.001))
    want = cost_budget(16, 16, fixed, per_token, d.stats.typical, d.stats.longest, 0.5)
    plans = d.plan([Prompt(i, (1,), "0") for i in range(4)], 4)
    assert want > 0 and sum(p.candidates for p in plans) == 16 + want
    assert all(4 <= p.candidates <= 8 for p in plans)
    assert plans[2].candidates == 8  # prompt 2's lengths spread widest
    restored = make_shaping("darts", window=4, extra=None, extra_time=0.5)
    restored.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert [p.candidates for p in restored.plan([Prompt(i, (1,), "0") for i in range(4)], 4)] == [
        p.candidates for p in plans
    ]
