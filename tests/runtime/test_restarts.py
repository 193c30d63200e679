"""The restart budget, the recovery record, and the train orders a replacement trainer redoes."""

from tailrace.flow.commands import Train
from tailrace.runtime.health import Lost
from tailrace.runtime.messages import TrainOrder
from tailrace.runtime.orders import TrainOrders
from tailrace.runtime.recovery import WINDOW_S, Recovery, describe, weights_on_disk

DIED = Lost("engine0", "died", "engine0 process died (killed by SIGKILL: out of memory?)")


def test_restarts_are_bounded_per_worker_within_the_window():
    r = Recovery(max_restarts=2)
    for t in (0.0, 10.0):
        assert r.allows(DIED, t)
        r.begin(DIED, t, requeued=3)
    assert not r.allows(DIED, 20.0)
    assert r.allows(Lost("trainer", "died", "trainer process died"), 20.0)  # each worker its own
    assert "max_restarts=2" in r.refusal(DIED) and DIED.line in r.refusal(DIED)
    assert r.allows(DIED, WINDOW_S + 1.0)  # the first restart left the window


def test_no_restarts_is_the_plain_fault_line():
    r = Recovery(max_restarts=0)
    assert not r.allows(DIED, 0.0)
    assert r.refusal(DIED) == DIED.line


def test_the_recovery_mark_counts_from_the_first_loss_until_ready():
    r = Recovery(max_restarts=3)
    r.begin(DIED, 5.0, requeued=4)
    r.begin(DIED, 7.0, requeued=0)  # the replacement died while starting
    assert r.ready("trainer", 8.0) is None  # not restarting
    m = r.ready("engine0", 9.5)
    assert m.kind == "recovery"
    assert m.data | {"detail": ""} == {"worker": "engine0", "cause": "died", "detail": "", "downtime_s": 4.5,
                                       "requeued": 4, "replayed": 0, "restarts": 2}  # fmt: skip
    assert describe(m).startswith("recovered: engine0 process died") and "4 samples requeued" in describe(m)


def order(step, save=None):
    return TrainOrder(Train(step, (), step, step + 1), save)


def test_a_replacement_trainer_replays_the_counted_steps_then_the_owed_ones_in_order():
    orders = TrainOrders()
    for s in range(5):
        assert orders.add(order(s, save=f"step_{s + 1}.tmp")) is not None
    orders.checkpointed(2)  # a checkpoint after 2 steps
    assert orders.restart(steps_done=4) == 2  # steps 2, 3 counted: replayed; step 4 owed
    assert orders.add(order(5)) is None  # waits behind them while the replacement starts
    sent = orders.ready()
    assert [(o.train.step, o.replay, o.save_dir) for o in sent] == [
        (2, True, None), (3, True, None), (4, False, "step_5.tmp"), (5, False, None),
    ]  # fmt: skip
    assert orders.ready() == [] and orders.add(order(6)) is not None


def test_a_replacement_engine_finds_each_version_in_the_ring_or_a_kept_checkpoint(tmp_path):
    kept = tmp_path / "step_000004"
    kept.mkdir()
    saved = {3: kept, 2: tmp_path / "step_000003"}  # step 3's checkpoint was pruned
    disk, missing = weights_on_disk([0, 2, 3, 5], in_ring=lambda v: v == 5, saved=saved)
    assert disk == {3: kept} and missing == [2]
