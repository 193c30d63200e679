"""Memory of a run of 4 LoRA tenants on a 106M model: every process's proportional set size (PSS: shared
pages split among the processes that map them), summed, at its peak and once every tenant has done 2
steps (the median of the samples after that).

    .venv/bin/python bench/lora_memory.py RUN_DIR [MODEL_DIR] [--no-share]

MODEL_DIR defaults to /tmp/smolshape: a random model of SmolLM2-135M's shape with the built-in
character vocabulary (bench/README.md says how it was made); its bf16 copy, /tmp/smolshape-bf16, is
`save_pretrained(load_pretrained("/tmp/smolshape").to(torch.bfloat16), ...)`. The trainers hold one copy of
the frozen base (runtime/shared_base.py); `--no-share` runs the same command with `Driver._shared_base` answering
None, so each trainer loads its own base (the comparison).
"""

import json
import shutil
import subprocess
import sys
import time

import psutil

args = [a for a in sys.argv[1:] if a != "--no-share"]
run = args[0]
model = args[1] if len(args) > 1 else "/tmp/smolshape"
shutil.rmtree(run, ignore_errors=True)
# one-digit answers: a random model's last digit is right now and then, so groups have signal and the
# trainers train (their activations counted too); chainsum would give it no reward at all
digits = run + ".digits.jsonl"
with open(digits, "w") as f:
    f.writelines(
        json.dumps({"question": f"q{i}: a={i % 9 + 1} b=0. a+b?", "answer": str(i % 9 + 1)}) + "\n"
        for i in range(200)
    )
UNSHARED = (  # the CLI, its driver's shared base switched off
    "import sys; from tailrace.runtime.driver import Driver; from tailrace.cli import main\n"
    "def none(self, shared, device):\n    self._base_bf16 = None\n    return None\n"
    "Driver._shared_base = none; sys.exit(main(sys.argv[1:]))"
)
cli = [sys.executable, "-c", UNSHARED] if "--no-share" in sys.argv else [sys.executable, "-m", "tailrace.cli"]
argv = [
    *cli,
    "train",
    f"--model.path={model}",
    f"--run-dir={run}",
    f"--task.name=jsonl:{digits}",
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
trained = sum(
    json.loads(line)["train"].get("tokens", 0) > 0
    for n in "abcd"
    for line in open(f"{run}/policies/{n}/metrics.jsonl")
    if '"kind":"step"' in line
)
print(
    f"{run}: peak total PSS {peak / 2**20:.0f} MB; after 2 steps each: median {steady:.0f} MB "
    f"({len(samples)} samples); {trained} of 16 steps trained tokens"
)
