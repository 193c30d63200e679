"""Several policies in one run, sharing the rollout engines, against the same policies trained one
after another on the same engines (issue #19 item 2; AstraFlow publishes 2.7x on multi-policy
training).

    .venv/bin/python bench/policies.py --steps 40 --seeds 0,1,2 --eval-every 20 --eval-n 512
    .venv/bin/python bench/policies.py --quick       # a smoke run

Each seed s trains P policies (`--policies`, default 2) on the default task, policy k with seed and
task seed 10 s + k (its own prompt stream and held-out set), in `--mode` (default sync: each policy
strictly on-policy). Together: one `tailrace train` run with `policies`, one trainer process per
policy (they share the trainer's core), the engine shared. One after another: each policy alone in a
run of its own, the same config, back to back. Every run evaluates its published weights every
`--eval-every` steps on `--eval-n` held-out prompts (snapshots evaluated after training: off the
clock). Per seed: the wall time until every policy has done its steps, and until every policy has
reached the target accuracy (the mean final accuracy of the policies trained alone, minus 2 points);
one after another, policy k's clock starts when the policies before it finish. Per policy: final
accuracy together vs alone. Writes bench/out/policies.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.config import dump_config, load_config  # noqa: E402
from tailrace.config.load import policy_configs  # noqa: E402
from tailrace.metrics import time_to_accuracy  # noqa: E402
from tailrace.records import EvalRecord, StepRecord, read_metrics  # noqa: E402
from tailrace.runtime.driver import Driver  # noqa: E402
from tailrace.runtime.rundir import RunDir  # noqa: E402
from tailrace.runtime.session import Session  # noqa: E402


def policy_row(run: Path) -> dict:
    """A policy's figures from its run directory: its last step's wall time (the run's clock), its
    (wall_s, accuracy) evaluations and final accuracy."""
    metrics = list(read_metrics(run / "metrics.jsonl"))
    steps = [r for r in metrics if isinstance(r, StepRecord)]
    evals = [e for e in metrics if isinstance(e, EvalRecord)]
    final = next(e.accuracy for e in evals if e.tag == "final")
    return {
        "wall_s": steps[-1].time["wall_s"],
        "steps": len(steps),
        "points": sorted((e.wall_s, e.accuracy) for e in evals),
        "final": final,
        "base": next(e.accuracy for e in evals if e.tag == "base"),
    }


def train(rd: RunDir, over: list[str]) -> float:
    if rd.path.exists():
        import shutil

        shutil.rmtree(rd.path)
    rd.create()
    cfg = load_config(None, over)
    rd.file("config.yaml").write_text(dump_config(cfg))
    sessions = [Session(pc) for _, pc in policy_configs(cfg)]
    drv = Driver(cfg, rd, sessions)
    t0 = time.perf_counter()
    try:
        drv.train()
    finally:
        drv.close()
        for s in sessions:
            s.close()
    return time.perf_counter() - t0


def one_seed(args, seed: int, out: Path) -> dict:
    common = [
        f"--flow.mode={args.mode}",
        f"--flow.steps={args.steps}",
        f"--eval.n={args.eval_n}",
        f"--eval.every={args.eval_every}",
        "--flow.checkpoint_every=1000",
        *args.extra,
    ]
    ids = [10 * seed + k for k in range(args.policies)]
    entries = ", ".join(f"{{name: p{k}, seed: {i}, task: {{seed: {i}}}}}" for k, i in enumerate(ids))
    together = out / f"seed{seed}" / "together"
    train(RunDir(together), [*common, f"--policies=[{entries}]"])
    rows = {"together": [policy_row(together / "policies" / f"p{k}") for k in range(args.policies)]}
    alone = []
    for k, i in enumerate(ids):
        rd = RunDir(out / f"seed{seed}" / f"alone-p{k}")
        train(rd, [*common, f"--seed={i}", f"--task.seed={i}"])
        alone.append(policy_row(rd.path))
    rows["alone"] = alone
    return rows


def summarize(results: dict[int, dict], eval_n: int) -> str:
    finals_alone = [p["final"] for r in results.values() for p in r["alone"]]
    target = statistics.mean(finals_alone) - 0.02

    def sd(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    lines = []
    done_tog, done_seq, tt_tog, tt_seq = [], [], [], []
    for seed, r in results.items():
        tog, alone = r["together"], r["alone"]
        done_tog.append(max(p["wall_s"] for p in tog))
        done_seq.append(sum(p["wall_s"] for p in alone))
        reach_tog = [time_to_accuracy(p["points"], target) for p in tog]
        offsets = [sum(p["wall_s"] for p in alone[:k]) for k in range(len(alone))]
        reach_seq = [
            None if (t := time_to_accuracy(p["points"], target)) is None else off + t
            for p, off in zip(alone, offsets)
        ]
        if None not in reach_tog and None not in reach_seq:
            tt_tog.append(max(reach_tog))
            tt_seq.append(max(reach_seq))
        lines.append(
            f"seed {seed}: all steps done {done_tog[-1]:.0f} s together vs {done_seq[-1]:.0f} s one after "
            f"another ({done_seq[-1] / done_tog[-1]:.2f}x); every policy at target: "
            f"{f'{max(reach_tog):.0f} s' if None not in reach_tog else 'never'} vs "
            f"{f'{max(reach_seq):.0f} s' if None not in reach_seq else 'never'}; finals together "
            + " ".join(f"{p['final']:.3f}" for p in tog)
            + " alone "
            + " ".join(f"{p['final']:.3f}" for p in alone)
        )
    ratio = [s / t for s, t in zip(done_seq, done_tog)]
    lines.append(
        f"all steps done: together {statistics.mean(done_tog):.0f} s +- {sd(done_tog):.0f}, one after another "
        f"{statistics.mean(done_seq):.0f} s +- {sd(done_seq):.0f}: {statistics.mean(ratio):.2f}x "
        f"({min(ratio):.2f}-{max(ratio):.2f}) over {len(ratio)} seeds"
    )
    if tt_tog:
        r2 = [s / t for s, t in zip(tt_seq, tt_tog)]
        lines.append(
            f"every policy at {target:.3f}: together {statistics.mean(tt_tog):.0f} s +- {sd(tt_tog):.0f}, one "
            f"after another {statistics.mean(tt_seq):.0f} s +- {sd(tt_seq):.0f}: {statistics.mean(r2):.2f}x "
            f"({len(tt_tog)}/{len(results)} seeds reached it both ways)"
        )
    tog_f = [p["final"] for r in results.values() for p in r["together"]]
    lines.append(
        f"final accuracy per policy: together {statistics.mean(tog_f):.3f} +- {sd(tog_f):.3f}, alone "
        f"{statistics.mean(finals_alone):.3f} +- {sd(finals_alone):.3f} (n = {eval_n} each: standard error "
        f"<= {0.5 / eval_n**0.5:.3f}); target = alone's mean final - 2 points"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--policies", type=int, default=2)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 seed, 32 held-out prompts")
    ap.add_argument("extra", nargs="*", help="more --section.key=value overrides for every run")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_n, args.eval_every = 2, "0", 32, 1
    out = ROOT / "bench" / "out" / "policies"
    results = {}
    for s in (int(x) for x in args.seeds.split(",")):
        results[s] = one_seed(args, s, out)
        (ROOT / "bench" / "out" / "policies.json").write_text(json.dumps(results, indent=1))
    print(summarize(results, args.eval_n))


if __name__ == "__main__":
    main()
