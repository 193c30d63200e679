"""`tailrace sim calibrate`: measure the real engine and trainer on this machine and fit the "cpu"
hardware preset of the simulator (tailrace/sim/hardware.py), saved as JSON that preset loads.

Outside tailrace/sim on purpose: it needs torch, the engine and the trainer; the simulator itself
only reads the JSON. Measured on the default model's shape (random weights cost what trained ones
do), one torch thread per role as on the testbed, fp32:

- decode: steps of the real `Engine` at batch 1..64 with forced lengths, fitted to the simulator's own
  form  step = overhead + per_seq * batch + max((weights + KV of the context) / bw, FLOPs / rate)
  (see `fit_decode`; efficiencies are folded into the fitted bw and rate);
- train: `GRPOTrainer.step` over synthetic groups; FLOPs per step (6N per token + attention) / time;
- weights: the shared-memory publish (one memcpy) and the engine's load of a version;
- checkpoint: the trainer worker's save after a publishing step (a real run's flow.checkpoint_every);
- co-running: decode steps alone and while a trainer computes on the other core (`corun_slowdown`).

Timing on a shared machine is noisy: every figure is the median of repeats, and the JSON records
the machine's load average at the time.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tailrace.config import SFTConfig, TrainerConfig
from tailrace.engine.engine import Engine
from tailrace.model.decoder import CausalLM
from tailrace.runtime.warmstart import model_config
from tailrace.sim.costs import CostModel
from tailrace.sim.hardware import CPU_FALLBACK, Hardware, cache_dir
from tailrace.sim.models import ModelShape
from tailrace.tokenizer import char_tokenizer
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.types import Finish, GenRequest, GenResult, Group, SamplingParams, Trajectory


def default_shape(cfg: SFTConfig) -> ModelShape:
    return ModelShape("tailrace-default", cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                      cfg.hidden_size // cfg.num_heads, cfg.intermediate_size, char_tokenizer().vocab_size,
                      tied_embeddings=True)


def _model(cfg: SFTConfig) -> CausalLM:
    tok = char_tokenizer()
    return CausalLM.from_config(model_config(cfg, tok.vocab_size, tok), seed=0)


def measure_decode(model: CausalLM, batches=(1, 4, 16, 32, 64), length: int = 192, prompt: int = 16,
                   repeats: int = 2) -> list[tuple[int, int, float]]:
    """(batch, context tokens, step seconds) of pure decode steps."""
    rows = []
    for b in batches:
        for rep in range(repeats):
            eng = Engine(model, num_slots=max(batches), prefill_tokens=4096, seed=rep)
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


def fit_decode(rows, shape: ModelShape, dtype_bytes: int = 4) -> dict:
    """Fit the cost model's own decode form to measured steps:
        t = overhead + per_seq * B + max((W + kv * ctx) / bw, (2 N B + attn * ctx) / rate)
    by a log grid over (bw, rate) with overhead, per_seq >= 0 solved by least squares at each point;
    the grid point with the smallest median relative error wins."""
    P = np.array(rows, float)
    B, ctx, t = P[:, 0], P[:, 1], P[:, 2]
    W, kv = shape.weight_bytes_read(1, dtype_bytes), shape.kv_bytes_per_token(dtype_bytes)
    flops = 2.0 * shape.matmul_params * B + shape.attn_flops_per_context_token * ctx
    X = np.stack([np.ones_like(B), B], 1)
    best = None
    for bw in np.logspace(8.5, 11.5, 61):
        for rate in np.logspace(8.5, 12, 71):
            roof = np.maximum((W + kv * ctx) / bw, flops / rate)
            (a, s), *_ = np.linalg.lstsq(X, t - roof, rcond=None)
            if s < 0:
                a, s = float(np.mean(t - roof)), 0.0
            a = max(a, 0.0)
            err = float(np.median(np.abs(a + s * B + roof - t) / t))
            if best is None or err < best[0]:
                best = (err, bw, rate, a, s)
    err, bw, rate, a, s = best
    return {"overhead_s": float(a), "per_seq_s": float(s), "mem_bw": float(bw), "flops_per_s": float(rate),
            "rel_err_median": err, "points": len(rows)}


def fit_train(rows) -> dict:
    """t = overhead + FLOPs / rate, overhead >= 0."""
    f = np.array([r[1] for r in rows], float)
    t = np.array([r[2] for r in rows], float)
    w = 1.0 / t  # relative error: a small step's time matters as much as a big one's
    (a, inv), *_ = np.linalg.lstsq(np.stack([w, f * w], 1), np.ones_like(t), rcond=None)
    if a < 0 or inv <= 0:
        a, inv = 0.0, float(np.sum(t) / np.sum(f))
    return {"overhead_s": float(a), "flops_per_s": float(1.0 / inv),
            "rel_err_median": float(np.median(np.abs(a + inv * f - t) / t))}


def _traj(group: int, i: int, n: int, prompt: tuple[int, ...]) -> Trajectory:
    res = GenResult(f"{group}.{i}.0", (5,) * n, (-1.0,) * n, (0,) * n, Finish.STOP)
    return Trajectory(group, i, group, prompt, res, reward=float(i % 2), correct=bool(i % 2))


def measure_checkpoint(trainer: GRPOTrainer, repeats: int = 3) -> float:
    """Seconds the trainer worker spends writing a checkpoint (model + optimizer + RNG)."""
    import tempfile

    from tailrace.runtime.trainer_worker import save_checkpoint
    times = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            t0 = time.perf_counter()
            save_checkpoint(trainer, trainer.model, Path(d) / f"step_{i}")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


TRAIN_SHAPES = ((2, 32), (16, 64), (16, 128), (16, 256))  # (groups of 8, response length): small steps fix the intercept


def measure_train(cfg: SFTConfig, shape: ModelShape, shapes=TRAIN_SHAPES, k: int = 8, repeats: int = 3,
                  trainer: GRPOTrainer | None = None) -> list[tuple[int, float, float]]:
    """(tokens, FLOPs, seconds) of real optimizer steps over synthetic groups."""
    trainer = trainer or GRPOTrainer(_model(cfg), TrainerConfig())
    prompt = (5,) * 16
    rows = []
    for groups, n in shapes:
        batch = [Group(g, g, tuple(_traj(g, i, n, prompt) for i in range(k))) for g in range(groups)]
        per_seq = len(prompt) + n
        flops = CostModel(CPU_FALLBACK, shape, recompute_logprobs=False).train_flops([per_seq] * groups * k)
        trainer.step(batch, 0)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.step(batch, 0)
            times.append(time.perf_counter() - t0)
        rows.append((groups * k * per_seq, flops, statistics.median(times)))
    return rows


def _train_loop(cores, stop, ready) -> None:
    """Child process of `measure_corun`: real optimizer steps on its own core until `stop` is set."""
    from tailrace.runtime.procs import pin
    pin(cores)
    torch.set_num_threads(1)
    cfg = SFTConfig()
    trainer = GRPOTrainer(_model(cfg), TrainerConfig())
    batch = [Group(g, g, tuple(_traj(g, i, 96, (5,) * 16) for i in range(8))) for g in range(8)]
    trainer.step(batch, 0)
    ready.set()
    while not stop.is_set():
        trainer.step(batch, 0)


def measure_corun(model: CausalLM, batch: int = 16, length: int = 128, repeats: int = 3) -> dict:
    """How much longer a decode step takes while a trainer computes on another core of this host (the
    runtime's placement: engine and trainer pinned apart): shared memory bandwidth and last-level cache.
    1.0 where there is a single core (the roles then time-share it, which the simulator does not model)."""
    from tailrace.runtime.procs import available_cores, context, pin, placement
    cores = available_cores()
    if len(cores) < 2:
        return {"slowdown": 1.0, "alone_s": None, "corun_s": None}
    train_cores, engine_cores = placement(1)
    pin(engine_cores[0])
    try:
        def decode_step_s() -> float:  # median pure decode step at `batch`
            return statistics.median(t for _, _, t in measure_decode(model, (batch,), length, repeats=repeats))
        alone = decode_step_s()
        ctx = context()
        stop, ready = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_train_loop, args=(train_cores, stop, ready), daemon=True)
        child.start()
        try:
            ready.wait(timeout=120)
            corun = decode_step_s()
        finally:
            stop.set()
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    finally:
        pin(tuple(cores))
    return {"slowdown": max(1.0, corun / alone), "alone_s": alone, "corun_s": corun}


def measure_weights(model: CausalLM, repeats: int = 5) -> dict:
    from tailrace.model.flat import flatten_parameters
    from tailrace.runtime.weights import SharedWeights
    flat = flatten_parameters(model)
    ring = SharedWeights.like(flat, slots=2)
    eng = Engine(model, num_slots=4)
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
    return {"bytes": flat.buffer.numel() * flat.buffer.element_size(), "publish_s": statistics.median(pub),
            "load_s": statistics.median(load)}


def calibrate(out: Path | None = None, quick: bool = False, progress=print) -> dict:
    cfg = SFTConfig()
    shape = default_shape(cfg)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(cfg)
        progress("decode: real engine steps at batch 1..64")
        rows = measure_decode(model, batches=(1, 16, 64) if quick else (1, 4, 16, 32, 64), repeats=1 if quick else 2)
        dec = fit_decode(rows, shape)
        progress(f"  overhead {dec['overhead_s'] * 1e3:.3f} ms/step, {dec['per_seq_s'] * 1e6:.1f} us/row, "
                 f"{dec['mem_bw'] / 1e9:.2f} GB/s, {dec['flops_per_s'] / 1e9:.1f} GFLOP/s "
                 f"(median error {dec['rel_err_median']:.1%})")
        progress("train: real GRPO optimizer steps")
        trainer = GRPOTrainer(_model(cfg), TrainerConfig())
        tr = measure_train(cfg, shape, shapes=((2, 32), (16, 192)) if quick else TRAIN_SHAPES,
                           repeats=1 if quick else 3, trainer=trainer)
        trf = fit_train(tr)
        train_rate = trf["flops_per_s"]
        progress(f"  {train_rate / 1e9:.2f} GFLOP/s + {trf['overhead_s']:.3f} s/step "
                 f"({', '.join(f'{n} tok {t:.2f} s' for n, _, t in tr)})")
        progress("weights: shared-memory publish and engine load")
        w = measure_weights(model)
        progress(f"  {w['bytes'] / 1e6:.1f} MB: publish {w['publish_s'] * 1e3:.2f} ms, load {w['load_s'] * 1e3:.2f} ms")
        ckpt = measure_checkpoint(trainer)
        progress(f"checkpoint: {ckpt * 1e3:.1f} ms (model + optimizer)")
        progress("co-running: decode steps alone vs while a trainer computes on the other core")
        co = measure_corun(model, repeats=1 if quick else 3)
        if co["alone_s"] is not None:
            progress(f"  {co['alone_s'] * 1e3:.2f} ms alone, {co['corun_s'] * 1e3:.2f} ms co-running: "
                     f"x{co['slowdown']:.2f}")
    finally:
        torch.set_num_threads(prev)
    peak = max(dec["flops_per_s"], train_rate)
    hw = dataclasses.replace(
        CPU_FALLBACK, peak_flops=peak, flops_eff=dec["flops_per_s"] / peak, train_mfu=train_rate / peak,
        mem_bw=dec["mem_bw"], bw_eff=1.0, step_overhead_s=dec["overhead_s"], per_seq_s=dec["per_seq_s"],
        dtype_bytes=4, train_step_overhead_s=trf["overhead_s"], sync_fixed_s=0.0,
        load_bw=w["bytes"] / max(w["load_s"], 1e-9), scaleup_bw=w["bytes"] / max(w["publish_s"], 1e-9),
        corun_slowdown=co["slowdown"])
    result = {"hardware": hw.to_dict(), "decode": dec, "train": trf, "decode_points": rows, "train_points": tr,
              "weights": w, "corun": co, "extra": {"checkpoint_s": ckpt},
              "model": dataclasses.asdict(shape), "load_average": os.getloadavg(), "time": time.time()}
    out = out or cache_dir() / "cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def check_hardware(d: dict) -> Hardware:
    """The saved preset, as the simulator will load it."""
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: v for k, v in d["hardware"].items() if k in fields})
