"""The learning-rate schedule against values worked out by hand, and the warm start's own recipe."""

import math

import pytest

from tailrace.trainer.schedule import LRSchedule


def test_constant_with_a_linear_warmup():
    s = LRSchedule(lr=1e-3, warmup=4)
    assert [s.lr_at(i) for i in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert LRSchedule(lr=1e-3).lr_at(0) == 1e-3  # no warmup: the peak from the first step


def test_linear_decay_after_the_warmup_to_the_floor():
    # warmup 2 of 12 steps, then from step 2 down by 1/10 of (1 - 0.1) x lr a step; step 12 on: the floor
    s = LRSchedule(lr=1.0, warmup=2, total=12, decay="linear", floor=0.1)
    assert [s.lr_at(i) for i in (0, 1, 2, 3, 7, 11, 12, 50)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.91, 0.55, 0.19, 0.1, 0.1]
    )


def test_cosine_decay_halfway_and_at_the_end():
    s = LRSchedule(lr=2.0, total=10, decay="cosine")
    assert s.lr_at(0) == 2.0
    assert s.lr_at(5) == pytest.approx(1.0)  # half way: half the rate
    assert s.lr_at(10) == pytest.approx(0.0)
    assert s.lr_at(3) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.3)))


def test_the_warm_starts_recipe_is_unchanged():
    """SFT's schedule before it moved here: warmup, then cosine to a tenth; the same floats to the bit, so
    the default model the warm start builds is the one every figure was measured on."""
    lr, warmup, total = 2e-3, 100, 2760
    s = LRSchedule(lr=lr, warmup=warmup, total=total, decay="cosine", floor=0.1)
    for step in (0, 57, 99, 100, 101, 1000, 2759, 3000):
        if step < warmup:
            old = lr * (step + 1) / warmup
        else:
            frac = (step - warmup) / max(1, total - warmup)
            old = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        assert s.lr_at(step) == old


def test_describe_and_refusals():
    assert LRSchedule(lr=1e-3).describe() == ""
    assert LRSchedule(lr=1e-3, warmup=1).describe() == "warmup 1 step"
    assert LRSchedule(lr=1e-3, warmup=10, total=120, decay="cosine").describe() == (
        "warmup 10 steps, then cosine decay to 0 at step 120"
    )
    assert LRSchedule(lr=1e-3, total=50, decay="linear", floor=0.1).describe() == (
        "linear decay to 0.1 x the peak at step 50"
    )
    with pytest.raises(ValueError, match="decay 'step'"):
        LRSchedule(lr=1e-3, decay="step")
    with pytest.raises(ValueError, match="needs the run's steps"):
        LRSchedule(lr=1e-3, decay="linear")
