"""Staying alive: workers killed (SIGKILL) or stopped (SIGSTOP) mid-run are replaced and the run
finishes with exit 0, every step once, every finished trajectory once, the ledger exact, and a
`recovery` event each. (`max_restarts=0` keeps the one-line fault: tests/runtime/test_faults.py; a
stopped worker is found by the same heartbeat check with or without restarts.)"""

import json
import os
import signal

import pytest

from tailrace.records import read_metrics
from tailrace.report.html import write_report
from tests.runtime.conftest import (
    TINY_RUN,
    assert_exact,
    checkpoints,
    recoveries,
    start_cli,
    wait_for_steps,
    workers_of,
)
from tests.runtime.test_faults import finish

pytestmark = pytest.mark.slow

STEPS = 6


def test_lost_workers_are_replaced_and_the_run_finishes_exact(tiny_model, tmp_path):
    """One run, two losses (one run keeps the suite short): the engine stopped (found stuck after
    worker_timeout_s and killed), then the trainer killed once step 4 is recorded, after its checkpoint
    of step 3, so its replacement replays step 4 (and step 5, when the trainer had it done before the
    kill landed: it trains ahead of the records, and step 6 once was done and checkpointed before a kill
    sent at 5 records, so nothing was replayed). The KL penalty makes every step move
    the optimizer, so a step applied twice or skipped would show in the step count."""
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, f"--flow.steps={STEPS}",
        "--eval.n=8", "--worker_timeout_s=3", "--flow.checkpoint_every=3", "--train.loss.kl_coef=0.01",
    )  # fmt: skip
    wait_for_steps(run_dir, p, 2)
    trainer, engine = workers_of(p.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        wait_for_steps(run_dir, p, 4)
        os.kill(trainer, signal.SIGKILL)
        rc, out = finish(p, timeout=120)
    finally:
        if os.path.exists(f"/proc/{engine}"):
            os.kill(engine, signal.SIGKILL)
    assert rc == 0, out
    assert "Traceback" not in out
    got = [(m.data["worker"], m.data["cause"]) for m in recoveries(run_dir)]
    assert got == [("engine0", "stuck"), ("trainer", "died")]
    assert "engine0 process is stuck: no heartbeat for" in recoveries(run_dir)[0].data["detail"]
    assert out.count("recovered: ") == 2
    assert recoveries(run_dir)[-1].data["replayed"] in (1, 2)  # step 4 (and 5), after the checkpoint of 3
    assert_exact(run_dir, STEPS)
    assert json.loads((checkpoints(run_dir)[-1] / "trainer.json").read_text())["step"] == STEPS
    assert "2 workers replaced" in write_report(run_dir).read_text()


def test_a_trainer_lost_during_the_final_evaluation_is_recorded(tiny_model, tmp_path):
    """After the last step the driver evaluates with the engines only; a trainer lost then is still
    replaced, and its recovery is written before the run ends (it used to be left unheard)."""
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=2",
        "--eval.n=64", "--eval.max_new_tokens=64",
    )  # fmt: skip
    wait_for_steps(run_dir, p, 2)  # the last step: the final checkpoint and evaluation follow
    os.kill(workers_of(p.pid)[0], signal.SIGKILL)
    rc, out = finish(p, timeout=120)
    assert rc == 0, out
    assert [r.tag for r in read_metrics(run_dir / "metrics.jsonl") if type(r).__name__ == "EvalRecord"] == [
        "base", "final",
    ]  # fmt: skip
    got = [(m.data["worker"], m.data["cause"], m.data["replayed"]) for m in recoveries(run_dir)]
    assert got == [("trainer", "died", 0)], out
    assert "recovered: trainer process died" in out
