"""`metrics.utilization`, the time figures of a step record, on hand-checked windows."""

import pytest

from tailrace.metrics import utilization


def test_the_ratios_of_a_hand_checked_window():
    # 10 s since the start, 4 slots: 20 slot-seconds used of 40; the trainer busy 6 s; the last 2 s
    # (since the previous record) used 6 of 8 slot-seconds
    u = utilization(0.0, (10.0, 6.0, 20.0, 500, 300), (8.0, 5.0, 14.0, 400, 200), 4, 8.0)
    assert u["wall_s"] == 10.0 and u["step_s"] == 2.0
    assert u["trainer_wait_ratio"] == pytest.approx(0.4) and u["bubble_ratio"] == pytest.approx(0.5)
    assert u["step_bubble_ratio"] == pytest.approx(0.25) and u["mean_active_batch"] == pytest.approx(2.5)
    assert u["gen_tok_s"] == 50.0 and u["train_tok_s"] == 50.0


def test_a_step_recorded_while_the_job_has_no_engine_is_all_bubble():
    """Every engine left the job (they may join again later) when a step's record was written: no slot
    is available, so none is used; before, this divided by zero and ended the run."""
    u = utilization(0.0, (10.0, 6.0, 20.0, 500, 300), (8.0, 5.0, 14.0, 400, 200), 0, 8.0)
    assert u["bubble_ratio"] == 1.0 and u["step_bubble_ratio"] == 1.0
