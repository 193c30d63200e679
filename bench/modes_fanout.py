"""bench/modes.py fanned out over a big machine: one process per (mode, seed), each pinned to its own
pair of cores (a 2-core testbed apiece), then one merged time-to-accuracy table.

    python bench/modes_fanout.py --modes sync,multiversion-K2 --seeds 0,1,2 --steps 120 --budget-s 450

Runs side by side share the machine's memory bandwidth and caches, so every mode pays the same
neighbours; compare modes within one fan-out, not across. Writes OUT/modes.json (all rows) and
OUT/runs.tgz (every run's config.yaml and metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from modes import generation_share, time_to_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="sync,multiversion-K2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--config", default="demo")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="device of every run (cpu: a 2-core testbed apiece)")
    ap.add_argument("--budget-s", type=float, default=3600.0, help="stop every run after this long")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out" / "fanout")))
    args = ap.parse_args()
    out = Path(args.out)
    cores = sorted(os.sched_getaffinity(0))
    jobs = [(m, s) for s in args.seeds.split(",") for m in args.modes.split(",")]
    if 2 * len(jobs) > len(cores):
        sys.exit(f"{len(jobs)} runs need {2 * len(jobs)} cores; this machine has {len(cores)}")
    procs = []
    for i, (mode, seed) in enumerate(jobs):
        pair = cores[2 * i : 2 * i + 2]
        d = out / f"{mode}-s{seed}"
        cmd = [
            "taskset", "-c", ",".join(map(str, pair)), sys.executable, str(ROOT / "bench" / "modes.py"),
            "--configs", args.config, "--modes", mode, "--seeds", seed, "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), "--eval-n", str(args.eval_n), "--out", str(d),
            "--set", f"device={args.device}",
        ]  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
        log = open(d / "log.txt", "w")
        procs.append((mode, seed, d, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    t0 = time.time()
    for mode, seed, d, p in procs:
        try:
            p.wait(timeout=max(1.0, args.budget_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            print(f"{mode} seed {seed}: stopped at the budget", flush=True)
    rows = []
    for mode, seed, d, p in procs:
        f = d / "modes.json"
        if f.is_file():
            rows += json.loads(f.read_text())
        else:
            print(f"{mode} seed {seed}: no result; the end of its log:\n{(d / 'log.txt').read_text()[-600:]}")
    (out / "modes.json").write_text(json.dumps(rows, indent=2))
    with tarfile.open(out / "runs.tgz", "w:gz") as tar:
        for f in sorted(out.rglob("*")):
            if f.name in ("metrics.jsonl", "log.txt") or (
                f.name == "config.yaml" and "checkpoints" not in f.parts
            ):
                tar.add(f, arcname=str(f.relative_to(out)))
    if any(r["mode"] == "sync" for r in rows):
        print(f"\n== {args.config}: wall time to held-out accuracy, {len(rows)} runs side by side ==")
        print(time_to_target(rows))
        print(generation_share(rows))


if __name__ == "__main__":
    main()
