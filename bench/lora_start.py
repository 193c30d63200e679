"""What a LoRA run's start costs for its frozen base, with `lora.exactly_in`'s head check and without
it, taking turns in one process: the driver's `shared_base.share` (which tensors go to shared memory in
bf16) and a bf16 LoRA trainer's `store_frozen_projections` on the model it loads (mapped from the
checkpoint where stored in fp32). Both ask, weight by weight, whether bf16 holds it exactly; a trained
fp32 weight is not held, and the head check says so from its first 4,096 values instead of converting
the whole weight (and reading every page of a mapped one).

    .venv/bin/python bench/lora_start.py MODEL_DIR --repeats 3

Printed: each side's seconds (median of the repeats) for share and for the trainer's store, and
whole/head. The page cache is warm after the first read, so a cold start (a file read from disk) gains
more than this shows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tailrace.config.train import LoraConfig  # noqa: E402
from tailrace.model import lora  # noqa: E402
from tailrace.model.checkpoint import load_pretrained  # noqa: E402
from tailrace.runtime import shared_base  # noqa: E402

ORIGINAL = lora.exactly_in  # with its head check


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one(model_dir: str, head: int | None) -> tuple[float, float]:
    """(share s, store s) with exactly_in's head check (head None) or without it (a whole weight)."""
    exact = lora.exactly_in if head is None else functools.partial(ORIGINAL, head=head)
    lora.exactly_in = shared_base.exactly_in = exact
    try:
        cfg = LoraConfig(rank=8)
        share_s = timed(lambda: shared_base.share(model_dir, cfg, bf16=True))
        model = lora.attach(load_pretrained(model_dir, dtype=torch.float32), cfg)
        store_s = timed(lambda: lora.store_frozen_projections(model, torch.bfloat16))
        return share_s, store_s
    finally:
        lora.exactly_in = shared_base.exactly_in = ORIGINAL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as a trainer on one core of a small machine
    one(a.model_dir, None)  # the page cache warm for both sides
    runs: dict[str, list[tuple[float, float]]] = {"head": [], "whole": []}
    for _ in range(a.repeats):
        runs["whole"].append(one(a.model_dir, 1 << 62))
        runs["head"].append(one(a.model_dir, None))
    med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in runs.items()}
    for k in ("whole", "head"):
        print(f"{k:6s} share {med[k][0]:.3f} s   trainer store {med[k][1]:.3f} s")
    print(
        f"whole/head: share {med['whole'][0] / med['head'][0]:.1f}x, store {med['whole'][1] / med['head'][1]:.1f}x"
    )


if __name__ == "__main__":
    main()
