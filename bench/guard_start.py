"""What starting a reward worker costs by each way `RewardGuard` starts it: forked (no other thread runs
in the caller: a run's first guard) against spawned (another thread runs: a policy joining a running
run, a worker replaced mid-run). A guard's start and its first score, taking turns, in one process.

    .venv/bin/python bench/guard_start.py --starts 15
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from tailrace.tasks.guard import RewardGuard
from tailrace.tasks.registry import make_task


def start(task, example) -> tuple[float, str]:
    """(seconds to start a guard and score one response, how its worker was started)."""
    t0 = time.perf_counter()
    with RewardGuard(task) as g:
        g.score(example, "0")
        return time.perf_counter() - t0, g._proc._start_method


def beside_a_thread(task, example) -> tuple[float, str]:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        return start(task, example)
    finally:
        stop.set()
        other.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, default=15)
    a = p.parse_args()
    task = make_task("chainsum", None)
    example = task.examples("test", 1)[0]
    start(task, example), beside_a_thread(task, example)  # warm both paths
    times: dict[str, list[float]] = {"fork": [], "spawn": []}
    for _ in range(a.starts):
        for run in (start, beside_a_thread):
            s, method = run(task, example)
            times[method].append(s)
    for k, v in times.items():
        print(
            f"{k:6s} median {statistics.median(v) * 1e3:6.1f} ms  min {min(v) * 1e3:6.1f}  ({len(v)} starts)"
        )
    print(
        f"spawn / fork: {statistics.median(times['spawn']) / statistics.median(times['fork']):.2f}x a start"
    )


if __name__ == "__main__":
    main()
