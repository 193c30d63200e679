"""The weight path, trainer -> engines: measured here for 1, 2 and 4 engine processes and each
transport, and the simulator's model of it at cluster scale, both with the bytes moved per version.

    .venv/bin/python bench/weights.py                        # both (the real part: ~2 min on 2 cores)
    .venv/bin/python bench/weights.py --model DIR --dtype bfloat16 --steps 3   # a local HF checkpoint (SmolLM2-135M)
    .venv/bin/python bench/weights.py --engines 1 --transports ring,object_store,collective   # Ray's two too
    .venv/bin/python bench/weights.py --sim                  # the model only (seconds)
    .venv/bin/python bench/weights.py --runs RUN_DIR...      # the same columns for runs made elsewhere

Real: `tailrace train` in sync mode for a few steps with N engines, the same run per transport:
`ring` (the local runtime's shared-memory ring), `object_store` and `collective` (`runtime.kind=ray`
with that `runtime.weights`; a Ray actor reserves a CPU, so on 2 cores only 1 engine fits). From
events.jsonl, per published version after the first: the trainer's publish span (into the ring; a
put into the object store; a broadcast beside that put), each engine's receive span (the collective's
thread, beside the engine's work) and load span (into its own weights). Bytes per version: the flat
buffer the trainer publishes (parameters x dtype size).

Simulated: Qwen2.5-32B on H800 engines of 4 GPUs, from 1 to 256 engines (4 to 1,024 rollout GPUs),
the trainer on 32 GPUs: a new version's load time per engine with a pipelined broadcast tree (NCCL's:
the bytes cross each link once, each tree level adds a 4 MiB chunk and a hop) and flat (the trainer's
NICs send every engine its own copy), `sim/costs.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrace.sim.costs import CostModel  # noqa: E402
from tailrace.sim.hardware import GPUS  # noqa: E402
from tailrace.sim.models import MODELS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--flow.prompts_per_round=8", "--flow.samples_per_prompt=4", "--flow.train_batch=32",
         "--rollout.max_new_tokens=64", "--eval.n=8", "--flow.checkpoint_every=1000"]  # fmt: skip


TRANSPORTS = {
    "ring": [],
    "object_store": ["--runtime.kind=ray", "--runtime.weights=object_store"],
    "collective": ["--runtime.kind=ray", "--runtime.weights=collective"],
}


HEADER = f"{'MB/version':>10s} {'publish s':>10s} {'receive s':>10s} {'load s mean':>11s} {'load s max':>10s}"


def real(engines: list[int], transports: list[str], steps: int, extra: list[str]) -> None:
    print(
        f"\nmeasured: sync, {steps} steps, per version after the first (mean / max over versions and engines)"
    )
    print(f"{'engines':>7s} {'transport':>12s} {HEADER}")
    for n in engines:
        for transport in transports:
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "run"
                argv = [sys.executable, "-m", "tailrace.cli", "train", f"--run-dir={run}", "--flow.mode=sync",
                        f"--flow.steps={steps}", f"--rollout.engines={n}", *SMALL, *TRANSPORTS[transport],
                        *extra]  # fmt: skip
                done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{transport}, {n} engine(s): the run failed (exit {done.returncode}):\n"
                             + "\n".join((done.stdout + done.stderr).splitlines()[-15:]))  # fmt: skip
                print(f"{n:7d} {transport:>12s} {row(run)}", flush=True)


def row(run: Path) -> str:
    """A run's weight path per version after the first: MB, the trainer's publish, each engine's
    receive (a collective's) and load, from its events.jsonl."""
    spans = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    spans = [s for s in spans if s.get("phase") in ("sync", "receive") and s.get("version", 0) > 1]
    pub = [s["t1"] - s["t0"] for s in spans if s["lane"] == "trainer"]
    engine = [s for s in spans if s["lane"].startswith("engine")]
    load = [s["t1"] - s["t0"] for s in engine if s["phase"] == "sync"]
    got = [s["t1"] - s["t0"] for s in engine if s["phase"] == "receive"]
    receive = f"{statistics.mean(got):10.3f}" if got else f"{'-':>10s}"
    return (f"{flat_bytes(run) / 1e6:10.1f} {statistics.mean(pub):10.3f} {receive} {statistics.mean(load):11.3f} "
            f"{max(load):10.3f}")  # fmt: skip


def runs(dirs: list[str]) -> None:
    """The same columns for runs made elsewhere (bench/modes.py's, one per runtime)."""
    from tailrace.config import load_config
    from tailrace.records import StepRecord, read_metrics

    print("\nper version after the first (mean / max over versions and engines)")
    print(f"{'run':>40s} {'weights':>12s} {'wall s':>7s} {HEADER}")
    for d in map(Path, dirs):
        cfg = load_config(d / "config.yaml")
        how = "ring" if cfg.runtime.kind == "local" else cfg.runtime.weights
        steps = [r for r in read_metrics(d / "metrics.jsonl") if isinstance(r, StepRecord)]
        print(f"{str(d)[-40:]:>40s} {how:>12s} {steps[-1].time['wall_s']:7.1f} {row(d)}", flush=True)


def flat_bytes(run: Path) -> int:
    """Bytes of one published version: a slot of the shared-memory ring, the trainer's flat buffer."""
    from tailrace.config import load_config
    from tailrace.runtime.session import Session

    cfg = load_config(run / "config.yaml")
    ses = Session(cfg)
    try:
        flat = ses.flat_layout()
        return flat.buffer.numel() * flat.buffer.element_size()
    finally:
        ses.close()


def simulated() -> None:
    model = MODELS["qwen2.5-32b"]
    one = CostModel(GPUS["h800"], model, engine_gpus=4, trainer_gpus=32)
    print(f"\nsimulated: {model.name}, {one.weight_bytes / 1e9:.1f} GB a version, H800 engines of 4 GPUs "
          f"(4 x 400 Gb/s NICs), trainer on 32 GPUs")  # fmt: skip
    print(f"{'engines':>7s} {'GPUs':>5s} {'tree s':>7s} {'flat s':>7s} {'flat/tree':>9s} {'TB moved':>9s}")
    for e in (1, 2, 4, 8, 16, 64, 256):
        tree = dataclasses.replace(one, engines=e)
        flat = dataclasses.replace(one, engines=e, broadcast="flat")
        print(f"{e:7d} {4 * e:5d} {tree.load_time():7.2f} {flat.load_time():7.2f} "
              f"{flat.load_time() / tree.load_time():8.1f}x {e * one.weight_bytes / 1e12:9.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--transports", default="ring", help=f"comma-separated, of {', '.join(TRANSPORTS)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sim", action="store_true", help="the simulated table only")
    ap.add_argument("--runs", nargs="+", default=None, help="summarize these run directories instead")
    ap.add_argument("--model", default=None, help="a local HF checkpoint (default: the built-in model)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--lora", type=int, default=0, help="train.lora.rank: the trainer publishes its adapter")
    a = ap.parse_args()
    if a.runs:
        return runs(a.runs)
    if unknown := set(a.transports.split(",")) - set(TRANSPORTS):
        ap.error(f"--transports: {', '.join(sorted(unknown))}: use {', '.join(TRANSPORTS)}")
    if not a.sim:
        extra = [f"--model.path={a.model}"] if a.model else []
        extra += [f"--model.dtype={a.dtype}"] if a.dtype else []
        extra += [f"--train.lora.rank={a.lora}"] if a.lora else []
        real([int(x) for x in a.engines.split(",")], a.transports.split(","), a.steps, extra)
    simulated()


if __name__ == "__main__":
    main()
