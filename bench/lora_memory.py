"""Memory of a run of 4 LoRA tenants on a 106M model: every process's proportional set size (PSS: shared
pages split among the processes that map them), summed, at its peak and once every tenant has done 2
steps (the median of the samples after that).

    .venv/bin/python bench/lora_memory.py RUN_DIR [MODEL_DIR]

MODEL_DIR defaults to /tmp/smolshape: a random model of SmolLM2-135M's shape with the built-in
character vocabulary (bench/README.md says how it was made). The trainers share one copy of the frozen
base (runtime/shared_base.py); the comparison without it was made by disabling `Driver._shared_base`
for one run (bench/README.md).
"""

import shutil
import subprocess
import sys
import time

import psutil

run = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "/tmp/smolshape"
shutil.rmtree(run, ignore_errors=True)
argv = [
    "/work/main/.venv/bin/tailrace",
    "train",
    f"--model.path={model}",
    f"--run-dir={run}",
    "--train.lora.rank=8",
    "--train.bf16=true",
    "--flow.mode=sync",
    "--flow.steps=4",
    "--flow.prompts_per_round=2",
    "--flow.samples_per_prompt=4",
    "--flow.train_batch=8",
    "--rollout.max_new_tokens=16",
    "--rollout.slots=8",
    "--eval.n=4",
    "--eval.max_new_tokens=16",
    "--policies=[{name: a}, {name: b, seed: 1}, {name: c, seed: 2}, {name: d, seed: 3}]",
]
p = subprocess.Popen(argv, stdout=open(run + ".log", "w"), stderr=subprocess.STDOUT)


def steps():
    try:
        return min(
            sum('"kind":"step"' in l for l in open(f"{run}/policies/{n}/metrics.jsonl")) for n in "abcd"
        )
    except OSError:
        return 0


peak = 0
samples = []
while p.poll() is None:
    procs = [psutil.Process(p.pid)] + psutil.Process(p.pid).children(recursive=True)
    tot = 0
    for q in procs:
        try:
            tot += q.memory_full_info().pss
        except psutil.Error:
            pass
    peak = max(peak, tot)
    if steps() >= 2:
        samples.append(tot)
    time.sleep(0.3)
steady = sorted(samples)[len(samples) // 2] / 2**20
print(
    f"{run}: peak total PSS {peak / 2**20:.0f} MB; after 2 steps each: median {steady:.0f} MB ({len(samples)} samples)"
)
