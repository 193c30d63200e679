"""A rollout engine in its own process, pinned to its own core(s).

The worker runs the engine's step loop and talks to the driver in batches, never per token: between
steps it drains its inbox (Generate / Abort / LoadWeights / DropWeights / Stop); after a step it
sends what finished, plus aggregated step statistics and busy spans at most every `report_s`.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import torch

from tailrace.engine import Engine, build_engine
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights, Sample
from tailrace.model.checkpoint import load_pretrained
from tailrace.runtime.procs import pin
from tailrace.runtime.weights import SharedWeights
from tailrace.types import GenRequest, GenResult, SamplingParams


@dataclass
class EngineSpec:
    model_path: str
    slots: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    prefill_tokens: int
    threads: int
    cores: tuple[int, ...]
    seed: int
    eos_id: int
    dtype: str = "float32"
    start_version: int = 0
    device: str = "cpu"
    attention: str = "auto"


@dataclass
class Stats:
    """Step statistics accumulated between two reports."""

    steps: int = 0
    busy_s: float = 0.0
    slot_s: float = 0.0  # sum over steps of occupied slots (decoding or prefilling) x step duration
    decode_tokens: int = 0
    prefill_tokens: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)  # merged busy intervals

    def add(self, t0: float, dt: float, active: int, prefill: int, decode: int) -> None:
        self.steps += 1
        self.busy_s += dt
        self.slot_s += active * dt
        self.decode_tokens += decode
        self.prefill_tokens += prefill
        if self.spans and t0 - self.spans[-1][1] < 2e-3:  # merge back-to-back steps into one span
            self.spans[-1] = (self.spans[-1][0], t0 + dt)
        else:
            self.spans.append((t0, t0 + dt))


@dataclass
class EngineReport:
    engine: int
    results: list[GenResult]
    stats: Stats
    loaded: list[tuple[int, float, float]]  # (version, t0, t1) weight loads since the last report
    t: float


def sample_seed(run_seed: int, sample_id: str) -> int:
    """A per-sample seed: the same sample gets the same tokens whatever batch it runs in."""
    return zlib.crc32(f"{run_seed}/{sample_id}".encode()) & 0x7FFFFFFF


def to_request(s: Sample, spec: EngineSpec) -> GenRequest:
    params = SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_new_tokens=spec.max_new_tokens,
        stop_token_ids=(spec.eos_id,),
        seed=sample_seed(spec.seed, s.id),
    )
    return GenRequest(
        id=s.id,
        prompt_ids=s.prompt.token_ids,
        params=params,
        version=s.version,
        resume_ids=s.resume_ids,
        resume_logprobs=s.resume_logprobs,
        resume_versions=s.resume_versions,
    )


def engine_main(
    engine_id: int, spec: EngineSpec, conn, weights: SharedWeights, report_s: float = 0.05
) -> None:
    pin(spec.cores)
    torch.set_num_threads(spec.threads)
    model = load_pretrained(spec.model_path, dtype=getattr(torch, spec.dtype), device=spec.device)
    engine: Engine = build_engine(
        model,
        num_slots=spec.slots,
        prefill_tokens=spec.prefill_tokens,
        device=spec.device,
        seed=spec.seed,
        attention=spec.attention,
    )
    if spec.start_version != 0:
        engine.load_weights(weights.read(spec.start_version).views(), spec.start_version)
        engine.drop_version(0)
    conn.send(("ready", engine_id))
    stats, results, loaded = Stats(), [], []
    last = time.perf_counter()
    while True:
        busy = engine.num_running + engine.num_waiting > 0
        while conn.poll(0 if busy or results else 0.2):
            msg = conn.recv()
            if msg is None:
                return
            if isinstance(msg, tuple) and msg[0] == "eval":  # held-out requests, outside the scheduler
                for req in msg[1]:
                    engine.add(req)
            elif isinstance(msg, Generate):
                for s in msg.samples:
                    engine.add(to_request(s, spec))
            elif isinstance(msg, Abort):  # a sample that finished meanwhile comes back as a normal result
                results.extend(engine.abort(sid) for sid in msg.sample_ids if sid in engine)
            elif isinstance(msg, LoadWeights):
                t0 = time.perf_counter()
                engine.load_weights(weights.read(msg.version).views(), msg.version)
                loaded.append((msg.version, t0, time.perf_counter()))
            elif isinstance(msg, DropWeights):
                engine.drop_version(msg.version)
            busy = engine.num_running + engine.num_waiting > 0
        if busy:
            ev = engine.step()
            # slots occupied this step: the decoding rows and the rows being prefilled (a request's
            # prefill step holds its slot and samples its first token)
            stats.add(ev.t_start, ev.duration, len(set(ev.advanced)), ev.prefill_tokens, ev.decode_tokens)
            results.extend(ev.finished)
        now = time.perf_counter()
        if results or loaded or (stats.steps and now - last >= report_s):
            conn.send(EngineReport(engine_id, results, stats, loaded, now))
            stats, results, loaded, last = Stats(), [], [], now
