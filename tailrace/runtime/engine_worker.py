"""A rollout engine in its own process, pinned to its own core(s).

The worker runs the engine's step loop and talks to the driver in batches, never per token: between
steps it drains its inbox (Generate / Abort / LoadWeights / DropWeights / History / Shutdown); after a step it
sends what finished, plus aggregated step statistics and busy spans at most every `report_s`. With no
request to run it gives the engine its idle time in slices (`Engine.idle`: a trained drafter learns,
within its budget per idle period), polling the inbox between them.
Requests arrive as the engine's own `GenRequest`s (built once, by the scheduler or the evaluator).
A replacement for a lost engine starts holding the versions its predecessor held (`start_versions`),
read from the shared-memory ring, or from a checkpoint for one the ring no longer holds. In a LoRA run
(`lora_alpha`) the versions are adapters over the model it loads (`engine.adapter_versions`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.engine import Engine, build_engine
from tailrace.engine.adapter_versions import AdapterVersions
from tailrace.engine.spec import SpecOptions
from tailrace.flow.commands import Abort, DropWeights, Generate, LoadWeights
from tailrace.model.checkpoint import load_pretrained, read_config
from tailrace.model.flat import flatten_parameters
from tailrace.model.lora import ADAPTER_DIR, load_peft
from tailrace.runtime.messages import EngineReport, Go, History, Ready, Shutdown, Stats
from tailrace.runtime.procs import pin, release_memory
from tailrace.runtime.weights import SharedWeights, Torn, VersionGone
from tailrace.runtime.workers import serving

IDLE_SLICE_S = 0.05  # drafter training per call while the engine is idle, between polls of the inbox


@dataclass
class EngineSpec:
    model_path: str
    slots: int
    prefill_tokens: int
    threads: int
    cores: tuple[int, ...]
    seed: int
    dtype: str = "float32"
    start_versions: tuple[int, ...] = (
        0,
    )  # the versions it holds when Ready (0: the model it loads; none: joined)
    from_disk: tuple[tuple[int, str], ...] = ()  # (version, checkpoint model dir) the ring no longer holds
    device: str = "cpu"
    attention: str = "auto"
    max_context: int | None = None
    expected_context: int | None = None  # tokens a request holds at most: sizes the KV pool
    kv_memory_gb: float | None = None
    spec: SpecOptions | None = None  # speculative decoding (None: off)
    backend: str = "tailrace"  # rollout.backend: tailrace's engine, or vLLM (which loads model_path itself)
    gated: bool = False  # wait for `Go` before loading the model (started alongside the trainer)
    keep_finished: bool = False  # keep finished requests' k/v for their continuations (tool turns)
    max_versions: int | None = None  # rollout.max_versions (tailrace's engine; vLLM holds one regardless)
    lora_alpha: float | None = None  # train.lora: versions are adapters over the model (None: whole weights)
    lora_init: str | None = None  # train.lora.init: the adapter of version 0 (None: the model itself)
    lora_rank: int = 0  # train.lora.rank: vLLM's LoRA slots are sized to it (tailrace's engine needs nothing)
    max_adapters: int = 4  # vLLM: versions (adapters) whose rows share one step
    routes: bool = False  # train.routing_replay: results carry an MoE's routes (tailrace's engine)


def engine_main(
    conn, counter, engine_id: int, spec: EngineSpec, weights: SharedWeights, report_s: float = 0.05
) -> None:
    with serving(conn, counter):
        _serve(engine_id, spec, conn, weights, report_s)


def _serve(engine_id: int, spec: EngineSpec, conn, weights: SharedWeights, report_s: float) -> None:
    pin(spec.cores)
    torch.set_num_threads(spec.threads)
    if spec.gated and not isinstance(msg := conn.recv(), Go):
        if isinstance(msg, Shutdown):
            return
        raise TypeError(f"engine {engine_id}: expected Go before start-up, got {type(msg).__name__}")
    engine = _build(spec)
    print(f"engine {engine_id}: {engine.describe()}", flush=True)
    if spec.lora_alpha is not None:
        engine = AdapterVersions(engine, spec.lora_alpha)
    disk = dict(spec.from_disk)
    # the base's config splits Phi-3's fused adapters (load_peft)
    base = read_config(spec.model_path) if spec.lora_alpha is not None else None
    for v in spec.start_versions:
        if v in disk and isinstance(engine, AdapterVersions):  # the checkpoint's adapter/, beside model/
            engine.load_adapter_version(load_peft(Path(disk[v]).parent / ADAPTER_DIR, base), v)
        elif v == 0 and spec.lora_init is not None and isinstance(engine, AdapterVersions):
            engine.load_adapter_version(load_peft(spec.lora_init, base), 0)
        elif v in disk:
            flat = flatten_parameters(load_pretrained(disk[v], dtype=torch.float32, device=spec.device))
            engine.load_weights(flat.views(), v)
        elif v != 0:
            _load(engine, weights, v)  # Torn: this process fails, and the driver replaces it again
    # an engine that joined a run starts holding none of the run's versions: the model it loaded stays
    # as a placeholder (an engine never holds nothing) until the first version it is asked to load
    placeholder = 0 if not spec.start_versions else None
    if spec.start_versions and 0 not in spec.start_versions and 0 in engine.versions:
        engine.drop_version(0)  # (unless a one-version engine replaced it)
        release_memory()
    conn.send(Ready(max(spec.start_versions, default=-1)))  # -1: none (an engine that joined a run)
    stats, results, loaded, missed = Stats(), [], [], []
    last = time.perf_counter()
    learning = False  # a trained drafter used the last idle slice: the inbox is polled between slices
    while True:
        busy = engine.num_running + engine.num_waiting > 0
        # an idle engine waits for its inbox, but not with a report to send: a load's report held back
        # by the wait delayed every sync round by the wait's length
        while conn.poll(0 if busy or results or learning or loaded or missed else 0.2):
            msg = conn.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Generate):
                for req in msg.requests:
                    engine.add(req)
            elif isinstance(msg, Abort):  # a request that finished meanwhile comes back as a normal result
                results.extend(engine.abort(rid) for rid in msg.request_ids if rid in engine)
            elif isinstance(msg, LoadWeights):
                t0 = time.perf_counter()
                fresh = msg.version not in engine.versions
                try:
                    _load(engine, weights, msg.version)
                except Torn:  # overwritten while copied: unloaded where the engine holds another version
                    if not fresh or len(engine.versions) == 1:
                        raise
                    engine.drop_version(msg.version)
                    missed.append(msg.version)
                    continue
                except VersionGone:  # newer versions replaced it before this engine read it
                    missed.append(msg.version)
                    continue
                if placeholder not in (None, msg.version) and placeholder in engine.versions:
                    engine.drop_version(placeholder)
                    release_memory()
                placeholder = None
                loaded.append((msg.version, t0, time.perf_counter()))
            elif isinstance(msg, DropWeights):
                engine.drop_version(msg.version)
                release_memory()
            elif isinstance(msg, History):
                for prompt, tokens in msg.responses:
                    engine.add_history(prompt, tokens)
            else:
                raise TypeError(f"engine {engine_id}: unexpected message {type(msg).__name__}")
            busy = engine.num_running + engine.num_waiting > 0
        if busy:
            ev = engine.step()
            # slots occupied this step: the decoding rows and the rows being prefilled (a request's
            # prefill step holds its slot and samples its first token)
            stats.add(ev.t_start, ev.duration, len(set(ev.advanced)), ev.prefill_tokens, ev.decode_tokens)
            stats.add_spec(ev)
            results.extend(ev.finished)
        else:
            done = engine.idle(IDLE_SLICE_S)
            learning = done is not None
            if learning:
                stats.add_training(done)
        now = time.perf_counter()
        if results or loaded or missed or ((stats.steps or stats.train[0]) and now - last >= report_s):
            conn.send(EngineReport(engine_id, results, stats, loaded, now, weights.arrivals(), missed))
            stats, results, loaded, missed, last = Stats(), [], [], [], now


def _build(spec: EngineSpec) -> Engine:
    """The engine serving the checkpoint as version 0: vLLM loads it itself, tailrace's engine gets the
    model (the engine holds it; it is dropped with version 0 when the engine starts without it)."""
    common = dict(
        num_slots=spec.slots,
        prefill_tokens=spec.prefill_tokens,
        seed=spec.seed,
        max_context=spec.max_context,
        kv_memory_gb=spec.kv_memory_gb,
    )
    if spec.backend == "vllm":
        return build_engine(
            spec.model_path, backend="vllm", dtype=spec.dtype, threads=spec.threads, lora_rank=spec.lora_rank,
            max_adapters=spec.max_adapters, **common,
        )  # fmt: skip
    model = load_pretrained(spec.model_path, dtype=getattr(torch, spec.dtype), device=spec.device)
    return build_engine(
        model,
        device=spec.device,
        attention=spec.attention,
        expected_context=spec.expected_context,
        spec=spec.spec,
        keep_finished=spec.keep_finished,
        max_versions=spec.max_versions,
        routes=spec.routes,
        **common,
    )


def _load(engine: Engine, weights: SharedWeights, version: int) -> None:
    """`version` from the ring into the engine; `Torn` when the trainer began overwriting its slot while
    the engine copied it (the engine then holds a mix of two versions under its number)."""
    flat = weights.read(version)
    engine.load_weights(flat.views(), version)
    if not weights.intact(version, flat):
        raise Torn(f"the weights of version {version} were overwritten while this engine loaded them")
