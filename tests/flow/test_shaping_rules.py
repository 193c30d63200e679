"""Shaping's pure rules on hand-checked cases: DARTS' dual-end selection, the redundancy allocation
and the per-prompt length statistics."""

import pytest

from tailrace.flow.shaping import Plan, make_shaping
from tailrace.flow.shaping.redundancy import LengthStats, allocate
from tailrace.flow.shaping.select import dual_end
from tailrace.types import Finish, GenResult, Prompt, Trajectory


def traj(i, length, finish=Finish.STOP):
    r = GenResult(f"0.{i}.0", (7,) * length, (0.0,) * length, (0,) * length, finish)
    return Trajectory(0, i, 0, (1,), r, 0.0, False)


def picked(trajs, m, longest):
    kept, rest = dual_end(trajs, m, longest)
    assert sorted(t.sample_index for t in kept + rest) == sorted(t.sample_index for t in trajs)
    return [t.sample_index for t in kept]


def test_keeps_the_k_shortest_and_the_l_longest():
    lengths = [50, 10, 40, 30, 20, 90, 60, 70]  # index -> length; M = 4, L = 1: 3 shortest + longest
    assert picked([traj(i, n) for i, n in enumerate(lengths)], 4, 1) == [1, 3, 4, 5]
    assert picked([traj(i, n) for i, n in enumerate(lengths)], 4, 0) == [1, 2, 3, 4]  # L = 0: the 4 shortest
    assert picked([traj(i, n) for i, n in enumerate(lengths)], 4, 2) == [1, 4, 5, 7]


def test_truncated_responses_are_never_the_longest_kept():
    trajs = [traj(0, 10), traj(1, 99, Finish.LENGTH), traj(2, 20), traj(3, 30), traj(4, 99, Finish.LENGTH)]
    assert picked(trajs, 3, 1) == [0, 2, 3]  # 10, 20 shortest; 30 the longest non-truncated


def test_truncated_fill_the_group_only_when_too_few_others_finished():
    trajs = [traj(0, 99, Finish.LENGTH), traj(1, 5), traj(2, 80, Finish.LENGTH), traj(3, 7)]
    assert picked(trajs, 3, 1) == [1, 2, 3]  # both non-truncated, then the shorter truncated one
    assert picked(trajs[:2], 2, 1) == [0, 1]  # no redundancy: everything is trained, as without shaping


def test_ties_go_to_the_lower_index_among_shortest_and_higher_among_longest():
    trajs = [traj(i, n) for i, n in enumerate([5, 5, 5, 9, 9, 9])]
    assert picked(trajs, 3, 1) == [0, 1, 5]
    assert picked(list(reversed(trajs)), 3, 1) == [0, 1, 5]  # completion order does not matter


def test_longest_cannot_exceed_the_group():
    with pytest.raises(ValueError, match="shaping.longest=5"):
        dual_end([traj(0, 1)], 4, 5)


def test_allocation_gives_extras_to_the_largest_variance_first_within_m_and_2m():
    assert allocate([1.0, 9.0, 4.0, 9.0], 4, 6) == [4, 8, 4, 6]  # ties: the earlier prompt first
    assert allocate([1.0, 2.0], 4, 0) == [4, 4]
    assert allocate([1.0, 2.0], 4, 100) == [8, 8]  # capped at 2M; budget left unspent
    assert allocate([], 4, 3) == []


@pytest.mark.parametrize("budget", range(0, 20))
def test_allocation_respects_the_budget_and_the_bounds(budget):
    counts = allocate([3.0, 1.0, 4.0, 1.0, 5.0], 3, budget)
    assert all(3 <= n <= 6 for n in counts)
    assert sum(counts) - 15 == min(budget, 15)


def test_length_stats_move_averages_and_the_cold_prior():
    s = LengthStats(alpha=0.5)
    assert s.variance(1) == 0.0  # nothing seen: no spread known
    s.observe(1, [10, 30])  # mean 20, variance 100
    assert (s.mean[1], s.var[1], s.variance(2)) == (20.0, 100.0, 100.0)
    s.observe(1, [20, 20])  # variance 0: EMA halves it
    assert (s.mean[1], s.var[1], s.prior) == (20.0, 50.0, 50.0)
    s2 = LengthStats(alpha=0.5)
    s2.load_state_dict(s.state_dict())
    assert s2 == s


def test_darts_plan_splits_the_budget_and_stops_the_widest_early():
    d = make_shaping("darts", window=4, extra=0.5, early_stop=0.25)
    for pid, lengths in [(0, [10, 10]), (1, [10, 90]), (2, [10, 50]), (3, [10, 30])]:
        d.stats.observe(pid, lengths)
    plans = d.plan([Prompt(i, (1,), "") for i in range(4)], 4)  # budget 0.5 * 4 * 4 = 8 extra
    assert plans == [Plan(4), Plan(8, True), Plan(8), Plan(4)]


def test_unknown_shaping_names_the_choices():
    with pytest.raises(ValueError, match="unknown shaping.name 'dart'; use one of none, darts"):
        make_shaping("dart")
