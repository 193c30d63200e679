"""Policies joining and leaving a running `tailrace train` (runtime/policy_join.py): a LoRA run started
with one named policy and room for three; `tailrace policy join` adds a second (its own task seed, mode
and step count) while the first trains, `tailrace policy leave` stops the first after its next step.
Both train the steps they issued once each, with exact ledgers; the joiner has its base and final
evaluations, its checkpoints (adapter in PEFT's files) under policies/NAME/; config.yaml names it, so a
resume of the killed run brings both back."""

import json
import os
import signal

import pytest

from tailrace.records import Finished, read_journal
from tests.runtime.conftest import TINY_RUN, run_cli, start_cli
from tests.runtime.test_join_e2e import mark, wait_until
from tests.runtime.test_lora_e2e import LORA

pytestmark = pytest.mark.slow


def records(d, kind):
    lines = (d / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def exact(d, n_steps):
    st = records(d, "step")
    assert [r["step"] for r in st] == list(range(n_steps))
    for r in st:
        led = r["ledger"]
        assert led["produced"] == led["trained"] + led["in_store"] + sum(led["discarded"].values())
    # every sample finished once (the journal: cut back to the checkpoint a resume starts from)
    keys = [(e.trajectory.group, e.trajectory.sample_index) for e in read_journal(d / "journal.jsonl")
            if isinstance(e, Finished)]  # fmt: skip
    assert len(keys) == len(set(keys)) >= st[-1]["ledger"]["trained"]


def test_a_policy_joins_a_running_lora_run_and_another_leaves(tiny_model, tmp_path, digits, capsys):
    """Refusals first (a bad entry before it reaches the run; the run's own checks; a joiner whose
    trainer is stopped (SIGSTOP) as soon as it exists, so it never says Ready and is withdrawn), then a
    join and a leave."""
    import time

    from tests.runtime.conftest import run as cli
    from tests.runtime.conftest import workers_of

    run = tmp_path / "run"
    train = start_cli(
        "train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits,
        "--flow.steps=400", "--flow.mode=sync", "--policies=[{name: main}]", "--max_policies=3",
        "--worker_timeout_s=3",
    )  # fmt: skip
    try:
        wait_until(lambda: (run / "join.json").exists(), train, "join desk")
        # what the run cannot take is refused in one line, before or after it reaches the run
        for flags, why in (
            (["solver", "--train.lora.rank=8"], "train.lora"),
            (["main"], "unique"),
            (["solver", "--flow.max_staleness=4"], "--flow.max_staleness=1"),  # the run's
            (["agent", "--flow.mode=external"], "agent endpoint"),
        ):
            rc, out = cli(capsys, "policy", "join", str(run), *flags)
            assert rc == 2 and why in out, out
        before = set(workers_of(train.pid))
        join = start_cli("policy", "join", str(run), "solver", "--flow.steps=2")
        stopped, deadline = None, time.time() + 60
        while stopped is None and time.time() < deadline:
            new = [p for p in workers_of(train.pid) if p not in before]
            if new:
                stopped = new[0]
                os.kill(stopped, signal.SIGSTOP)
            time.sleep(0.005)
        assert stopped is not None, "no trainer started for the joiner"
        out, _ = join.communicate(timeout=120)
        assert join.returncode == 2 and "its trainer did not start" in out, out
        assert "solver" not in (run / "config.yaml").read_text()
        rc, out = cli(capsys, "policy", "join", str(run), "solver", "--task.name=chainsum", "--flow.mode=pipe",
                      "--flow.steps=3")  # fmt: skip
        assert rc == 0 and "policy solver joined as policy 2 of 3" in out, out
        # chainsum's prompts are longer than the run's digits: the engines were sized for shorter requests
        assert "the engines' KV memory was sized for" in out
        wait_until(lambda: records(run / "policies" / "solver", "step"), train, "the joiner's first step")
        rc, out = cli(capsys, "policy", "leave", str(run), "main")
        assert rc == 0 and "leaves after its next step" in out, out
        out, _ = train.communicate(timeout=300)
        assert train.returncode == 0, out[-3000:]
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    main, solver = run / "policies" / "main", run / "policies" / "solver"
    n_main = len(records(main, "step"))
    assert 1 <= n_main < 400
    exact(main, n_main)
    exact(solver, 3)
    for d, n in ((main, n_main), (solver, 3)):
        assert {r["tag"] for r in records(d, "eval")} == {"base", "final"}
        assert (d / "checkpoints" / f"step_{n:06d}" / "adapter" / "adapter_model.safetensors").is_file()
    (joined,) = mark(run, "policy_join")
    assert joined["policy"] == "solver" and 0 < joined["clock_s"] <= joined["t"]
    # the comparison puts the joiner on the run's clock, from where its own starts
    from tailrace.report.compare import Run, write_comparison

    assert Run.read(main).joined_s == 0.0 and Run.read(solver).joined_s == joined["clock_s"]
    page = write_comparison([main, solver], tmp_path / "compare.html").read_text()
    assert f"<td>solver</td><td>{joined['clock_s']:.1f}</td>" in page
    # staleness, endpoint, the stopped trainer (the others never reached the run)
    assert [m["policy"] for m in mark(run, "policy_join_refused")] == ["solver", "agent", "solver"]
    assert [
        p["name"] for p in __import__("yaml").safe_load((run / "config.yaml").read_text())["policies"]
    ] == [
        "main",
        "solver",
    ]
    assert "solver: held-out accuracy" in out


def test_a_run_a_policy_joined_resumes_with_it(tiny_model, tmp_path, digits):
    run = tmp_path / "run"
    argv = ["train", f"--model.path={tiny_model}", *TINY_RUN, *LORA, digits, "--flow.mode=sync"]
    train = start_cli(
        *argv, f"--run-dir={run}", "--flow.steps=16", "--policies=[{name: main}]", "--max_policies=2"
    )
    try:
        wait_until(lambda: (run / "join.json").exists(), train, "join desk")
        joined = run_cli("policy", "join", str(run), "solver", "--task.seed=3", "--flow.steps=6", timeout=300)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        full = run / "policies" / "solver" / "checkpoints" / "step_000002"
        wait_until(lambda: full.is_dir(), train, "the joiner's second checkpoint")
        os.killpg(train.pid, signal.SIGKILL)
        train.wait(timeout=30)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    resumed = run_cli("train", "--resume", str(run), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    exact(run / "policies" / "main", 16)
    exact(run / "policies" / "solver", 6)
    assert "solver: held-out accuracy" in resumed.stdout
