"""Chaos and soak: does a run stay alive, exact and flat while its workers are killed and stopped?

    .venv/bin/python bench/chaos.py                      # 200 steps: a clean run, then the chaos run
    .venv/bin/python bench/chaos.py --steps 40 --mean-gap 10   # a quick look
    .venv/bin/python bench/chaos.py --soak               # 500 steps, no faults: memory and journal growth
    .venv/bin/python bench/chaos.py -- --flow.mode=pipe  # anything after -- goes to `tailrace train`
    .venv/bin/python bench/chaos.py -- --flow.mode=multiversion --rollout.engines=2
    .venv/bin/python bench/chaos.py -- --supervise      # the driver is killed (kill -9) too

Both use the built-in default model and task (`tailrace train` defaults) with a smaller batch and
shorter responses (SMALL), so 200 steps fit minutes on two cores. Each run is a `tailrace train`
process of its own.

Chaos: a clean run, then the same config while, at exponential gaps (mean `--mean-gap` seconds,
seeded), a random worker (the trainer or an engine) gets SIGKILL (dies) or SIGSTOP (stuck: found by
its missed heartbeats after `worker_timeout_s`, then killed by the driver); under `-- --supervise` the
driver is among the victims (SIGKILL only: no heartbeat watches the driver). It prints each fault, the
failure count and rate, the recoveries the run recorded (events.jsonl), the ledger checked against
the journal (0 lost, 0 duplicated), and ETTR, the effective training time ratio: the clean run's
training wall time over the chaos run's (both from the last step record's `wall_s`, which starts once
the workers are up; the base and final evaluations are outside it).

Soak: one run without faults; every few seconds each process's RSS (/proc/PID/status) beside the steps
done; per process the slope of a least-squares line through the samples after the first 10% of steps
(start-up growth excluded), in MB per 100 steps, and the journal's bytes per step.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.records import Discarded, Finished, Mark, StepRecord, read_events, read_journal, read_metrics  # noqa: E402

SMALL = [
    "--flow.prompts_per_round=8", "--flow.samples_per_prompt=4", "--flow.train_batch=32",
    "--rollout.max_new_tokens=128", "--eval.n=64", "--eval.max_new_tokens=128",
]  # fmt: skip
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def start(run_dir: Path, steps: int, extra: list[str]) -> subprocess.Popen:
    """`tailrace train` in its own session; its output goes to RUN_DIR.log (a pipe nobody reads while
    the run goes would fill and block the run)."""
    argv = [sys.executable, "-m", "tailrace.cli", "train", f"--run-dir={run_dir}", f"--flow.steps={steps}"]
    with open(f"{run_dir}.log", "w") as log:
        return subprocess.Popen(
            [*argv, *SMALL, *extra], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200"),
            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip


def children(pid: int) -> dict[int, str]:
    """pid -> process name of `pid`'s children."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(d.name)] = (d / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
    return found


def workers(pid: int) -> dict[str, int]:
    """name -> pid of the driver's workers (they name themselves tr-trainer, tr-engine0, ...), among
    all its descendants: the workers are children of the fork server the driver starts, not its own."""
    found, todo = {}, [pid]
    while todo:
        for c, comm in children(todo.pop()).items():
            if comm.startswith("tr-"):
                found[comm.removeprefix("tr-")] = c
            todo.append(c)
    return found


def victims(pid: int, supervised: bool) -> dict[str, int]:
    """name -> pid of what may be hit: the workers, and under `--supervise` the driver too (the
    supervisor's one child; none while it restarts one)."""
    if not supervised:
        return workers(pid)
    drivers = list(children(pid))
    return {"driver": drivers[0], **workers(drivers[0])} if len(drivers) == 1 else {}


def steps_done(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return f.read_text().count('"kind":"step"') if f.exists() else 0


def wait(p: subprocess.Popen, run_dir: Path) -> None:
    if p.wait() != 0:
        raise SystemExit(
            f"the run failed (exit {p.returncode}):\n{Path(f'{run_dir}.log').read_text()[-3000:]}"
        )


def train_wall(run_dir: Path) -> float:
    """The last step record's `wall_s` (a resumed driver's clock goes on from its last step record,
    leaving out the time it was down: under `--supervise` ETTR is the whole processes' ratio)."""
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]
    return steps[-1].time["wall_s"]


