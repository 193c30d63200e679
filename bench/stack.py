"""The whole stack against sync, layer by layer, judged by wall time to held-out accuracy: issue #15's
end-to-end target (the best overlap mode + shaping + speculation >= 3x faster than sync to the target,
>= 3 seeds, each layer's marginal gain shown).

    .venv/bin/python bench/stack.py --seeds 0,1,2     # the claim: 12 runs, about an hour on 2 cores
    .venv/bin/python bench/stack.py --quick           # the plumbing: 4 steps, 32 held-out prompts, seed 0

Each layer adds one technique to the one above it, on bench/modes.py's `demo` configuration with a
finite training set (`task.train_size`, so prompts come back and the history drafter has earlier
responses of each prompt to draft from); the same settings in every layer:
  sync                                  the on-policy baseline
  multiversion-K1                       + overlap: the best mode of modes.py's headline
  multiversion-K1+darts                 + shaping: DARTS, its redundancy priced by the engine's cost
  multiversion-K1+darts+spec-history    + speculative decoding: the history drafter, under the toggle
The runs are modes.py's (`run_one`: the same code, evaluation on snapshots after training, so the
clock is the run's own); printed: modes.py's tables, then the layer table (time to the target, its
ratio to sync's, the marginal ratio to the layer below) and each speculating layer's figures.
Writes bench/out/stack/modes.json and the run directories under bench/out/stack/modes/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import modes
from modes import ROOT, reached, time_to_target

from tailrace.records import StepRecord, read_metrics

LAYERS = [
    "sync",
    "multiversion-K1",
    "multiversion-K1+darts",
    "multiversion-K1+darts+spec-history",
]


def layers(rows: list[dict], target: float) -> str:
    """Per layer over its seeds: mean time to `target`, ratio to sync's, ratio to the layer above's."""
    lines = [f"{'layer':36s} {'to target s':>11s} {'speedup':>8s} {'marginal':>9s} {'reached':>7s}"]
    first = prev = None
    for label in LAYERS:
        rs = [r for r in rows if r["mode"] == label]
        if not rs:
            continue
        got = reached(rs, target)
        t = statistics.mean(got) if got else None
        first = first if first is not None else t
        vs = f"{first / t:7.2f}x" if t and first else f"{'-':>8s}"
        marginal = f"{prev / t:8.2f}x" if t and prev else f"{'-':>9s}"
        shown = f"{t:11.1f}" if t else f"{'never':>11s}"
        lines.append(f"{label:36s} {shown} {vs} {marginal} {len(got):>3d}/{len(rs):<3d}")
        prev = t
    lines.append(
        f"target {target:.3f}; speedup = sync's mean time / the layer's (above 1: faster); marginal = the "
        "layer above's mean time / this layer's: what the technique it adds buys"
    )
    return "\n".join(lines)


def speculation(rows: list[dict]) -> str:
    """The speculating layers' figures, summed over each run's steps, mean over seeds."""
    lines = [f"{'layer':36s} {'drafted':>9s} {'accepted':>9s} {'share':>6s} {'fwd/token':>9s} {'on':>5s}"]
    for label in dict.fromkeys(r["mode"] for r in rows if "+spec-" in r["mode"]):
        per = []
        for r in (r for r in rows if r["mode"] == label):
            steps = [
                m for m in read_metrics(Path(r["run_dir"]) / "metrics.jsonl") if isinstance(m, StepRecord)
            ]
            drafted = sum(s.time.get("spec_drafted", 0) for s in steps)
            accepted = sum(s.time.get("spec_accepted", 0) for s in steps)
            fpt = statistics.mean(s.time.get("spec_forwards_per_token", 1.0) for s in steps)
            on = statistics.mean(s.time.get("spec_on_fraction", 0.0) for s in steps)
            per.append((drafted, accepted, fpt, on))
        d, a, f, o = (statistics.mean(x) for x in zip(*per))
        lines.append(f"{label:36s} {d:9.0f} {a:9.0f} {a / d if d else 0:6.2f} {f:9.3f} {o:5.2f}")
    lines.append(
        "per run, mean over seeds: draft tokens proposed and accepted, forward passes per generated token "
        "(mean over steps; 1 = none saved), on = share of decode rows that drafted"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--train-size", type=int, default=1024, help="task.train_size of every layer")
    ap.add_argument("--target", type=float, default=None, help="accuracy to time to (default: sync - 2 pts)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "stack"))
    ap.add_argument("--tables", action="store_true", help="reprint the tables of the last run")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if not a.tables:
        sys.argv = [
            "modes.py", "--configs=demo", f"--modes={','.join(LAYERS)}", f"--steps={a.steps}",
            f"--seeds={'0' if a.quick else a.seeds}", f"--eval-n={a.eval_n}", f"--eval-every={a.eval_every}",
            f"--set=task.train_size={a.train_size}", f"--out={out}", *(["--quick"] if a.quick else []),
        ]  # fmt: skip
        modes.main()
    rows = json.loads((out / "modes.json").read_text())
    sync = [r["final_accuracy"] or 0.0 for r in rows if r["mode"] == "sync"]
    target = a.target if a.target is not None else statistics.mean(sync) - 0.02
    if a.tables:
        print(time_to_target(rows, target))
    print("\n== the stack, layer by layer ==")
    print(layers(rows, target))
    print("\n== speculation in the stack ==")
    print(speculation(rows))


if __name__ == "__main__":
    main()
