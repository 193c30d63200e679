"""Ray's two weight transports alone, on bare actors: a trainer actor publishes a flat fp32 buffer of
N parameters per version and an engine actor loads it (reads it and converts it to bf16, as a bf16
engine's load does), through the object store (runtime/ray_weights.py) and through the collective
(runtime/ray_collective.py: a gloo broadcast into the engine's own ring, then the same put), with
the broadcast alone beside it. No model, no run: the figures of a big model's version in seconds.

    .venv/bin/python bench/ray_weights.py                       # SmolLM2-135M's size (538 MB a version)
    .venv/bin/python bench/ray_weights.py --params 800000 --versions 8   # the built-in model's
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402

from tailrace.model.flat import FlatWeights  # noqa: E402
from tailrace.runtime.ray_collective import Collective  # noqa: E402
from tailrace.runtime.ray_weights import StoreWeights  # noqa: E402


class End:
    """An actor holding one worker's end of a transport (one torch thread, as a worker's seat)."""

    def __init__(self, end) -> None:
        self.end = end
        torch.set_num_threads(1)

    def in_group(self) -> bool:
        return self.end.group is not None

    def publish(self, version: int, numel: int, bare: bool = False) -> float:
        buf = torch.full((numel,), float(version))
        t0 = time.perf_counter()
        if bare:  # the broadcast alone, without the put that follows it in `write`
            for work in self.end._send(version, buf):
                work.wait()
        else:
            self.end.write(version, buf)
        return time.perf_counter() - t0

    def load(self, version: int) -> float:
        t0 = time.perf_counter()
        self.end.read(version).buffer.to(torch.bfloat16)
        return time.perf_counter() - t0

    def received(self) -> list[float]:
        return [t1 - t0 for _, t0, t1 in self.end.arrivals()]


def measure(name: str, trainer, engine, numel: int, versions: int, bare: bool = False) -> None:
    pub, load = [], []
    for v in range(1, versions + 1):
        pub.append(ray.get(trainer.publish.remote(v, numel, bare)))
        if not bare:
            load.append(ray.get(engine.load.remote(v)))
    cells = [f"{statistics.median(x):6.3f} / {min(x):5.3f}" if x else f"{'-':>14s}"
             for x in (pub, ray.get(engine.received.remote()), load)]  # fmt: skip
    print(f"{name:>16s} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--params", type=int, default=134_515_008, help="parameters a version (default: SmolLM2-135M's)"
    )
    ap.add_argument("--versions", type=int, default=4)
    a = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
    flat = FlatWeights(torch.zeros(a.params), (("w", (a.params,), 0),))
    actor = ray.remote(End).options(num_cpus=1)
    print(f"{a.params * 4 / 1e6:.1f} MB a version (fp32), {a.versions} versions, seconds (median / min)")
    print(f"{'transport':>16s} {'publish':>14s} {'receive':>14s} {'load':>14s}")
    store = StoreWeights.like(ray, flat, slots=3)
    trainer, engine = actor.remote(store), actor.remote(store)
    measure("object_store", trainer, engine, a.params, a.versions)
    ray.kill(trainer), ray.kill(engine), ray.kill(store.registry)  # its versions leave the store
    coll = Collective(StoreWeights.like(ray, flat, slots=3), a.params, "127.0.0.1", 2, "cpu")
    trainer, engine = actor.remote(coll.end("trainer", True)), actor.remote(coll.end("engine0", True))
    while not ray.get(trainer.in_group.remote()):
        time.sleep(0.05)
    measure("collective", trainer, engine, a.params, a.versions)
    measure("broadcast alone", trainer, engine, a.params, a.versions, bare=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