# -- chaos ---------------------------------------------------------------------------------------


def chaos_run(run_dir: Path, steps: int, extra: list[str], mean_gap: float, seed: int) -> list[tuple]:
    """The run with faults injected until its last step; returns (t, worker, signal) per fault."""
    rng = random.Random(seed)
    p = start(run_dir, steps, extra)
    supervised = "--supervise" in extra
    t0 = time.monotonic()
    due, faults, stopped = t0 + rng.expovariate(1 / mean_gap), [], []
    try:
        while p.poll() is None and steps_done(run_dir) < steps:
            time.sleep(0.2)
            now = time.monotonic()
            if now < due or steps_done(run_dir) < 1:  # faults start once training does
                continue
            live = victims(p.pid, supervised)
            if live:
                name = rng.choice(sorted(live))
                how = (
                    rng.choice(sorted(SIGNALS)) if name != "driver" else "kill"
                )  # nothing watches a stopped driver
                os.kill(live[name], SIGNALS[how])
                stopped += [live[name]] if how == "stop" else []
                faults.append((now - t0, name, how, steps_done(run_dir)))
                print(f"  {now - t0:6.1f} s  step {faults[-1][3]:4d}  {how} {name}", flush=True)
            due = now + rng.expovariate(1 / mean_gap)
        wait(p, run_dir)
    finally:
        for pid in stopped:  # the driver kills a stopped worker; never leave one behind
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    return faults


def ledger_check(run_dir: Path, steps: int) -> dict:
    """Every trajectory of the journal accounted for exactly once, against the last step record."""
    journal = list(read_journal(run_dir / "journal.jsonl"))
    finished = [(e.trajectory.group, e.trajectory.sample_index) for e in journal if isinstance(e, Finished)]
    partials = sum(isinstance(e, Discarded) for e in journal)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, StepRecord)]
    by_step = {  # a step a resumed driver issued again replaces the dead driver's (as report/html.py)
        m.data["step"]: m.data["groups"]
        for m in read_events(run_dir / "events.jsonl") if isinstance(m, Mark) and m.kind == "train_issued"
    }  # fmt: skip
    issued = [g for groups in by_step.values() for g in groups]
    led = records[-1].ledger
    accounted = led["trained"] + led["in_store"] + sum(led["discarded"].values())
    produced = len(set(finished)) + partials
    return {
        "steps": [r.step for r in records] == list(range(steps)),
        "duplicated": (len(finished) - len(set(finished))) + (len(issued) - len(set(issued))),
        "lost": produced - accounted,
        "ledger_produced_matches_journal": led["produced"] == produced,
        "trained": led["trained"],
    }


def union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of `spans`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def recoveries(run_dir: Path) -> list[Mark]:
    return [m for m in read_events(run_dir / "events.jsonl") if isinstance(m, Mark) and m.kind == "recovery"]


