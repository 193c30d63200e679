"""A tenant joining a running LoRA service (`tailrace policy join`) against the same tenant started as a
run of its own (`tailrace train`), side by side in one invocation (issue #19: tenants join and leave a
running service).

    .venv/bin/python bench/policy_join.py                # 3 repeats, ~4 min
    .venv/bin/python bench/policy_join.py --repeats 1    # a smoke run
    .venv/bin/python bench/policy_join.py --repeats 1 --steps 3 --warm 2 --set=--model.path=DIR \
        --set=--flow.prompts_per_round=4 --set=--flow.samples_per_prompt=4 --set=--flow.train_batch=16 \
        --set=--rollout.max_new_tokens=64

The service: `tailrace train` on the default model and task with a rank-8 LoRA adapter, one named
policy ("main", `--mode`, many steps) and room for more (`max_policies=4`). Once it has done
`--warm` steps, the tenant joins it (`policy join service tenant --task.seed=7 --flow.steps=N`); then
it leaves (`policy leave service main`) and the service ends when the tenant has done its steps. The
tenant alone: the same config as a run of its own (its policy section on top of the run's), started
from a shell the same way. Each repeat runs both, in turn.

Figures, wall clock from the command (the join asked, or the run started): until the command answers
(the join: its trainer started and its base weights evaluated), until the tenant's first step record,
and until its last; and main's seconds per step over its last 5 steps before the join and over the
tenant's steps (the engines and the trainer cores shared). Writes bench/out/policy_join.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="the tenant's steps")
    p.add_argument("--warm", type=int, default=6, help="main's steps before the tenant joins")
    p.add_argument("--mode", default="sync")
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument(
        "--set", action="append", default=[], help="a run flag for both arms, e.g. --set=--model.path=DIR"
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "policy_join.json"))
    return p.parse_args(argv)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tailrace.cli", *args]


def steps(path: Path) -> list[dict]:
    """The step records written so far (a line being written is left for later)."""
    if not path.is_file():
        return []
    text = path.read_text()
    recs = [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]
    return [r for r in recs if r["kind"] == "step"]


class Clock:
    """When each step record of the watched metrics files appeared (polled every POLL_S)."""

    def __init__(self) -> None:
        self.seen: dict[Path, list[float]] = {}

    def watch(self, path: Path) -> None:
        self.seen.setdefault(path, [])

    def wait(self, path: Path, n: int, proc: subprocess.Popen, timeout: float = 900) -> float:
        """Until `path` holds `n` step records: the wall clock then."""
        self.watch(path)
        end = time.time() + timeout
        while time.time() < end:
            now = time.time()
            for p, times in self.seen.items():
                times.extend([now] * (len(steps(p)) - len(times)))
            if len(self.seen[path]) >= n:
                return self.seen[path][n - 1]
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before {n} steps in {path}: {proc.stdout.read()[-2000:]}")
            time.sleep(POLL_S)
        raise RuntimeError(f"no {n} steps in {path} within {timeout} s")


def common(a) -> list[str]:
    return [
        "--train.lora.rank=8",
        f"--eval.n={a.eval_n}",
        f"--flow.mode={a.mode}",
        "--rollout.threads=1",
        *a.set,
    ]


def tenant_flags(a) -> list[str]:
    return ["--task.seed=7", f"--flow.steps={a.steps}"]


def joined(a, out: Path) -> dict:
    """The service with main, the tenant joining it after `a.warm` of main's steps."""
    run = out / "service"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    svc = subprocess.Popen(
        cli("train", f"--run-dir={run}", *common(a), "--flow.steps=100000", "--policies=[{name: main}]",
            "--max_policies=4"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    clock = Clock()
    try:
        main_m = run / "policies" / "main" / "metrics.jsonl"
        clock.wait(main_m, a.warm, svc)
        before = len(steps(main_m))
        t0 = time.time()
        r = subprocess.run(cli("policy", "join", str(run), "tenant", *tenant_flags(a)), capture_output=True,
                           text=True, env=env)  # fmt: skip
        answered = time.time()
        if r.returncode:
            raise RuntimeError(f"join refused: {r.stdout}{r.stderr}")
        t_m = run / "policies" / "tenant" / "metrics.jsonl"
        first = clock.wait(t_m, 1, svc)
        last = clock.wait(t_m, a.steps, svc)
        subprocess.run(cli("policy", "leave", str(run), "main"), capture_output=True, env=env)
        svc.communicate(timeout=900)
    finally:
        if svc.poll() is None:
            os.killpg(svc.pid, signal.SIGKILL)
    ms = steps(main_m)
    pre = [s["time"]["step_s"] for s in ms[max(0, before - 5) : before]]
    t_wall = [s["time"]["wall_s"] for s in steps(t_m)]
    # main's steps that appeared while the tenant did its steps after its first (both training)
    beside = sum(first < t <= last for t in clock.seen[main_m])
    return {
        "main_steps_beside": beside,
        "answer_s": answered - t0,
        "first_step_s": first - t0,
        "done_s": last - t0,
        "tenant_steps_s": t_wall[-1] - t_wall[0],
        "main_step_s_before": statistics.mean(pre),
        "main_step_s_during": (last - first) / beside if beside else None,
    }


def alone(a, out: Path) -> dict:
    """The tenant as a run of its own."""
    run = out / "alone"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen(
        cli("train", f"--run-dir={run}", *common(a), *tenant_flags(a)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        m = run / "metrics.jsonl"
        clock = Clock()
        first = clock.wait(m, 1, proc)
        last = clock.wait(m, a.steps, proc)
        proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    t_wall = [s["time"]["wall_s"] for s in steps(m)]
    return {"first_step_s": first - t0, "done_s": last - t0, "tenant_steps_s": t_wall[-1] - t_wall[0]}


def main(argv=None) -> int:
    a = parse_args(argv)
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"tailrace-policy-join-{os.getpid()}"
    rows = []
    for k in range(a.repeats):
        j = joined(a, base / f"r{k}")
        s = alone(a, base / f"r{k}")
        rows.append({"joined": j, "alone": s})
        print(
            f"repeat {k}: join answered {j['answer_s']:.1f} s, first step {j['first_step_s']:.1f} s, "
            f"{a.steps} steps {j['done_s']:.1f} s | alone: first step {s['first_step_s']:.1f} s, "
            f"{a.steps} steps {s['done_s']:.1f} s | main s/step {j['main_step_s_before']:.2f} before, "
            f"{j['main_step_s_during']:.2f} beside the tenant",
            flush=True,
        )

    def med(arm, key):
        return statistics.median(r[arm][key] for r in rows)

    for r in rows:  # the same work one after another: main's steps at its rate alone, then the tenant alone
        j = r["joined"]
        j["one_after_another_s"] = (
            j["main_steps_beside"] * j["main_step_s_before"] + r["alone"]["tenant_steps_s"]
        )
        j["together_x"] = j["one_after_another_s"] / j["tenant_steps_s"]

    print(f"\nmedian of {a.repeats} ({a.mode}, LoRA rank 8, the tenant's {a.steps} steps; load average "
          f"{os.getloadavg()[0]:.2f})")  # fmt: skip
    print("| tenant | answered s | first step s | last step s | its steps s |")
    print("|---|---|---|---|---|")
    print(f"| joins the service | {med('joined', 'answer_s'):.1f} | {med('joined', 'first_step_s'):.1f} | "
          f"{med('joined', 'done_s'):.1f} | {med('joined', 'tenant_steps_s'):.1f} |")  # fmt: skip
    print(f"| a run of its own | - | {med('alone', 'first_step_s'):.1f} | {med('alone', 'done_s'):.1f} | "
          f"{med('alone', 'tenant_steps_s'):.1f} |")  # fmt: skip
    print(f"first step: {med('alone', 'first_step_s') / med('joined', 'first_step_s'):.2f}x sooner joined; "
          f"main s/step {med('joined', 'main_step_s_before'):.2f} alone, "
          f"{med('joined', 'main_step_s_during'):.2f} beside the tenant")  # fmt: skip
    print(f"while both trained: main {med('joined', 'main_steps_beside'):.0f} steps and the tenant {a.steps - 1} in "
          f"{med('joined', 'tenant_steps_s'):.1f} s, {med('joined', 'together_x'):.2f}x faster than the same "
          "steps one after another (main at its rate alone, then the tenant alone)")  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
