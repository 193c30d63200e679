"""Multi-turn tool use end to end: chaincalc (chainsum with a calculator) trained in sync mode on the
local runtime, with an instant calculator and with one whose every call takes a seeded exponential
delay (a stand-in for a tool served over a network), side by side in one invocation.

    .venv/bin/python bench/agents.py                  # 2 runs x 30 steps, a few minutes each
    .venv/bin/python bench/agents.py --steps 5 --latency 0,0.05 --eval-n 64   # a smoke run

Each run: the chaincalc warm start (built once and cached: the chainsum model fine-tuned on
demonstrations, half of them calling the calculator), held-out accuracy before and after on
`--eval-n` prompts (multi-turn episodes too), and per step the reward, the tool calls, the share of
trajectories that call, the turns per trajectory, and the tool wait (seconds the step's trajectories
spent parked at a tool, summed, and the most one waited). Writes bench/out/agents.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tailrace.cli import main as tailrace  # noqa: E402
from tailrace.records import EvalRecord, StepRecord, read_metrics  # noqa: E402

OUT = ROOT / "bench" / "out"


def run(name: str, latency: float, args) -> dict:
    run_dir = OUT / "agents" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    argv = [
        "train", f"--run-dir={run_dir}", "--task.name=chaincalc", f"--flow.steps={args.steps}",
        f"--task.config={{tool_latency_s: {latency}}}", f"--eval.n={args.eval_n}", f"--seed={args.seed}",
        f"--task.tool_threads={args.tool_threads}", f"--flow.mode={args.mode}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    code = tailrace(argv)
    if code != 0:
        raise SystemExit(f"{name}: tailrace train exited with {code}")
    metrics = list(read_metrics(run_dir / "metrics.jsonl"))
    steps = [m for m in metrics if isinstance(m, StepRecord)]
    evals = {m.tag: m.accuracy for m in metrics if isinstance(m, EvalRecord)}
    k = max(1, min(5, len(steps) // 4))  # reward at start and end: means over the first and last k steps
    head, tail = steps[:k], steps[-k:]

    def mean(xs):
        return sum(xs) / len(xs)

    return {
        "name": name, "latency_s": latency, "run_dir": str(run_dir), "wall_s": time.perf_counter() - t0,
        "steps": len(steps), "k": k, "base": evals.get("base"), "final": evals.get("final"),
        "reward_start": mean([s.reward for s in head]), "reward_end": mean([s.reward for s in tail]),
        "calling_start": mean([s.tools["calling"] for s in head]),
        "calling_end": mean([s.tools["calling"] for s in tail]),
        "turns_start": mean([s.tools["turns_mean"] for s in head]),
        "turns_end": mean([s.tools["turns_mean"] for s in tail]),
        "errors": sum(s.tools["errors"] for s in steps), "calls": sum(s.tools["calls"] for s in steps),
        "tool_wait_s": mean([s.time["tool_wait_s"] for s in steps]),
        "tool_wait_max_s": max(s.time["tool_wait_max_s"] for s in steps),
        "step_s": mean([s.time["step_s"] for s in steps]),
        "bubble": mean([s.time["bubble_ratio"] for s in steps]),
        "per_step": [
            {"step": s.step + 1, "reward": s.reward, "calls": s.tools["calls"], "calling": s.tools["calling"],
             "tool_wait_s": s.time["tool_wait_s"], "tool_wait_max_s": s.time["tool_wait_max_s"],
             "step_s": s.time["step_s"]}
            for s in steps
        ],
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    lines = [
        "| run | held-out base -> final | reward start -> end | calling start -> end | turns/traj start -> end "
        "| tool wait / step (sum) | max one waited | step time | bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {pct(r['base'])} -> {pct(r['final'])} | {r['reward_start']:.3f} -> {r['reward_end']:.3f} "
            f"| {r['calling_start']:.2f} -> {r['calling_end']:.2f} | {r['turns_start']:.2f} -> {r['turns_end']:.2f} "
            f"| {r['tool_wait_s']:.2f} s | {r['tool_wait_max_s']:.2f} s | {r['step_s']:.2f} s | {r['bubble']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--latency", default="0,0.05", help="mean added tool latency per run, seconds")
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="sync", help="flow.mode (bench/README's figures are sync's)")
    ap.add_argument("--tool-threads", type=int, default=4, help="task.tool_threads: the driver's tool pool")
    args = ap.parse_args()
    rows = []
    for lat in [float(x) for x in args.latency.split(",")]:
        name = "calc" if lat == 0 else f"calc+{lat * 1000:.0f}ms"
        name += f" ({args.tool_threads} threads)" if args.tool_threads != 4 else ""
        rows.append(run(name, lat, args))
        print(f"{name}: reward {rows[-1]['reward_start']:.3f} -> {rows[-1]['reward_end']:.3f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "agents.json").write_text(json.dumps(rows, indent=2))
    print()
    print(
        f"chaincalc, sync, {args.steps} steps, reward start/end = mean of the first/last {rows[0]['k']} steps"
    )
    print(table(rows))
    for r in rows:
        print(f"\n{r['name']}: per step (reward, calls, tool wait sum / max, step time)")
        for s in r["per_step"]:
            print(
                f"  step {s['step']:3d}  reward {s['reward']:.3f}  calls {s['calls']:4d}  calling {s['calling']:.2f}  "
                f"tool wait {s['tool_wait_s']:6.2f} s / {s['tool_wait_max_s']:.3f} s  step {s['step_s']:.2f} s"
            )


if __name__ == "__main__":
    main()
