import pytest

from tailrace.trainer.advantages import ADVANTAGES


def test_grpo_normalises_by_population_std():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5
    a = ADVANTAGES["grpo"]([1.0, 0.0, 0.0, 1.0])
    s = 0.5 / (0.5 + 1e-6)
    assert a == pytest.approx([s, -s, -s, s], abs=1e-12)
    # rewards [3, 0, 0]: mean 1, population std sqrt(2)
    a = ADVANTAGES["grpo"]([3.0, 0.0, 0.0])
    assert a == pytest.approx([2 / (2**0.5 + 1e-6), -1 / (2**0.5 + 1e-6), -1 / (2**0.5 + 1e-6)], abs=1e-12)


def test_grpo_equal_rewards_give_zero():
    assert ADVANTAGES["grpo"]([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


def test_drgrpo_centres_without_std():
    assert ADVANTAGES["drgrpo"]([3.0, 0.0, 0.0]) == pytest.approx([2.0, -1.0, -1.0])


def test_rloo_leave_one_out_baseline():
    # 3 - (0+0)/2 = 3;  0 - (3+0)/2 = -1.5
    assert ADVANTAGES["rloo"]([3.0, 0.0, 0.0]) == pytest.approx([3.0, -1.5, -1.5])
    # 1 - (0+0+1)/3 = 2/3
    assert ADVANTAGES["rloo"]([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert ADVANTAGES["rloo"]([5.0]) == [0.0]
