"""bench/modes.py of this tree against bench/modes.py of another git revision, alternated in one run.

    .venv/bin/python bench/ab_modes.py --rev f5286ae                   # balanced: sync, multiversion-K2
    .venv/bin/python bench/ab_modes.py --rev HEAD~1 --configs genheavy --repeats 3

For refactors that must not change a run's speed: each side runs its own tree's bench/modes.py (the
revision exported with `git archive`; the same configuration, steps and seed), old and new in turn,
`--repeats` times, so drift falls on both. Printed per mode: seconds per step (wall of the training
part / steps) of each side, median over repeats, new/old, and whether the runs trained the same
samples to the same final accuracy (sync is deterministic: it must).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_engine import export

ROOT = Path(__file__).resolve().parent.parent


def run(tree: Path, out: Path, a: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, str(tree / "bench" / "modes.py"), f"--configs={a.configs}", f"--modes={a.modes}",
           f"--steps={a.steps}", "--seeds=0", f"--eval-n={a.eval_n}", f"--out={out}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "modes.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare against (the 'old' side)")
    ap.add_argument("--configs", default="balanced")
    ap.add_argument("--modes", default="sync,multiversion-K2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if "sync" not in a.modes.split(","):
        a.modes = "sync," + a.modes  # modes.py's tables are ratios to sync: it always runs
    rows: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"new": ROOT, "old": export(a.rev, Path(tmp))}
        for r in range(a.repeats):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                for rec in run(trees[side], Path(tmp) / f"out-{side}-{r}", a):
                    rows.setdefault((rec["config"], rec["mode"], side), []).append(rec)
                print(
                    f"repeat {r + 1}/{a.repeats}: {side} done (load average {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    print(f"\nnew = this tree, old = {a.rev}; {a.steps} steps per run, {a.repeats} runs per side")
    print(f"{'config':10} {'mode':18} {'new s/step':>10} {'old s/step':>10} {'old/new':>8}  final accuracy")
    for config, mode, _ in sorted(k for k in rows if k[2] == "new"):
        per = {s: [x["wall_s"] / a.steps for x in rows[(config, mode, s)]] for s in ("new", "old")}
        acc = {s: sorted({x["final_accuracy"] for x in rows[(config, mode, s)]}) for s in ("new", "old")}
        n, o = statistics.median(per["new"]), statistics.median(per["old"])
        print(f"{config:10} {mode:18} {n:10.3f} {o:10.3f} {o / n:7.3f}x  new {acc['new']} old {acc['old']}")
    print("old/new above 1: this tree is faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
