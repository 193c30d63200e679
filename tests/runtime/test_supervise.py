"""`tailrace train --supervise`: a driver that dies of a fault is resumed from its run directory, and
the run ends exact; bad input and Ctrl-C are not restarted."""

import os
import signal
import time
from pathlib import Path

import pytest

from tailrace.runtime.recovery import describe
from tailrace.runtime.supervisor import LOST_ENV, DriverLost, finished, lost_driver
from tests.runtime.conftest import TINY_RUN, assert_exact, recoveries, start_cli, wait_for_steps
from tests.runtime.test_faults import finish

STEPS = 5


def children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def stop(p) -> None:
    """Kill what is left of a supervised run: the supervisor's group and its driver's (a session of
    its own)."""
    for pid in [*children(p.pid), p.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_the_driver(p, run_dir: Path, steps: int, timeout: float = 180) -> tuple[int, str]:
    """Kill supervised run `p`'s driver with -9 once `run_dir` holds `steps` step records; the
    supervisor's exit code and output (what is left of the run is killed either way)."""
    try:
        wait_for_steps(run_dir, p, steps)
        (driver,) = children(p.pid)
        os.kill(driver, signal.SIGKILL)
        return finish(p, timeout=timeout)
    finally:
        stop(p)


def assert_resumed_once(out: str, run_dir: Path) -> None:
    """The supervisor's only line: the killed driver resumed, its first restart."""
    assert [line for line in out.splitlines() if line.startswith("supervisor: ")] == [
        f"supervisor: the driver process died (killed by SIGKILL: out of memory?); resuming it from {run_dir} "
        "(restart 1 of at most 3 within the hour)"
    ], out


def test_only_faults_are_restarted():
    assert lost_driver(-signal.SIGKILL).line == "the driver process died (killed by SIGKILL: out of memory?)"
    assert lost_driver(-signal.SIGSEGV).cause == "died"
    assert lost_driver(3).cause == "fault"
    for rc in (0, 1, 2, 130, 143):  # done, a bug (a traceback: restarting repeats it), input, signals
        assert lost_driver(rc) is None


@pytest.mark.slow
def test_a_driver_dead_after_the_final_evaluation_is_not_resumed(finished_run, unfinished_run, tmp_path):
    """--resume refuses a finished run (exit 2): the supervisor ends such a run with 0 instead."""
    assert finished(finished_run)
    assert not finished(unfinished_run) and not finished(tmp_path)


@pytest.mark.slow
def test_a_killed_driver_is_resumed_and_the_run_ends_exact(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", "--supervise", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN,
        f"--flow.steps={STEPS}", "--eval.n=4", "--train.loss.kl_coef=0.01",
    )  # fmt: skip
    rc, out = kill_the_driver(p, run_dir, 2)
    assert rc == 0, out
    assert "Traceback" not in out
    assert_resumed_once(out, run_dir)
    (m,) = recoveries(run_dir)
    assert (m.data["worker"], m.data["cause"], m.data["restarts"]) == ("driver", "died", 1)
    assert m.data["downtime_s"] > 0
    assert "recovered: the driver process died" in out
    assert_exact(run_dir, STEPS)


def test_bad_input_is_not_restarted(tmp_path, capfd):
    from tailrace.cli import main

    assert main(["train", "--supervise", f"--run-dir={tmp_path / 'run'}", "--rollout.top_k=-5"]) == 2
    out = capfd.readouterr()
    assert "rollout.top_k=-5" in out.out + out.err and "supervisor" not in out.out + out.err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sigterm_to_the_supervisor_stops_the_driver_without_a_restart(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    p = start_cli(
        "train", "--supervise", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN,
        "--flow.steps=50", "--eval.n=4",
    )  # fmt: skip
    try:
        wait_for_steps(run_dir, p, 2)  # the first step's checkpoint is whole by then
        p.send_signal(signal.SIGTERM)
        rc, out = finish(p, timeout=60)
    finally:
        stop(p)
    assert rc == 143, out
    assert "supervisor:" not in out and "Traceback" not in out
    assert f"continue with tailrace train --resume {run_dir}" in out
    assert recoveries(run_dir) == []


def test_the_resumed_driver_records_its_predecessors_loss(monkeypatch):
    gone = DriverLost(
        "died", lost_driver(-signal.SIGKILL).line, time.time() - 4.0, steps_recorded=7, restarts=2
    )
    monkeypatch.setenv(LOST_ENV, gone.to_env())
    m = DriverLost.from_env().mark(1.5, steps_done=5)
    assert (m.t, m.kind) == (1.5, "recovery")
    assert m.data["worker"] == "driver" and m.data["replayed"] == 2 and m.data["restarts"] == 2
    assert 4.0 <= m.data["downtime_s"] < 10
    assert describe(m).startswith("recovered: the driver process died (killed by SIGKILL")
    assert describe(m).endswith("resumed from its last checkpoint, 2 steps redone")
    monkeypatch.delenv(LOST_ENV)
    assert DriverLost.from_env() is None
