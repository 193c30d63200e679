"""The weights' hop of train.external at a real model's size, against the built-in trainer's.

Your trainer's `state_dict()` is laid out as the engines hold it (`client.flatten_weights`) in the
relay's staging file (shared memory), its answer goes over the relay's loopback connection, and the
run's trainer process copies the staging file into the engines' ring. `--pickled` measures instead
what the first version did: the laid-out buffer pickled over the connection. The built-in trainer
does only the ring's part: one memcpy of its flat buffer. Both ends here are real processes on this machine; no model
runs, no engine loads: the seconds a published version costs before an engine can load it.

    .venv/bin/python bench/external_weights.py                  # SmolLM2-135M's shape (538 MB a version)
    .venv/bin/python bench/external_weights.py --built-in       # the built-in model's (0.8M parameters)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tailrace.client import flatten_weights  # noqa: E402
from tailrace.model.config import ModelConfig  # noqa: E402
from tailrace.model.decoder import CausalLM  # noqa: E402
from tailrace.model.flat import flatten_parameters  # noqa: E402
from tailrace.runtime.relay import Stepped, receive, send, staging_file  # noqa: E402
from tailrace.runtime.weights import SharedWeights  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # fmt: skip
BUILT_IN = dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip


def relay_end(address, key, ring: SharedWeights, reps: int, staging: str) -> None:
    """The run's trainer process: receive each version and write it into the ring (one torch thread)."""
    torch.set_num_threads(1)
    conn = Client(address, authkey=key)
    staged = torch.from_file(staging, shared=True, size=ring.buf.shape[1], dtype=ring.buf.dtype)
    for v in range(reps):
        got = receive(conn)
        t0 = time.perf_counter()
        ring.write(v, got if isinstance(got, torch.Tensor) else staged)
        send(conn, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--built-in", action="store_true", help="the built-in model's shape instead")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pickled", action="store_true", help="the weights pickled over the connection")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = BUILT_IN if a.built_in else SMOLLM2_135M
    mine = CausalLM(ModelConfig(**shape))  # your trainer's model
    engines = flatten_parameters(CausalLM(ModelConfig(**shape)))  # the run's layout (and a flat buffer)
    numel = engines.buffer.numel()
    print(f"{numel / 1e6:,.1f}M parameters, {numel * 4 / 1e6:,.0f} MB a version (fp32), {a.reps} versions",
          flush=True)  # fmt: skip
    ring = SharedWeights(engines.layout, numel, slots=3)
    key = os.urandom(32)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    staging = staging_file(Path("/tmp"))
    out = torch.from_file(str(staging), shared=True, size=numel, dtype=torch.float32)
    args = (listener.address, key, ring, a.reps, str(staging))
    child = mp.get_context("spawn").Process(target=relay_end, args=args)
    child.start()
    conn = listener.accept()
    state = mine.state_dict()
    lay, hop, write, total, builtin = [], [], [], [], []
    for v in range(a.reps):
        t0 = time.perf_counter()
        buf = flatten_weights(
            state, engines.layout, numel, torch.float32, "bench", None if a.pickled else out
        )
        t1 = time.perf_counter()
        send(conn, buf if a.pickled else Stepped(v, {}, True, None))
        w = receive(conn)
        t2 = time.perf_counter()
        lay.append(t1 - t0)
        write.append(w)
        hop.append(t2 - t1 - w)
        total.append(t2 - t0)
        s0 = time.perf_counter()
        ring.write(v, engines.buffer)  # the built-in trainer's publish: one memcpy
        builtin.append(time.perf_counter() - s0)
    child.join(timeout=60)
    staging.unlink()

    def med(xs):
        return statistics.median(xs)

    print(f"{'part':<40}{'median s':>10}{'min s':>10}")
    for name, xs in (
        ("laid out (flatten_weights)", lay),
        ("pickled over the connection" if a.pickled else "the answer over the connection", hop),
        ("written into the ring (relay)", write),
        ("train.external, a version in all", total),
        ("built-in trainer (one memcpy)", builtin),
    ):
        print(f"{name:<40}{med(xs):>10.4f}{min(xs):>10.4f}")
    print(f"train.external / built-in: {med(total) / med(builtin):.1f}x the seconds a version costs")


if __name__ == "__main__":
    main()
