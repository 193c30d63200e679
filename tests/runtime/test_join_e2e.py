"""Engines joining and leaving a real run (runtime/join.py): `tailrace engine join RUN_DIR` starts an
engine process that joins the running `tailrace train`; `tailrace engine leave RUN_DIR 0` removes the
run's own engine; SIGTERM makes the joined one leave, so the run has no engine at all until a third
joins; that one is killed (-9) and removed, and a fourth works until the test ends the run (SIGTERM:
a run of fixed length raced the joiners' starts) and is let go. The ledger is exact at every step
record, and no (group, sample) is trained twice."""

import json
import os
import signal
import stat
import threading
import time

import pytest

from tests.runtime.conftest import TINY_RUN, run_cli, start_cli

pytestmark = pytest.mark.slow


def events(run_dir):
    """The run's events so far: the line the driver is writing, not yet whole, is left for later."""
    f = run_dir / "events.jsonl"
    if not f.exists():
        return []
    text = f.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def wait_until(cond, proc, what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-3000:]}"
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def worked(run_dir, engine):
    """Engine `engine` has generated (a busy span in its lane)."""
    return any(e.get("lane") == f"engine{engine}" and e.get("phase") == "generate" for e in events(run_dir))


def mark(run_dir, kind):
    return [e for e in events(run_dir) if e.get("kind") == kind]


def test_engines_join_and_leave_a_running_job(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    train = start_cli(
        "train", f"--run-dir={run_dir}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=2000",
        "--max_restarts=0", "--flow.mode=sync",
    )  # fmt: skip
    joined = []
    try:
        wait_until(lambda: (run_dir / "join.json").exists(), train, "join desk")
        assert stat.S_IMODE((run_dir / "join.key").stat().st_mode) == 0o600
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 1), train, "work on the joined engine 1")
        leave = run_cli("engine", "leave", str(run_dir), "0", timeout=60)
        assert leave.returncode == 0, leave.stdout + leave.stderr
        wait_until(lambda: mark(run_dir, "engine_leave"), train, "engine 0 leaving")
        os.kill(joined[0].pid, signal.SIGTERM)  # engine 1 leaves too: the job has no engine now
        wait_until(lambda: len(mark(run_dir, "engine_leave")) == 2, train, "engine 1 leaving")
        assert joined[0].wait(timeout=30) == 0
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 2), train, "work on the joined engine 2")
        os.kill(joined[1].pid, signal.SIGKILL)  # a joined engine that dies leaves (max_restarts=0 or not)
        wait_until(lambda: len(mark(run_dir, "engine_leave")) == 3, train, "engine 2 removed")
        joined.append(start_cli("engine", "join", str(run_dir)))
        wait_until(lambda: worked(run_dir, 3), train, "work on the joined engine 3")
        os.kill(train.pid, signal.SIGTERM)
        out, _ = train.communicate(timeout=180)
        assert train.returncode == 143, out[-3000:]
        assert joined[2].wait(timeout=30) == 0  # told to shut down when the run ended
    finally:
        for p in [train, *joined]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert not (run_dir / "join.json").exists() and not (run_dir / "join.key").exists()
    leaves = {m["engine"]: m for m in mark(run_dir, "engine_leave")}
    assert set(leaves) == {0, 1, 2} and "died" in leaves[2]["why"]
    assert [m["engine"] for m in mark(run_dir, "engine_join")] == [1, 2, 3]
    seen = [(e.get("kind"), e.get("engine")) for e in events(run_dir)]  # (spans have no kind)
    for eid in (1, 2, 3):  # a joiner is asked to load only once it is up: no load crosses its start
        ready = seen.index(("engine_ready", eid))
        assert seen.index(("loaded", eid)) > ready and ("load_missed", eid) not in seen
    assert_exact(run_dir)


def read_until(proc, text, timeout=120):
    """`proc`'s output up to and with its first line holding `text` (the rest is left to read)."""
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if text in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert lines and text in lines[-1], f"no {text!r} within {timeout} s: {''.join(lines)[-3000:]}"
    return "".join(lines)


def assert_exact(run_dir, n_steps=None):
    """The run wrote its `n_steps` step records (a run the test stopped: some), the ledger exact at
    each, and no (group, sample) was trained twice. A step the stop cut short (issued, never recorded)
    is not counted: a resumed run issues it again from its checkpoint."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert steps and (n_steps is None or len(steps) == n_steps)
    for r in steps:  # produced = trained + in_store + discarded, at every step
        led = r["ledger"]
        assert led["produced"] == led["trained"] + led["in_store"] + sum(led["discarded"].values())
    recorded = {r["step"] for r in steps}
    trained = [
        (g, i) for m in mark(run_dir, "train_issued") if m["step"] in recorded
        for g, s in zip(m["groups"], m["samples"]) for i in s
    ]  # fmt: skip
    assert len(trained) == len(set(trained)) == steps[-1]["ledger"]["trained"]


def test_joining_or_leaving_no_running_job_is_one_line(capsys, tmp_path):
    from tests.runtime.conftest import one_line, run

    rc, out = run(capsys, "engine", "join", str(tmp_path))
    assert rc == 2 and "no running job there" in one_line(out)
    rc, out = run(capsys, "engine", "leave", str(tmp_path), "x")
    assert rc == 2 and "ENGINE_ID" in one_line(out)
    rc, out = run(capsys, "policy", "leave", str(tmp_path), "x")
    assert rc == 2 and "no running job there" in one_line(out)
    rc, out = run(capsys, "policy", "join", str(tmp_path), "x")
    assert rc == 2 and "no config.yaml there" in one_line(out)
    (tmp_path / "config.yaml").write_text("flow: {steps: 3}\n")  # a run of one unnamed policy: no room
    rc, out = run(capsys, "policy", "join", str(tmp_path), "x", "--task.seed=2")
    assert rc == 2 and "no room for another policy" in one_line(out) and "--max_policies=4" in one_line(out)
    rc, out = run(capsys, "policy", "join", str(tmp_path))
    assert rc == 2 and "usage: tailrace policy join RUN_DIR NAME" in one_line(out)
