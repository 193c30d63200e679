"""Several policies in one run, sharing the rollout engines, against the same policies trained one
after another on the same engines (issue #19 item 2; AstraFlow publishes 2.7x on multi-policy
training).

    .venv/bin/python bench/policies.py --steps 60 --seeds 0,1,2 --eval-every 20 --eval-n 512
    .venv/bin/python bench/policies.py --quick       # a smoke run

Each seed s trains P policies (`--policies`, default 2) on the default task, policy k with seed and
task seed 10 s + k (its own prompt stream and held-out set), in `--mode` (default sync: each policy
strictly on-policy). Together: one `tailrace train` run with `policies`, one trainer process per
policy (they share the trainer's core), the engine shared, once per `--share` (flow.share: turns, one
trainer step at a time on the shared core and the engines serving first the policy whose oldest open
group began first; fifo, neither). One after another: each policy alone in a run of its own, the same
config, back to back. Every run evaluates its published weights every `--eval-every` steps on
`--eval-n` held-out prompts (snapshots evaluated after training: off the clock). Per seed: the wall
time until every policy has done its steps, and until every policy has reached its target accuracy
(its final accuracy trained alone minus 2 points); one after another, policy k's clock starts when
the policies before it finish. Per policy: final accuracy together vs alone. Writes
bench/out/policies.json (`--tables` reprints its table).
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
        # the engines' busy slot-seconds over its step windows (shared engines: every policy's windows
        # see the same engines, and they tile the run's clock)
        "slot_s": sum(r.time["step_s"] * (1 - r.time["step_bubble_ratio"]) for r in steps),
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
    rows = {}
    for share in args.share.split(","):
        together = out / f"seed{seed}" / f"together-{share}"
        train(RunDir(together), [*common, f"--policies=[{entries}]", f"--flow.share={share}"])
        rows[f"together-{share}"] = [
            policy_row(together / "policies" / f"p{k}") for k in range(args.policies)
        ]
    alone = []
    for k, i in enumerate(ids):
        rd = RunDir(out / f"seed{seed}" / f"alone-p{k}")
        train(rd, [*common, f"--seed={i}", f"--task.seed={i}"])
        alone.append(policy_row(rd.path))
    rows["alone"] = alone
    return rows


def summarize(results: dict[int, dict], eval_n: int) -> str:
    """Per contender (together under each engine share, one after another) over the seeds: the wall
    time until every policy has done its steps and until every policy reached the target, and the
    policies' final accuracies."""

    def sd(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    def figures(
        policies: list[dict], alone: list[dict], one_after_another: bool
    ) -> tuple[float, float | None]:
        """(all steps done, every policy at its target or None): policy k's target is its final accuracy
        trained alone minus 2 points; one after another, policy k's clock starts when the policies
        before it finished."""
        n = len(policies)
        offsets = [sum(p["wall_s"] for p in policies[:k]) if one_after_another else 0.0 for k in range(n)]
        done = max(off + p["wall_s"] for p, off in zip(policies, offsets))
        reach = [time_to_accuracy(p["points"], a["final"] - 0.02) for p, a in zip(policies, alone)]
        return done, None if None in reach else max(off + t for t, off in zip(reach, offsets))

    def slot_use(policies: list[dict], one_after_another: bool) -> float:
        """The engines' slot use over the run(s): busy slot-seconds over wall seconds (together: one
        policy's windows tile the run's clock; one after another: every run's)."""
        runs = policies if one_after_another else policies[:1]
        return sum(p["slot_s"] for p in runs) / sum(p["wall_s"] for p in runs)

    contenders = [*(k for k in next(iter(results.values())) if k != "alone"), "alone"]
    per = {c: [figures(r[c], r["alone"], c == "alone") for r in results.values()] for c in contenders}
    head = (
        f"{'contender':16s} {'all steps done s':>16s} {'sd':>5s} {'speed-up':>8s} {'all at target s':>15s} "
        f"{'sd':>5s} {'speed-up':>8s} {'reached':>7s} {'final acc':>9s} {'sd':>6s} {'slot use':>8s}"
    )
    lines = [head, "-" * len(head)]
    base_done = [d for d, _ in per["alone"]]
    base_reach = [t for _, t in per["alone"]]
    for c in contenders:
        done = [d for d, _ in per[c]]
        both = [(t, b) for (_, t), b in zip(per[c], base_reach) if t is not None and b is not None]
        finals = [p["final"] for r in results.values() for p in r[c]]
        uses = [slot_use(r[c], c == "alone") for r in results.values() if "slot_s" in r[c][0]]
        use = statistics.mean(uses) if uses else float("nan")
        sp = statistics.mean(b / d for d, b in zip(done, base_done))
        reach = [t for t, _ in both]
        ratios = [b / t for t, b in both if t > 0]  # t = 0: the base evaluation already met the target
        rs = (
            f"{statistics.mean(reach):15.0f} {sd(reach):5.0f} "
            + (f"{statistics.mean(ratios):7.2f}x" if ratios else f"{'at base':>8s}")
            if both
            else f"{'never':>15s} {'':5s} {'':8s}"
        )
        lines.append(
            f"{('one after another' if c == 'alone' else c):16s} {statistics.mean(done):16.0f} {sd(done):5.0f} "
            f"{sp:7.2f}x {rs} {sum(t is not None for _, t in per[c]):>3d}/{len(per[c]):<3d} "
            f"{statistics.mean(finals):9.3f} {sd(finals):6.3f} {use:8.0%}"
        )
    lines.append(
        f"a policy's target: its final accuracy trained alone minus 2 points; held-out n = {eval_n} per "
        f"policy (standard error <= {0.5 / eval_n**0.5:.3f}); speed-up = one after another's time / the "
        f"contender's, per seed, mean over {len(results)} seeds (target: over seeds where both reached it)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--policies", type=int, default=2)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--share", default="turns,fifo", help="flow.share values to run together under")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 seed, 32 held-out prompts")
    ap.add_argument("--tables", action="store_true", help="reprint the last invocation's table")
    ap.add_argument("--tag", default="", help="keep this invocation's runs and JSON apart (out/policies-TAG)")
    ap.add_argument("extra", nargs="*", help="more --section.key=value overrides for every run (after --)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_n, args.eval_every = 2, "0", 32, 1
    name = f"policies-{args.tag}" if args.tag else "policies"
    out = ROOT / "bench" / "out" / name
    if args.tables:
        saved = json.loads((ROOT / "bench" / "out" / f"{name}.json").read_text())
        print(summarize({int(k): v for k, v in saved["results"].items()}, saved["eval_n"]))
        return
    results = {}
    for s in (int(x) for x in args.seeds.split(",")):
        results[s] = one_seed(args, s, out)
        saved = {"eval_n": args.eval_n, "results": results}
        (ROOT / "bench" / "out" / f"{name}.json").write_text(json.dumps(saved, indent=1))
    print(summarize(results, args.eval_n))


if __name__ == "__main__":
    main()
