import pytest

from tailrace.trainer.advantages import ADVANTAGES, drgrpo, grpo, rloo


def test_grpo_normalises_by_population_std():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5
    a = grpo([1.0, 0.0, 0.0, 1.0])
    s = 0.5 / (0.5 + 1e-6)
    assert a == pytest.approx([s, -s, -s, s], abs=1e-12)
    # rewards [3, 0, 0]: mean 1, population std sqrt(2)
    a = grpo([3.0, 0.0, 0.0])
    assert a == pytest.approx([2 / (2**0.5 + 1e-6), -1 / (2**0.5 + 1e-6), -1 / (2**0.5 + 1e-6)], abs=1e-12)


def test_grpo_equal_rewards_give_zero():
    assert grpo([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


def test_drgrpo_centres_without_std():
    assert drgrpo([3.0, 0.0, 0.0]) == pytest.approx([2.0, -1.0, -1.0])


def test_rloo_leave_one_out_baseline():
    # 3 - (0+0)/2 = 3;  0 - (3+0)/2 = -1.5
    assert rloo([3.0, 0.0, 0.0]) == pytest.approx([3.0, -1.5, -1.5])
    # 1 - (0+0+1)/3 = 2/3
    assert rloo([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo([5.0]) == [0.0]


def test_the_group_estimators_take_a_steps_groups_one_by_one():
    step = [[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0]]
    for name, f in (("grpo", grpo), ("drgrpo", drgrpo), ("rloo", rloo)):
        assert ADVANTAGES[name](step) == [f(r) for r in step]
    assert ADVANTAGES["grpo"]([]) == []


def test_batch_std_centres_in_the_group_and_scales_by_the_step():
    # rewards 1, 0, 0, 1 | 1, 1, 1, 0: step mean 5/8, population variance 15/64 (std 0.4841)
    step = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    s = (15 / 64) ** 0.5 + 1e-6
    assert ADVANTAGES["batch_std"](step) == [
        pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-12),
        pytest.approx([0.25 / s, 0.25 / s, 0.25 / s, -0.75 / s], abs=1e-12),
    ]
    # a group whose rewards barely differ keeps small advantages (grpo's own std makes them +-1)
    near = [[0.5, 0.5, 0.5, 0.501], [1.0, 0.0, 1.0, 0.0]]
    assert max(map(abs, ADVANTAGES["batch_std"](near)[0])) < 0.003 < 0.99 < max(map(abs, grpo(near[0])))
    assert ADVANTAGES["batch_std"]([[0.2, 0.2], [0.2, 0.2]]) == [[0.0, 0.0], [0.0, 0.0]]
