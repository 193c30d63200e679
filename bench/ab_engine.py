"""The engine of this tree against the engine of another git revision, side by side in one run.

    .venv/bin/python bench/ab_engine.py --rev f5286ae            # default: fp32 and bf16, batch 1 and 64
    .venv/bin/python bench/ab_engine.py --rev HEAD~3 --batches 1,8,64 --rounds 8
    .venv/bin/python bench/ab_engine.py --rev main --workload cb --batches 512   # continuous batching
    .venv/bin/python bench/ab_engine.py --rev HEAD --new-options block_size=32    # a setting vs the default
    .venv/bin/python bench/ab_engine.py --rev main --options attention=bmm        # both on the torch backend
    .venv/bin/python bench/ab_engine.py --rev main --model DIR --dtypes bfloat16 --batches 32,64  # a real model

For refactors that must not change speed (or outputs): one worker process per tree (the revision is
exported with `git archive` to a temporary directory), both loading the same checkpoint, one torch
thread each. The driver asks them in turn, call by call, to run the same seeded `generate` (`batch`
requests of 16-token prompts, exactly `--new-tokens` tokens each), so the machine's drift over minutes
falls on both alike. Printed per configuration: tokens/s of each (median over rounds), new/old for wall
time and for the worker's CPU time, and whether the two produced the same tokens and logprobs (a
hash of every request's output): a pure refactor must say `same`. `--workload cb`: `batch` requests of
bench/engine.py's continuous-batching workload (lognormal lengths through 64 slots) per call instead.
`--options k=v,...`: engine options for both sides; `--new-options`: for this tree's side only, to
compare a setting with the revision's default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside each tree's worker process: builds the engine the way that tree spells it (plus the JSON
# options of argv[2]), then serves "workload dtype batch new_tokens seed" lines with one JSON line each
# (wall s, cpu s, tokens, output hash).
WORKER = r"""
import hashlib, json, random, sys, time
import torch
torch.set_num_threads(1)
from tailrace.model.checkpoint import load_pretrained
from tailrace.types import GenRequest, SamplingParams
try:
    from tailrace.engine import build_engine as make
except ImportError:
    from tailrace.engine.engine import Engine as make
model_dir, options = sys.argv[1], json.loads(sys.argv[2])
engines = {}
for line in sys.stdin:
    workload, dtype, batch, new, seed = line.split()
    batch, new, seed = int(batch), int(new), int(seed)
    if dtype not in engines:
        m = load_pretrained(model_dir, dtype=getattr(torch, dtype))
        engines[dtype] = make(m, num_slots=64, seed=0, **options)
    eng = engines[dtype]
    rng = random.Random(1 if workload == "cb" else seed)  # cb: bench/engine.py's requests every round
    V = eng.vocab_size
    if workload == "cb":
        from bench.engine import cb_workload
        reqs = cb_workload(batch, V, rng)
    else:
        reqs = [GenRequest(f"r{seed}-{i}", tuple(rng.randrange(4, V) for _ in range(16)),
                           SamplingParams(max_new_tokens=new, min_new_tokens=new, seed=seed * 1000 + i))
                for i in range(batch)]
    t0, c0 = time.perf_counter(), time.process_time()
    out = eng.generate(reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    h = hashlib.sha256(repr([(r.token_ids, r.logprobs) for r in out]).encode()).hexdigest()[:16]
    n = sum(len(r.token_ids) for r in out)
    print(json.dumps({"wall": wall, "cpu": cpu, "tokens": n, "hash": h}), flush=True)
"""


def export(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def start(tree: Path, model_dir: str, options: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, model_dir, json.dumps(options)], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, cwd=tree,
    )  # fmt: skip


def ask(p: subprocess.Popen, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    reply = p.stdout.readline()
    if not reply:
        raise RuntimeError(f"a worker died on {line!r}; run it alone to see its error")
    return json.loads(reply)


def _options(text: str) -> dict:
    """`k=v,...` as engine keyword arguments (integer values as ints)."""
    pairs = (kv.split("=", 1) for kv in text.split(",") if kv)
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare against (the 'old' side)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6, help="timed calls per side and configuration")
    ap.add_argument("--workload", choices=("fixed", "cb"), default="fixed")
    ap.add_argument("--options", default="", help="engine options for both sides: k=v,...")
    ap.add_argument("--new-options", default="", help="engine options for this tree's side only: k=v,...")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the built-in model)")
    a = ap.parse_args(argv)
    both, new_only = _options(a.options), _options(a.new_options)
    sys.path.insert(0, str(ROOT))
    from bench.engine import default_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old").mkdir()
        old_tree = export(a.rev, Path(tmp) / "old")
        model_dir = a.model or default_model_dir(tmp)
        sides = {"new": start(ROOT, model_dir, both | new_only), "old": start(old_tree, model_dir, both)}
        load = os.getloadavg()[0]
        print(
            f"new = this tree {new_only or ''}, old = {a.rev}; {a.workload} workload {both or ''}; "
            f"load average {load:.1f}"
        )
        print(f"{'dtype':8} {'batch':>5} {'new tok/s':>10} {'old tok/s':>10} {'wall':>6} {'cpu':>6}  outputs")
        try:
            for dtype in a.dtypes.split(","):
                for batch in map(int, a.batches.split(",")):
                    runs = {k: [] for k in sides}
                    for r in range(a.rounds + 1):  # round 0 warms up (and builds the engines)
                        order = ("new", "old") if r % 2 else ("old", "new")
                        for k in order:
                            res = ask(sides[k], f"{a.workload} {dtype} {batch} {a.new_tokens} {r}")
                            if r:
                                runs[k].append(res)

                    def med(k, f):
                        return statistics.median(x[f] for x in runs[k])

                    same = all(n["hash"] == o["hash"] for n, o in zip(runs["new"], runs["old"]))
                    tokens = med("new", "tokens")  # the same in every round and on both sides
                    print(
                        f"{dtype:8} {batch:5d} {tokens / med('new', 'wall'):10,.0f} "
                        f"{tokens / med('old', 'wall'):10,.0f} {med('old', 'wall') / med('new', 'wall'):5.3f}x "
                        f"{med('old', 'cpu') / med('new', 'cpu'):5.3f}x  {'same' if same else 'DIFFERENT'}",
                        flush=True,
                    )
        finally:
            for p in sides.values():
                p.stdin.close()
                p.wait(timeout=30)
    print("wall, cpu: old time / new time (above 1: this tree is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
