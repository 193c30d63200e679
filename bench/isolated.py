"""What a Python tool call costs by each way `run_isolated` starts its child: forked from the caller
(a process with no other thread) against forked by the fork server (the driver, whose tool threads run
beside its loop). The same `py` tool call, taking turns, in one process.

    .venv/bin/python bench/isolated.py --calls 30
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from tailrace.runtime.procs import start_fork_server
from tailrace.tasks.sandbox import SandboxConfig
from tailrace.tasks.sandbox.isolated import may_fork, run_isolated
from tailrace.tasks.tools import _run_snippet


def call() -> tuple[float, bool]:
    """(seconds of one tool call, whether its child was forked from this process)."""
    forked = may_fork()
    t0 = time.perf_counter()
    got = run_isolated(_run_snippet, ("print(6 * 7)",), SandboxConfig(cpu_s=2), 5.0)
    assert got == {"stdout": "42\n", "error": None}, got
    return time.perf_counter() - t0, forked


def in_thread() -> tuple[float, bool]:
    out: list[tuple[float, bool]] = []
    t = threading.Thread(target=lambda: out.append(call()))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args()
    start_fork_server()  # as the driver does at its start
    call(), in_thread()  # warm both paths (the fork server's first fork imports the tool's module)
    times: dict[str, list[float]] = {"forked": [], "fork server": []}
    for _ in range(a.calls):
        for run in (call, in_thread):
            s, forked = run()
            times["forked" if forked else "fork server"].append(s)
    fork, server = (statistics.median(times[k]) for k in ("forked", "fork server"))
    for k, v in times.items():
        print(
            f"{k:12s} median {statistics.median(v) * 1e3:6.1f} ms  min {min(v) * 1e3:6.1f}  ({len(v)} calls)"
        )
    print(f"fork server / forked: {server / fork:.2f}x a call")


if __name__ == "__main__":
    main()
