"""Staying alive in every overlap mode with two engines: an engine, then the trainer, killed (SIGKILL)
mid-run; the run finishes exact (tests/runtime/test_recovery.py's check, against the journal). The
scheduler side of a lost engine is property-tested over every mode in tests/flow/test_modes.py; this is
the same through real processes, where partial mode's resumed samples (their tokens so far, under a
newer version) are among those a dead engine held."""

import os
import signal
import time

import pytest

from tailrace.records import Mark, read_events
from tests.runtime.conftest import TINY_RUN, assert_exact, recoveries, start_cli, wait_for_steps, workers_of
from tests.runtime.test_faults import finish

pytestmark = pytest.mark.slow

STEPS = 5
# one mode in the default suite (each takes ~20 s); all of them with TAILRACE_ALL_MODES=1
ALL = os.environ.get("TAILRACE_ALL_MODES") == "1"
MODES = [
    pytest.param("partial"),
    *(
        pytest.param(m, marks=pytest.mark.skipif(not ALL, reason="set TAILRACE_ALL_MODES=1"))
        for m in ("pipe", "async", "multiversion")
    ),
]


def wait_for_recovery(run_dir, proc, worker, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        if (run_dir / "events.jsonl").exists() and any(
            m.data["worker"] == worker for m in recoveries(run_dir)
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"no recovery of {worker} within {timeout} s")


@pytest.mark.parametrize("mode", MODES)
def test_an_engine_and_the_trainer_lost_in_each_mode_with_two_engines(mode, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, f"--flow.steps={STEPS}",
        f"--flow.mode={mode}", "--rollout.engines=2", "--eval.n=4", "--flow.checkpoint_every=2",
        "--train.loss.kl_coef=0.01",
    )  # fmt: skip
    try:
        wait_for_steps(run_dir, p, 1)
        trainer, _, engine1 = workers_of(p.pid)
        os.kill(engine1, signal.SIGKILL)
        wait_for_recovery(run_dir, p, "engine1")
        wait_for_steps(run_dir, p, 3)
        os.kill(workers_of(p.pid)[0], signal.SIGKILL)
        rc, out = finish(p, timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert rc == 0, out
    assert "Traceback" not in out
    got = sorted((m.data["worker"], m.data["cause"]) for m in recoveries(run_dir))
    assert got == [("engine1", "died"), ("trainer", "died")], out
    lost = [
        m for m in read_events(run_dir / "events.jsonl") if isinstance(m, Mark) and m.kind == "engine_lost"
    ]
    assert [m.data["engine"] for m in lost] == [1]
    assert_exact(run_dir, STEPS)