def chaos(args, extra: list[str], root: Path) -> None:
    extra = [f"--worker_timeout_s={args.worker_timeout_s}", "--max_restarts=1000", *extra]
    print(f"clean run: {args.steps} steps", flush=True)
    t = time.monotonic()
    wait(start(root / "clean", args.steps, extra), root / "clean")
    clean_total = time.monotonic() - t
    print(
        f"chaos run: {args.steps} steps, a fault every ~{args.mean_gap:.0f} s (seed {args.seed})", flush=True
    )
    t = time.monotonic()
    faults = chaos_run(root / "chaos", args.steps, extra, args.mean_gap, args.seed)
    chaos_total = time.monotonic() - t
    clean, messy = train_wall(root / "clean"), train_wall(root / "chaos")
    supervised = "--supervise" in extra
    if supervised:  # the step records' clock leaves out the driver's outages: the whole processes' has them
        clean, messy = clean_total, chaos_total
    recs = recoveries(root / "chaos")
    check = ledger_check(root / "chaos", args.steps)
    down = sum(m.data["downtime_s"] for m in recs)
    # several workers may be down at once (each resumed driver starts its own clock: not comparable)
    short = 0.0 if supervised else union([(m.t - m.data["downtime_s"], m.t) for m in recs])
    by = {k: sum(1 for f in faults if f[2] == k) for k in SIGNALS}
    print(
        f"\nfaults: {len(faults)} ({by['kill']} kill -9, {by['stop']} SIGSTOP) in {messy:.0f} s of training: "
        f"{3600 * len(faults) / messy:.0f} per hour, one every {messy / max(1, len(faults)):.0f} s"
    )
    some = "" if supervised else f"; some worker down {short:.1f} s ({short / messy:.1%} of the chaos run)"
    print(f"recoveries recorded: {len(recs)}, downtime {down:.1f} worker-seconds in all{some}")
    for m in recs:
        d = m.data
        print(
            f"  {m.t:7.1f} s  {d['worker']:8s} {d['cause']:5s} down {d['downtime_s']:5.1f} s  "
            f"requeued {d['requeued']:3d}  replayed {d['replayed']}"
        )
    print(
        f"ledger: steps each once {check['steps']}, lost {check['lost']}, duplicated {check['duplicated']}, "
        f"ledger.produced = journal {check['ledger_produced_matches_journal']}, trained {check['trained']}"
    )
    what = "whole processes (--supervise)" if supervised else "training wall"
    print(
        f"{what}: clean {clean:.1f} s, chaos {messy:.1f} s -> ETTR {clean / messy:.3f} "
        f"(whole processes: {clean_total:.0f} s vs {chaos_total:.0f} s -> {clean_total / chaos_total:.3f})"
    )
    ok = check["steps"] and check["lost"] == 0 and check["duplicated"] == 0
    if not (ok and check["ledger_produced_matches_journal"]):
        raise SystemExit(f"FAILED: the ledger is not exact: {check}")


# -- soak ----------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def soak(args, extra: list[str], root: Path) -> None:
    steps = args.steps if args.steps_given else 500
    run_dir = root / "soak"
    print(f"soak run: {steps} steps, no faults; RSS every {args.every:.0f} s", flush=True)
    p = start(run_dir, steps, extra)
    samples: dict[str, list[tuple[int, float]]] = {}
    while p.poll() is None:
        time.sleep(args.every)
        n = steps_done(run_dir)
        if n == 0 or n >= steps:
            continue
        for name, pid in {"driver": p.pid, **workers(p.pid)}.items():
            mb = rss_mb(pid)
            if mb is not None:
                samples.setdefault(name, []).append((n, mb))
    wait(p, run_dir)
    print(f"\n{'process':10s} {'RSS first':>10s} {'RSS last':>9s} {'MB / 100 steps':>15s}  samples")
    for name, pts in sorted(samples.items()):
        kept = [(s, m) for s, m in pts if s >= steps // 10]
        if len(kept) < 3:
            continue
        x, y = np.array(kept, float).T
        slope = np.polyfit(x, y, 1)[0] * 100
        print(f"{name:10s} {y[0]:10.1f} {y[-1]:9.1f} {slope:15.2f}  {len(kept)}")
    size = (run_dir / "journal.jsonl").stat().st_size
    print(f"journal: {size / 1e6:.2f} MB after {steps} steps = {size / steps / 1e3:.1f} KB per step")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (200; soak 500)")
    ap.add_argument("--mean-gap", type=float, default=30.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault times, victims and signals")
    ap.add_argument("--worker-timeout-s", type=float, default=5.0, help="worker_timeout_s of the runs")
    ap.add_argument("--soak", action="store_true", help="one long run without faults: RSS slopes")
    ap.add_argument("--every", type=float, default=5.0, help="soak: seconds between RSS samples")
    ap.add_argument("--keep", help="write the run directories here (default: a temporary directory)")
    args = ap.parse_args(argv)
    args.steps_given = args.steps is not None
    args.steps = args.steps or 200
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        (soak if args.soak else chaos)(args, extra, root)


if __name__ == "__main__":
    main()
