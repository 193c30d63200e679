"""An external agent training a run over HTTP (flow.mode=external, examples/external_agent.py) beside
the same run making its own groups in async mode (the built-in mode with the same bound, K = 1, and
the same correction, tis), on the default task, side by side in one invocation per seed.

    .venv/bin/python bench/external.py                          # 2 seeds x 60 steps, held-out n = 512
    .venv/bin/python bench/external.py --steps 5 --eval-n 64 --seeds 0   # a smoke run

Each run: held-out accuracy before and after (`--eval-n` prompts), training wall time (the step
records' clock: the evaluations are off it), steps an hour; the agent's run also its groups sent and
refused (stale, or after the run's last step). Writes bench/out/external.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from external_agent import agent  # noqa: E402

from tailrace.cli import main as tailrace  # noqa: E402
from tailrace.records import EvalRecord, StepRecord, read_metrics  # noqa: E402

OUT = ROOT / "bench" / "out"
TOKEN = "bench-external-token"


def run(mode: str, seed: int, args) -> dict:
    run_dir = OUT / "external" / f"{mode}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    argv = [
        "train", f"--run-dir={run_dir}", f"--flow.mode={mode}", f"--flow.steps={args.steps}",
        f"--eval.n={args.eval_n}", f"--seed={seed}", "--flow.max_staleness=1", "--serve.port=0",
        f"--serve.token={TOKEN}",
    ]  # fmt: skip
    box: dict = {}
    if mode == "external":
        t = threading.Thread(
            target=lambda: box.update(agent(run_dir, TOKEN, 8, args.concurrency, "chainsum", seed)),
            daemon=True,
        )
        t.start()
    if tailrace(argv) != 0:
        raise SystemExit(f"{mode}: tailrace train failed")
    if mode == "external":
        t.join(timeout=120)
    metrics = list(read_metrics(run_dir / "metrics.jsonl"))
    steps = [m for m in metrics if isinstance(m, StepRecord)]
    evals = {m.tag: m.accuracy for m in metrics if isinstance(m, EvalRecord)}
    wall = steps[-1].time["wall_s"]
    return {
        "mode": mode, "seed": seed, "run_dir": str(run_dir), "steps": len(steps), "train_wall_s": wall,
        "steps_per_hour": 3600 * len(steps) / wall, "base": evals.get("base"), "final": evals.get("final"),
        "discarded": steps[-1].ledger["discarded"], **({"agent": box} if box else {}),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--concurrency", type=int, default=16, help="the agent's questions in flight")
    args = ap.parse_args()
    rows = [run(mode, int(s), args) for s in args.seeds.split(",") for mode in ("async", "external")]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "external.json").write_text(json.dumps(rows, indent=1))
    print(
        f"\n{'mode':9} {'seed':>4} {'base':>6} {'final':>6} {'train s':>8} {'steps/h':>8}  discarded / agent"
    )
    for r in rows:
        extra = r.get("agent", "")
        print(f"{r['mode']:9} {r['seed']:>4} {r['base']:6.1%} {r['final']:6.1%} {r['train_wall_s']:8.1f} "
              f"{r['steps_per_hour']:8.0f}  {r['discarded']} {extra}")  # fmt: skip


if __name__ == "__main__":
    main()
