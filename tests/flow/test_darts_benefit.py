"""DARTS' benefit model (flow/shaping/benefit.py) on hand-checked cases: order statistics of uniform
draws (E[X_(k:n)] = k / (n + 1), E[X_(k:n)^2] = k (k + 1) / ((n + 1)(n + 2))), a group's generated
and trained tokens, and the budget of least predicted round time where only one of its terms is
priced."""

import pytest

from tailrace.flow.shaping.benefit import GRID, Costs, best_budget, expect, group, lognormal_cdf, order_cdfs

H = 1 / (GRID - 1)
UNIFORM = [g * H for g in range(GRID)]  # F(x) = x on [0, 1]


def test_order_statistics_of_uniform_draws():
    for n in (1, 2, 8, 16):
        means = [expect(c, H) for c in order_cdfs(UNIFORM, n)]
        assert means == pytest.approx([k / (n + 1) for k in range(1, n + 1)], abs=2e-4)
        squares = [expect(c, H, 2) for c in order_cdfs(UNIFORM, n)]  # Beta(k, n + 1 - k)'s 2nd moment
        assert squares == pytest.approx(
            [k * (k + 1) / ((n + 1) * (n + 2)) for k in range(1, n + 1)], abs=2e-4
        )


def test_a_group_that_waits_for_all_trains_the_shortest_and_the_longest():
    g = group(UNIFORM, H, 16, 8, 1, early=False)
    assert g.generated == pytest.approx(16 / 2, abs=1e-3)  # every candidate runs to its end
    assert g.trained == pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 7 + 16) / 17, abs=1e-3)  # 7 shortest + max
    assert expect(g.done, H) == pytest.approx(16 / 17, abs=1e-3)  # it completes at the longest
    plain = group(UNIFORM, H, 8, 8, 1, early=False)
    assert (plain.generated, plain.trained) == (pytest.approx(4, abs=1e-3), pytest.approx(4, abs=1e-3))


def test_an_early_stopped_group_completes_at_its_m_th_finisher():
    g = group(UNIFORM, H, 16, 8, 1, early=True)
    assert expect(g.done, H) == pytest.approx(8 / 17, abs=1e-3)
    assert g.trained == pytest.approx(36 / 17, abs=1e-3)  # its first 8: 1/17 + ... + 8/17
    assert g.generated == pytest.approx((36 + 8 * 8) / 17, abs=1e-3)  # 8 more cut at the 8th's 8/17


def test_the_lognormal_keeps_its_mean_below_a_far_cap():
    f = lognormal_cdf(40.0, 40.0**2 * 0.25, 400.0)
    assert expect(f, 400 / (GRID - 1)) == pytest.approx(40.0, rel=0.01)
    assert lognormal_cdf(10.0, 0.0, 20.0)[70] == 1.0  # no spread: a step at the mean (x = 10.9)
    q = lognormal_cdf(40.0, 40.0**2 * 0.25, 400.0, runaway=0.1)  # a tenth run to the cap
    assert expect(q, 400 / (GRID - 1)) == pytest.approx(0.9 * 40.0 + 0.1 * 400.0, rel=0.01)
    with pytest.raises(ValueError, match="mean > 0"):
        lognormal_cdf(0.0, 1.0, 10.0)


def test_a_group_of_2m_does_not_train_its_runaways():
    # the cap is 1 and a tenth of the draws run to it, the rest uniform below: the k-th shortest of
    # 16 is about k / (17 x 0.9) (for k <= 7 at least 7 are below the cap: P > 0.999), and the
    # longest trained is the longest of 16 uniform draws below the cap, 16 / 17
    f = [0.9 * x for x in UNIFORM]
    g = group(f, H, 16, 8, 1, early=False)
    assert g.trained == pytest.approx(28 / (17 * 0.9) + 16 / 17, abs=1e-3)
    assert group(f, H, 8, 8, 1, early=False).trained == pytest.approx(8 * (0.9 * 0.5 + 0.1), abs=1e-3)


def budget(costs: Costs, early: int, slots_ok: bool = True) -> int:
    means, variances = [40.0, 40.0, 40.0, 40.0], [1600.0, 400.0, 100.0, 0.0]
    return best_budget(means, variances, 400.0, 0.0, 8, 1, early, costs, order=[0, 1, 2, 3])


def test_only_the_step_priced_extras_pay_where_they_stop_early():
    # a wide prompt stopping early at its 8th of 16 ends long before its 8th of 8; extras that wait
    # for all 16 only make the round's last group later
    assert budget(Costs(1.0, 0.0, 0.0, 0.0, 0.0, 1, 10**6), early=1) == 8
    assert budget(Costs(1.0, 0.0, 0.0, 0.0, 0.0, 1, 10**6), early=0) == 0


def test_only_the_trainer_priced_every_prompt_gets_2m():
    # the 7 shortest + the longest of 16 are shorter than all 8 of 8, except with no spread
    assert budget(Costs(0.0, 0.0, 0.0, 1.0, 0.0, 1, 10**6), early=0) == 24


def test_only_rows_priced_no_extras():
    assert budget(Costs(0.0, 1.0, 0.0, 0.0, 0.0, 1, 10**6), early=1) == 0


def test_extras_must_fit_in_the_slots():
    assert (
        budget(Costs(0.0, 0.0, 0.0, 1.0, 0.0, 1, 1), early=0) == 0
    )  # one row: 32 samples never fit one round


def test_overlapped_only_the_slower_side_counts():
    # trainer-bound (1 s a sample, 32 samples): the engines' cost of extras hides under training
    assert budget(Costs(0.0, 0.01, 1.0, 0.01, 0.0, 1, 10**6, overlap=True), early=0) == 24
    assert budget(Costs(0.0, 0.01, 1.0, 0.01, 0.0, 1, 10**6), early=0) == 0  # in sequence, the rows cost
    # engine-bound: the trainer's savings buy nothing
    assert budget(Costs(0.0, 1.0, 0.0, 0.01, 0.0, 1, 10**6, overlap=True), early=0) == 0
