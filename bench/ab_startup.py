"""A short `tailrace train` of this tree against the same of another git revision, alternated in one
run: what a run's start and end cost (process starts, imports, the fork server, the exit).

    .venv/bin/python bench/ab_startup.py --rev 016abc8~4 --repeats 5

Each side runs `python -m tailrace.cli train` from its own tree (the revision exported with
`git archive`) on the built-in warm start (`ensure_warm_start`, cached), a run of 4 steps of
4 prompts x 4 samples, 32 tokens, held-out on 16 prompts: the run itself takes about a second, the
rest is start-up and exit. Old and new take turns `--repeats` times; printed: each side's wall seconds
(median, min, max) and new/old of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ab_engine import export

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import ArchConfig, SFTConfig  # noqa: E402
from tailrace.runtime.warmstart import ensure_warm_start  # noqa: E402

RUN = ["--flow.steps=4", "--flow.prompts_per_round=4", "--flow.samples_per_prompt=4", "--flow.train_batch=16",
       "--rollout.max_new_tokens=32", "--rollout.slots=8", "--eval.n=16", "--eval.max_new_tokens=32"]  # fmt: skip


def once(tree: Path, model: Path, run_dir: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [
        sys.executable,
        "-m",
        "tailrace.cli",
        "train",
        f"--run-dir={run_dir}",
        f"--model.path={model}",
        *RUN,
    ]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare against (the 'old' side)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    model = ensure_warm_start(ArchConfig(), SFTConfig())
    with tempfile.TemporaryDirectory(prefix="ab-startup-") as tmp:
        tmp = Path(tmp)
        (tmp / "old").mkdir()
        old = export(a.rev, tmp / "old")
        sides = {"old": old, "new": ROOT}
        secs: dict[str, list[float]] = {k: [] for k in sides}
        for i in range(a.repeats + 1):  # the first turn warms the page cache and the kernels' build
            for name in sides if i % 2 == 0 else list(sides)[::-1]:
                s = once(sides[name], model, tmp / f"run-{name}-{i}")
                if i:
                    secs[name].append(s)
    for name, v in secs.items():
        print(f"{name} ({a.rev if name == 'old' else 'this tree'}): median {statistics.median(v):.2f} s, "
              f"min {min(v):.2f}, max {max(v):.2f} over {len(v)}")  # fmt: skip
    print(f"new / old: {statistics.median(secs['new']) / statistics.median(secs['old']):.2f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
