"""Engine measurements: decode steps at each batch size, the weight publish and load, and decode
steps alone vs while a trainer computes on the other core."""

from __future__ import annotations

import statistics
import time

from tailrace.calibrate.trainer import train_loop
from tailrace.calibrate.workers import measure_worker
from tailrace.engine import build_engine
from tailrace.model.decoder import CausalLM
from tailrace.types import GenRequest, SamplingParams


def measure_decode(
    model: CausalLM, batches=(1, 2, 4, 8, 16, 32, 64), length: int = 192, prompt: int = 16, repeats: int = 2
) -> list[tuple[int, int, float]]:
    """(batch, context tokens, step seconds) of pure decode steps."""
    rows = []
    for b in batches:
        for rep in range(repeats):
            eng = build_engine(model, num_slots=max(batches), prefill_tokens=4096, seed=rep)
            params = SamplingParams(max_new_tokens=length, min_new_tokens=length)
            for i in range(b):
                eng.add(GenRequest(f"{b}.{rep}.{i}", tuple([5] * prompt), params))
            k = 0
            while eng.num_running + eng.num_waiting:
                ev = eng.step()
                if ev.prefill_tokens == 0 and ev.active == b:
                    rows.append((b, b * (prompt + k), ev.duration))
                k += 1
    return rows


def measure_weights(model: CausalLM, repeats: int = 5) -> dict:
    from tailrace.model.flat import flatten_parameters
    from tailrace.runtime.weights import SharedWeights

    flat = flatten_parameters(model)
    ring = SharedWeights.like(flat, slots=2)
    eng = build_engine(model, num_slots=4)
    pub, load = [], []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        ring.write(v, flat.buffer)
        t1 = time.perf_counter()
        eng.load_weights(ring.read(v).views(), v)
        t2 = time.perf_counter()
        eng.drop_version(v - 1) if v > 1 else None
        pub.append(t1 - t0)
        load.append(t2 - t1)
    return {
        "bytes": flat.buffer.numel() * flat.buffer.element_size(),
        "publish_s": statistics.median(pub),
        "load_s": statistics.median(load),
    }


def measure_corun(model: CausalLM, batch: int = 8, samples: int = 96, pairs: int = 4) -> dict:
    """How much longer a step of the engine worker (`measure_worker`: `batch` slots, `samples` requests)
    takes while a trainer (in the model's dtype) computes on another core
    of this host (the runtime's placement: engine and trainer pinned apart): shared memory bandwidth,
    last-level cache, and, where the two vCPUs are hyperthreads of one core, its execution units.
    Alone and co-running alternate `pairs` times (the machine's speed drifts; a ratio of neighbours
    does not), the median ratio wins. 1.0 where there is a single core (the roles then time-share it,
    which the simulator does not model)."""
    from tailrace.runtime.procs import available_cores, context, pin, placement

    cores = available_cores()
    if len(cores) < 2:
        return {"slowdown": 1.0, "alone_s": None, "corun_s": None}
    train_cores, engine_cores = placement(1)
    pin(engine_cores[0])
    ctx = context()
    stop, ready, go, computing = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(
        target=train_loop,
        args=(train_cores, stop, ready, go, computing, model.model.embed_tokens.weight.dtype),
        daemon=True,
    )
    child.start()
    alone, corun = [], []
    try:
        if not ready.wait(timeout=120):
            raise RuntimeError("calibrate: the co-running trainer did not start within 120 s")

        def worker_step_s() -> float:  # busy time per step of the runtime's engine worker
            return measure_worker(model, slots=batch, samples=samples)["mean_step_s"]

        for _ in range(pairs):
            go.clear()
            deadline = time.monotonic() + 120
            while computing.is_set() and time.monotonic() < deadline:  # the step in flight ends first
                time.sleep(0.01)
            alone.append(worker_step_s())
            go.set()
            if not computing.wait(timeout=120):
                raise RuntimeError("calibrate: the co-running trainer did not start within 120 s")
            corun.append(worker_step_s())
    finally:
        stop.set()
        go.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        pin(tuple(cores))
    ratio = statistics.median(c / a for a, c in zip(alone, corun))
    return {
        "slowdown": max(1.0, ratio),
        "alone_s": statistics.median(alone),
        "corun_s": statistics.median(corun),
        "ratios": [c / a for a, c in zip(alone, corun)],
    }
