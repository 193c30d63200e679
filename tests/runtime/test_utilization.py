"""A run's time figures across a resume (runtime/metrics.py `Utilization.resumed`), hand-checked."""

import pytest

from tailrace.runtime.metrics import Utilization


def test_a_resumed_run_s_clock_and_ratios_go_on_from_its_last_step_record():
    # the last record kept: 10 s in, the trainer idle a quarter of it, 4 slots half used, 2 rows a step
    last = {"wall_s": 10.0, "trainer_wait_ratio": 0.25, "bubble_ratio": 0.5, "mean_active_batch": 2.0}
    u = Utilization.resumed(100.0, 4, last)  # resumed at t = 100 on the new process's clock
    assert (u.trainer_busy, u.slot_time, u.engine_busy) == (7.5, 20.0, 10.0)
    u.trainer_busy += 2.0  # the first step after the resume: 2 s, the trainer busy all of it,
    u.slot_time += 8.0  # every slot busy
    u.engine_busy += 2.0
    t = u.snapshot(102.0)
    assert t["wall_s"] == pytest.approx(12.0)  # not 2: the clock went on
    assert t["step_s"] == pytest.approx(2.0)  # the window starts at the resume, not at the run's start
    assert t["trainer_wait_ratio"] == pytest.approx(1 - 9.5 / 12)
    assert t["bubble_ratio"] == pytest.approx(1 - 28.0 / (4 * 12))
    assert t["step_trainer_wait_ratio"] == pytest.approx(0.0) and t["step_bubble_ratio"] == pytest.approx(0.0)
    assert t["mean_active_batch"] == pytest.approx(28.0 / 12.0)


def test_a_fresh_start_counts_from_now():
    t = Utilization.resumed(5.0, 2, None).snapshot(6.0)
    assert t["wall_s"] == pytest.approx(1.0) and t["step_s"] == pytest.approx(1.0)
