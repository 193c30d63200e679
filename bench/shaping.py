"""bench/shaping.py: shaping on top of the overlap modes, side by side in the simulator.

    .venv/bin/python bench/shaping.py [--seeds 3] [--steps 24] [--workload cpu|gpu|both]
    .venv/bin/python bench/shaping.py --rows sync+none,sync+sorted --set shaping.over=8 --set flow.max_staleness=7
    .venv/bin/python bench/shaping.py --real [--seeds 2] [--steps 30]   # real runs, default task

Rows: sync with each shaping (none, darts, tailbatch, april, sorted), multiversion and multiversion +
darts, on the same workload and seeds. Each figure is the mean over seeds; ratios are against sync
on the same seeds: time per step, rollout tokens/s (generated tokens over the time engines were
generating), the rollout bubble ratio and the trainer's waiting ratio. The simulator's lengths do
not respond to training (its policy never learns to be shorter), so what shows here is the
mechanical effect of shaping alone: the early-stopped tails it never waits for, against the extra
candidates it generates. DARTS' published gains come mostly from the trained policy getting shorter,
which only a real run measures.

`--real` runs `tailrace train` on the built-in model and the default task, sync and sync + darts, one
seed after the other (same seeds both ways), and prints per row the held-out accuracy before and
after, the wall time, and the trained response length p99 of the last step. Runs go to
bench/out/shaping/.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrace.records import EvalRecord, StepRecord, read_metrics  # noqa: E402
from tailrace.sim.scenario import load_scenario, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    ("sync", "none"), ("sync", "darts"), ("sync", "tailbatch"), ("sync", "april"), ("sync", "sorted"),
    ("multiversion", "none"), ("multiversion", "darts"),
]  # fmt: skip
WORKLOADS = {
    # the cpu testbed: the built-in model, chainsum-like lengths (examples/sim-shaping.yaml)
    "cpu": [],
    # a DARTS-sized setup: 7B on H800, 64 prompts x 8, 16k limit, wide per-prompt spread
    "gpu": [
        "--cluster.hardware=h800",
        "--cluster.model=qwen2.5-7b",
        "--cluster.engines=4",
        "--cluster.slots=0",
        "--cluster.trainer_gpus=4",
        "--flow.prompts_per_round=64",
        "--flow.train_batch=512",
        "--train_size=256",
        "--lengths={kind: lognormal, median: 3000, max_len: 16384, sigma_prompt: 0.7, sigma_sample: 0.6, "
        "runaway: 0.02, prompt: 512}",
    ],  # fmt: skip
}


def run(workload: str, mode: str, shaping: str, seed: int, steps: int, sets: tuple[str, ...] = ()) -> dict:
    scn = load_scenario(
        ROOT / "examples" / "sim-shaping.yaml",
        WORKLOADS[workload]
        + [f"--flow.mode={mode}", f"--shaping.name={shaping}", f"--seed={seed}", f"--flow.steps={steps}"]
        + ["--journal=false", *sets],
    )
    return simulate(scn)


def table(workload: str, seeds: int, steps: int, rows: list[tuple[str, str]], sets: tuple[str, ...]) -> None:
    res = {row: [run(workload, *row, seed, steps, sets if row[1] != "none" else ()) for seed in range(seeds)]
           for row in rows}  # fmt: skip

    def mean(row, f):
        return sum(f(s) for s in res[row]) / len(res[row])

    base = ("sync", "none")
    print(
        f"\n{workload}: {seeds} seeds x {steps} steps (simulated){' with ' + ' '.join(sets) if sets else ''}"
    )
    print(
        f"{'mode + shaping':24s} {'s/step':>8s} {'speed-up':>8s} {'gen tok/s':>9s} {'bubble':>7s}"
        f" {'wait':>6s} {'gen tok':>8s} {'shaped %':>8s}"
    )
    for row in rows:
        step = mean(row, lambda s: s["time_per_step_s"])
        gen = mean(row, lambda s: s["gen_tokens"]) / mean(base, lambda s: s["gen_tokens"])
        tps = mean(row, lambda s: s["gen_tok_s"]) / mean(base, lambda s: s["gen_tok_s"])
        shaped = mean(row, lambda s: s["ledger"]["discarded"].get("shaping", 0) / s["ledger"]["produced"])
        print(
            f"{' + '.join(row):24s} {step:8.2f} {mean(base, lambda s: s['time_per_step_s']) / step:7.2f}x"
            f" {tps:8.2f}x {mean(row, lambda s: s['bubble_ratio']):7.2f}"
            f" {mean(row, lambda s: s['trainer_wait_ratio']):6.2f} {gen:7.2f}x {100 * shaped:7.1f}%"
        )


def real(seeds: int, steps: int, eval_n: int) -> None:
    out = ROOT / "bench" / "out" / "shaping"
    rows = {"sync": [], "sync + darts": []}
    for seed in range(seeds):
        for name, extra in (("sync", []), ("sync + darts", ["--shaping.name=darts"])):
            run = out / f"{name.replace(' + ', '-')}-s{seed}-{steps}"
            if not (run / "metrics.jsonl").is_file():
                argv = [sys.executable, "-m", "tailrace.cli", "train", f"--run-dir={run}", f"--seed={seed}",
                        f"--flow.steps={steps}", f"--eval.n={eval_n}", "--task.train_size=1024", *extra]  # fmt: skip
                subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            recs = list(read_metrics(run / "metrics.jsonl"))
            evals = {r.tag: r for r in recs if isinstance(r, EvalRecord)}
            last = [r for r in recs if isinstance(r, StepRecord)][-1]
            rows[name].append(
                (evals["base"].accuracy, evals["final"].accuracy, last.time["wall_s"], last.length["p99"])
            )
    print(
        f"\nreal: built-in model, chainsum, {seeds} seeds x {steps} steps, held-out n = {eval_n} (mean over seeds)"
    )
    print(f"{'mode + shaping':16s} {'accuracy':>16s} {'wall s':>8s} {'speed-up':>8s} {'p99 len':>8s}")
    base = sum(r[2] for r in rows["sync"]) / seeds
    for name, rs in rows.items():
        b, f, w, p = (sum(r[i] for r in rs) / seeds for i in range(4))
        print(f"{name:16s} {100 * b:6.1f}% -> {100 * f:5.1f}% {w:8.1f} {base / w:7.2f}x {p:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    ap.add_argument("--real", action="store_true", help="real runs of sync and sync + darts instead")
    ap.add_argument("--eval-n", type=int, default=256)
    ap.add_argument("--rows", default=None, help="comma list of mode+shaping, e.g. sync+none,sync+sorted")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every shaped row, e.g. --set shaping.over=4 (repeatable)")  # fmt: skip
    a = ap.parse_args()
    rows = [tuple(r.split("+")) for r in a.rows.split(",")] if a.rows else ROWS
    sets = tuple(f"--{kv}" for kv in a.set)
    if a.real:
        real(a.seeds, a.steps, a.eval_n)
        return
    for w in WORKLOADS if a.workload == "both" else [a.workload]:
        table(w, a.seeds, a.steps, rows, sets)


if __name__ == "__main__":
    main()
