"""An engine joining a running job: generation throughput before and after, side by side in one run.

    .venv/bin/python bench/join.py                    # both placements of the joined engine (~4 min)
    .venv/bin/python bench/join.py --cores shared     # one of them: shared | trainer | a core
    .venv/bin/python bench/join.py --config default   # the default run (trainer-bound on 2 cores)
    .venv/bin/python bench/join.py --cores ray        # on Ray: the run's actors, a joiner's actor
    PYTHONPATH=. .venv-vllm/bin/python bench/join.py --backend vllm --lora 4 --cores trainer   # vLLM engines

Each run is a `tailrace train` (default model and task, `--mode`, one engine, `--config`: genheavy,
bench/modes.py's generation-bound shape, or the defaults) that a second engine
joins (`tailrace engine join RUN_DIR`) after `--join-after` steps. Throughput comes from the run's
own journal: the response tokens (and samples) of every trajectory finished in a window of the run's
clock, before the join (the `--window` seconds up to it) and after (the same length, from the joined
engine's first generated step on). Placements of the joined engine:
  shared   the driver's choice on a machine with no free core: the run's engine core (two engines
           time-share one core; the trainer keeps its own)
  trainer  pinned to the trainer's core (--cores 0): the engines get a core each, the trainer shares
  ray      the run on a Ray cluster this script starts (loopback, 3 CPUs: trainer, engine, joiner), the
           joiner a Ray actor (runtime/ray_join.py); nothing is pinned, the OS shares the cores
The table says what each core ran: per lane (trainer, engine0, engine1) its busy share of the window.
Writes bench/out/join-<config>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PLACEMENTS = {"shared": None, "trainer": "0"}
CONFIGS = {  # bench/modes.py's: genheavy is generation-bound (a 2-slot engine), default trainer-bound here
    "genheavy": [
        "--flow.prompts_per_round=32", "--flow.samples_per_prompt=8", "--flow.train_batch=64",
        "--train.bf16=true", "--model.dtype=bfloat16", "--rollout.slots=2",
    ],
    "default": [],
}  # fmt: skip


def cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def steps_done(run: Path) -> int:
    return sum(1 for r in lines(run / "metrics.jsonl") if r.get("kind") == "step")


def ray_cluster() -> str:
    """A Ray cluster on loopback for the `ray` placement (3 CPUs), started once; its address."""
    import logging

    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1"
        )
    return ray.get_runtime_context().gcs_address


def run_one(name: str, cores: str | None, args) -> dict:
    run = OUT / f"join-{args.config}-{name}"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    on_ray = ["--runtime.kind=ray", f"--runtime.address={ray_cluster()}"] if name == "ray" else []
    cores = None if name == "ray" else cores
    train = cli(
        "train", f"--run-dir={run}", f"--flow.mode={args.mode}", f"--flow.steps={args.steps}",
        "--eval.n=16", "--rollout.engines=1", f"--seed={args.seed}", *CONFIGS[args.config], *on_ray,
        f"--rollout.backend={args.backend}", *([f"--train.lora.rank={args.lora}"] if args.lora else []),
    )  # fmt: skip
    joiner = None
    try:
        while steps_done(run) < args.join_after:
            if train.poll() is not None:
                raise SystemExit(f"the run ended early:\n{train.stdout.read()[-3000:]}")
            time.sleep(0.2)
        joiner = cli("engine", "join", str(run), *(["--cores", cores] if cores else []))
        out, _ = train.communicate(timeout=900)
        if train.returncode != 0:
            raise SystemExit(f"the run failed:\n{out[-3000:]}")
        joiner.wait(timeout=60)
    finally:
        for p in (train, joiner):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return measure(run, args.window) | {"placement": name, "config": args.config, "backend": args.backend}


def measure(run: Path, window: float) -> dict:
    events = lines(run / "events.jsonl")
    finished = [e for e in lines(run / "journal.jsonl") if e.get("kind") == "done"]
    join = next(e for e in events if e.get("kind") == "engine_join")
    engine = join["engine"]
    first = min(
        e["t0"] for e in events if e.get("lane") == f"engine{engine}" and e.get("phase") == "generate"
    )
    end = max(e["times"][2] for e in finished)
    w = min(window, join["t"], end - first)
    windows = {"before": (join["t"] - w, join["t"]), "after": (first, first + w)}
    row = {"join_t": join["t"], "first_work_t": first, "window_s": w, "join_cores": join["cores"]}
    for k, (t0, t1) in windows.items():
        done = [e for e in finished if t0 <= e["times"][2] < t1]
        row[k] = {
            "tokens_per_s": sum(e["n"] for e in done) / w,
            "samples_per_s": len(done) / w,
            "busy": {lane: busy(events, lane, t0, t1) for lane in ("trainer", "engine0", f"engine{engine}")},
        }
    steps = [r for r in lines(run / "metrics.jsonl") if r.get("kind") == "step"]
    spans = {"before": [r for r in steps if r["time"]["wall_s"] <= join["t"]],
             "after": [r for r in steps if r["time"]["wall_s"] - r["time"]["step_s"] >= first]}  # fmt: skip
    for k, rs in spans.items():  # the engines' decoded tokens per second, over whole steps
        row[k]["steps"] = len(rs)
        row[k]["gen_tok_s"] = sum(r["time"]["gen_tok_s"] * r["time"]["step_s"] for r in rs) / max(
            sum(r["time"]["step_s"] for r in rs), 1e-9
        )
        row[k]["step_s"] = sum(r["time"]["step_s"] for r in rs) / max(len(rs), 1)
    row["ratio"] = row["after"]["gen_tok_s"] / max(row["before"]["gen_tok_s"], 1e-9)
    return row


def busy(events: list[dict], lane: str, t0: float, t1: float) -> float:
    """The share of [t0, t1) that `lane` spent generating or training (its spans, clipped)."""
    phases = ("generate", "train")
    s = sum(
        max(0.0, min(e["t1"], t1) - max(e["t0"], t0))
        for e in events
        if e.get("lane") == lane and e.get("phase") in phases
    )
    return s / (t1 - t0)


def table(rows: list[dict], load: str) -> str:
    out = [f"generation before and after an engine joins (load average at start: {load})", ""]
    out.append(
        f"{'config':<9} {'placement':<9} {'cores':>5} {'decode tok/s':>21} {'ratio':>6} {'step s':>12}"
        f" {'finished tok/s':>16} {'samples/s':>14}  busy before (tr/e0)  busy after (tr/e0/e1)"
    )
    for r in rows:
        b, a = r["before"], r["after"]
        bb, ab = list(b["busy"].values()), list(a["busy"].values())
        out.append(
            f"{r['config']:<9} {r['placement']:<9} {','.join(map(str, r['join_cores'])):>5} "
            f"{b['gen_tok_s']:>9,.0f} -> {a['gen_tok_s']:<7,.0f} {r['ratio']:>5.2f}x "
            f"{b['step_s']:>5.2f} -> {a['step_s']:<4.2f} {b['tokens_per_s']:>6,.0f} -> {a['tokens_per_s']:<6,.0f} "
            f"{b['samples_per_s']:>5.1f} -> {a['samples_per_s']:<5.1f}  {bb[0]:.2f} / {bb[1]:.2f}"
            f"          {ab[0]:.2f} / {ab[1]:.2f} / {ab[2]:.2f}"
        )
    out.append(
        "decode tok/s: the engines' decoded tokens over whole steps before the join and after the joined "
        "engine's first step; finished tok/s and samples/s: responses finished in the windows"
    )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cores", default="shared,trainer", help="placements: shared, trainer, ray, or a core list"
    )
    ap.add_argument("--mode", default="multiversion")
    ap.add_argument("--config", default="genheavy", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--join-after", type=int, default=8)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="tailrace", choices=("tailrace", "vllm"))
    ap.add_argument(
        "--lora", type=int, default=0, help="LoRA rank (0: whole weights; vLLM needs it for multiversion)"
    )
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    load = os.popen("uptime").read().strip().split("load average:")[-1].strip()
    rows = []
    for name in args.cores.split(","):
        rows.append(run_one(name, PLACEMENTS.get(name, name), args))
    print(table(rows, load))
    (OUT / f"join-{args.config}{'-vllm' if args.backend == 'vllm' else ''}.json").write_text(
        json.dumps({"load": load, "args": vars(args), "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
