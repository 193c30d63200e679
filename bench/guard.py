"""RewardGuard's scoring overhead, this tree against another git revision, side by side in one run.

    .venv/bin/python bench/guard.py --rev main          # ~1 min
    .venv/bin/python bench/guard.py --rev HEAD~5 --rounds 5

The driver pays the guard on every engine report, so its cost per batch and per result matters
more than any reward's. The reward here is trivial (a string comparison), so what is measured is the
guard alone: per batch = median wall time of a one-item batch (two pipe messages, the worker's
wake-up); per result = (median of a 256-item batch - per batch) / 255. Each tree runs in its own
process (the revision exported with `git archive`), the trees taking turns round by round so the
machine's drift falls on both alike; printed: the median over rounds of each tree's medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside each tree: one line of JSON, the guard's per-batch and per-result microseconds.
WORKER = r"""
import json, logging, statistics, time
from tailrace.tasks.base import Example, Task
from tailrace.tasks.guard import RewardGuard
logging.disable(logging.WARNING)

class Cheap(Task):
    name = "cheap"
    def examples(self, split, n, seed=0):
        return [Example(i, f"q{i}", str(i)) for i in range(n)]
    def reward(self, example, response):
        return 1.0 if response == example.answer else 0.0

def median_s(guard, pairs, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        guard.score_many(pairs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

ex = Cheap().examples("train", 256)
with RewardGuard(Cheap()) as g:
    one, many = [(ex[0], "0")], [(e, e.answer) for e in ex]
    median_s(g, many, 10)
    batch = median_s(g, one, 500)
    full = median_s(g, many, 200)
print(json.dumps({"batch_us": batch * 1e6, "result_us": (full - batch) / 255 * 1e6}))
"""


def export(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def measure(tree: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", WORKER],
        cwd=tree,
        env={"PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="main", help="the git revision to compare with (default: main)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {args.rev: export(args.rev, Path(tmp)), "this tree": ROOT}
        runs = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(measure(tree))
    rows = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("batch_us", "result_us")}
        for name, rs in runs.items()
    }
    print(f"{'tree':12} {'per batch (us)':>15} {'per result (us)':>16}")
    for name, row in rows.items():
        print(f"{name:12} {row['batch_us']:15.1f} {row['result_us']:16.2f}")
    new, old = rows["this tree"], rows[args.rev]
    print(
        f"{'new/old':12} {new['batch_us'] / old['batch_us']:14.2f}x {new['result_us'] / old['result_us']:15.2f}x"
    )
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "guard.json").write_text(json.dumps({"rev": args.rev, "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
