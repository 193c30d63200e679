"""`tailrace sim calibrate`: measure the real engine and trainer on this machine and fit the "cpu"
hardware preset of the simulator (tailrace/sim/hardware.py), saved as JSON that preset loads.

Outside tailrace/sim on purpose: it needs torch, the engine and the trainer; the simulator itself
only reads the JSON. Measured on the default model's shape (random weights cost what trained ones
do), one torch thread per role as on the testbed, once per dtype: fp32 (engine and trainer in fp32:
the "cpu" preset, cpu.json) and bf16 (a bf16 engine and a bf16-autocast trainer: "cpu-bf16",
cpu-bf16.json):

- decode: steps of the real `Engine` at batch 1..64 with forced lengths, fitted to the simulator's own
  form  step = overhead + per_seq * batch + max((weights + KV of the context) / bw, FLOPs / rate)
  (see `fit_decode`; efficiencies are folded into the fitted bw and rate);
- train: `GRPOTrainer.step` over synthetic groups; FLOPs per step (6N per token + attention) / time;
- weights: the shared-memory publish (one memcpy) and the engine's load of a version;
- checkpoint: the trainer worker's save after a publishing step (a real run's flow.checkpoint_every);
- the engine worker: the runtime's worker process fed as the driver feeds it; wall time between its
  steps that is not a step (its loop: pipe, requests, results) is `host_gap_s` per step, and its busy
  time per step beyond the decode fit's prediction, per running row, is added to the fit's per-row
  cost (`worker_excess`: sampling, stop checks, admissions' prefills grow with the rows);
- the driver: its real handling of an engine report (scoring, scheduler, journal) per report and per
  result (`driver_report_s`, `driver_result_s`: the simulator charges it to the engine's core while the
  trainer computes, as the unpinned driver process then runs there);
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

from tailrace.config import ArchConfig, TrainerConfig
from tailrace.engine import build_engine
from tailrace.model.decoder import CausalLM
from tailrace.runtime.warmstart import model_config
from tailrace.sim.costs import CostModel
from tailrace.sim.hardware import CPU_FALLBACK, preset_path
from tailrace.sim.models import ModelShape
from tailrace.tokenizer import char_tokenizer
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.types import Finish, GenRequest, GenResult, Group, SamplingParams, Trajectory


def default_shape(cfg: ArchConfig) -> ModelShape:
    return ModelShape(
        "tailrace-default",
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.hidden_size // cfg.num_heads,
        cfg.intermediate_size,
        char_tokenizer().vocab_size,
        tied_embeddings=True,
    )


DTYPES = {"float32": (torch.float32, "cpu", 4), "bfloat16": (torch.bfloat16, "cpu-bf16", 2)}


def _model(cfg: ArchConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    tok = char_tokenizer()
    return CausalLM.from_config(model_config(cfg, tok.vocab_size, tok), seed=0).to(dtype)


def _trainer(cfg: ArchConfig, dtype: torch.dtype) -> GRPOTrainer:
    """The runtime's trainer: fp32 weights, the forward autocast to bf16 for a bf16 run."""
    return GRPOTrainer(_model(cfg), TrainerConfig(bf16=dtype == torch.bfloat16))


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


def _decode_work(shape: ModelShape, dtype_bytes: int, B, ctx):
    """(bytes read, FLOPs) of a decode step of B rows reading ctx cached tokens in all: the two sides
    of the roofline the fit and `worker_excess` evaluate (scalars or arrays)."""
    mem = shape.weight_bytes_read(1, dtype_bytes) + shape.kv_bytes_per_token(dtype_bytes) * ctx
    return mem, 2.0 * shape.matmul_params * B + shape.attn_flops_per_context_token * ctx


def fit_decode(rows, shape: ModelShape, dtype_bytes: int = 4) -> dict:
    """Fit the cost model's own decode form to measured steps:
        t = overhead + per_seq * B + max((W + kv * ctx) / bw, (2 N B + attn * ctx) / rate)
    by a log grid over (bw, rate) with overhead, per_seq >= 0 solved by least squares at each point;
    the grid point with the smallest median relative error wins."""
    P = np.array(rows, float)
    B, ctx, t = P[:, 0], P[:, 1], P[:, 2]
    mem, flops = _decode_work(shape, dtype_bytes, B, ctx)
    X = np.stack([np.ones_like(B), B], 1)
    best = None
    for bw in np.logspace(8.5, 11.5, 61):
        for rate in np.logspace(8.5, 12, 71):
            roof = np.maximum(mem / bw, flops / rate)
            (a, s), *_ = np.linalg.lstsq(X, t - roof, rcond=None)
            if s < 0:
                a, s = float(np.mean(t - roof)), 0.0
            a = max(a, 0.0)
            err = float(np.median(np.abs(a + s * B + roof - t) / t))
            if best is None or err < best[0]:
                best = (err, bw, rate, a, s)
    err, bw, rate, a, s = best
    return {
        "overhead_s": float(a),
        "per_seq_s": float(s),
        "mem_bw": float(bw),
        "flops_per_s": float(rate),
        "rel_err_median": err,
        "points": len(rows),
    }


def fit_train(rows) -> dict:
    """t = overhead + FLOPs / rate, overhead >= 0."""
    f = np.array([r[1] for r in rows], float)
    t = np.array([r[2] for r in rows], float)
    w = 1.0 / t  # relative error: a small step's time matters as much as a big one's
    (a, inv), *_ = np.linalg.lstsq(np.stack([w, f * w], 1), np.ones_like(t), rcond=None)
    if a < 0 or inv <= 0:
        a, inv = 0.0, float(np.sum(t) / np.sum(f))
    return {
        "overhead_s": float(a),
        "flops_per_s": float(1.0 / inv),
        "rel_err_median": float(np.median(np.abs(a + inv * f - t) / t)),
    }


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


TRAIN_SHAPES = (
    (2, 32),
    (16, 64),
    (16, 128),
    (16, 256),
)  # (groups of 8, response length): small steps fix the intercept


def measure_train(
    cfg: ArchConfig,
    shape: ModelShape,
    shapes=TRAIN_SHAPES,
    k: int = 8,
    repeats: int = 3,
    trainer: GRPOTrainer | None = None,
) -> list[tuple[int, float, float]]:
    """(tokens, FLOPs, seconds) of real optimizer steps over synthetic groups."""
    trainer = trainer or _trainer(cfg, torch.float32)
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


def _train_loop(cores, stop, ready, go, computing, dtype) -> None:
    """Child process of `measure_corun`: real optimizer steps on its own core while `go` is set
    (`computing` says whether it is), until `stop` is set."""
    from tailrace.runtime.procs import pin

    pin(cores)
    torch.set_num_threads(1)
    trainer = _trainer(ArchConfig(), dtype)
    batch = [Group(g, g, tuple(_traj(g, i, 96, (5,) * 16) for i in range(8))) for g in range(8)]
    trainer.step(batch, 0)
    ready.set()
    while not stop.is_set():
        if go.is_set():
            computing.set()
            trainer.step(batch, 0)
        else:
            computing.clear()
            go.wait(0.05)


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
        target=_train_loop,
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


def measure_worker(
    model: CausalLM, slots: int = 8, samples: int = 192, lookahead: int = 16, max_new: int = 160
) -> dict:
    """The runtime's engine worker process (`engine_main`) fed as the driver feeds it: `slots` +
    `lookahead` samples queued, one more sent per result that comes back. Its reports give the steps'
    busy time; the rest of the wall time between the first and the last step is the worker's loop
    (pipe polling, taking requests, sending results): `host_gap_s` per step. Random weights: lengths
    end at the EOS the model happens to sample, or at `max_new`."""
    import tempfile

    from tailrace.flow.commands import Generate
    from tailrace.flow.keys import sample_seed
    from tailrace.model.checkpoint import save_pretrained
    from tailrace.model.flat import flatten_parameters
    from tailrace.runtime.engine_worker import EngineSpec, engine_main
    from tailrace.runtime.messages import EngineReport, Shutdown
    from tailrace.runtime.procs import context, placement
    from tailrace.runtime.weights import SharedWeights

    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    tok = char_tokenizer()
    _, engine_cores = placement(1)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)  # in its dtype; the worker loads it in the same one
        spec = EngineSpec(d, slots, 512, 1, engine_cores[0], 0, dtype)
        ctx = context()
        conn, child = ctx.Pipe()
        weights = SharedWeights.like(flatten_parameters(model), slots=1)
        proc = ctx.Process(target=engine_main, args=(0, spec, child, weights), daemon=True)
        proc.start()
        try:

            def wait(what: str) -> None:  # a reply, or a clear error as soon as the worker is gone
                for _ in range(120):
                    if conn.poll(1.0):
                        return
                    if not proc.is_alive():
                        raise RuntimeError(
                            f"calibrate: the engine worker exited (code {proc.exitcode}) {what}"
                        )
                raise RuntimeError(f"calibrate: the engine worker sent nothing for 120 s {what}")

            wait("while starting")
            conn.recv()  # Ready
            prompt_ids = tuple(range(5, 21))
            params = SamplingParams(max_new_tokens=max_new, stop_token_ids=(tok.eos_id,))
            sent = done = steps = 0
            busy, slot_s, t_first, t_last, lengths = 0.0, 0.0, None, None, []

            def send(n: int) -> int:
                ids = [f"c{i}" for i in range(sent, min(samples, sent + n))]
                batch = tuple(
                    GenRequest(i, prompt_ids, dataclasses.replace(params, seed=sample_seed(0, i)))
                    for i in ids
                )
                if batch:
                    conn.send(Generate(0, batch))
                return len(batch)

            sent += send(slots + lookahead)
            while done < samples:
                wait("while generating")
                rep = conn.recv()
                if not isinstance(rep, EngineReport):
                    continue
                done += len(rep.results)
                lengths += [len(r.token_ids) for r in rep.results]
                sent += send(len(rep.results))
                if rep.stats.steps:
                    steps += rep.stats.steps
                    busy += rep.stats.busy_s
                    slot_s += rep.stats.slot_s
                    t_first = rep.stats.spans[0][0] if t_first is None else t_first
                    t_last = rep.stats.spans[-1][1]
            conn.send(Shutdown())
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    wall = t_last - t_first
    L = np.array(lengths, float)
    return {
        "steps": steps,
        "busy_s": busy,
        "wall_s": wall,
        "host_gap_s": max(0.0, wall - busy) / max(steps, 1),
        "mean_step_s": busy / max(steps, 1),
        "mean_batch": slot_s / max(busy, 1e-9),
        # a running row's mean context: the prompt plus its mean position, length-biased (a long
        # response is in the batch for more steps)
        "mean_row_context": len(prompt_ids) + float((L * L).sum() / (2 * L.sum())),
    }


def measure_driver(model: CausalLM, sizes=(1, 4), reports: int = 24) -> dict:
    """Host seconds the runtime's driver spends on one engine report, as its loop does it: the real
    `Driver._on_engine_report` (scoring through the reward worker process, the scheduler, events), then
    its poll and journal drain, on reports of `sizes` results (random responses of 20-120 tokens to the
    samples the scheduler dispatched, in a multiversion run of the default task); fitted as
    per_report + per_result * results. No engine or trainer runs: the driver alone, on an idle host."""
    import random
    import tempfile

    from tailrace.config import FlowConfig, ModelSpec, RunConfig
    from tailrace.flow.commands import Generate
    from tailrace.model.checkpoint import save_pretrained
    from tailrace.runtime.driver import Driver
    from tailrace.runtime.messages import EngineReport, Stats
    from tailrace.runtime.metrics import Utilization
    from tailrace.runtime.rundir import RunDir
    from tailrace.runtime.session import Session

    tok = char_tokenizer()
    rng = random.Random(0)
    rows: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, Path(d) / "model")
        tok.save(Path(d) / "model")
        cfg = RunConfig(
            model=ModelSpec(path=str(Path(d) / "model")), flow=FlowConfig(mode="multiversion", steps=10**6)
        )
        run = RunDir(Path(d) / "run")
        run.create()
        ses = Session(cfg)
        drv = Driver(cfg, run, ses)
        try:
            drv.t0 = time.perf_counter()
            drv.util = Utilization(drv.t0, slots=cfg.rollout.slots)
            pool = []

            def poll() -> None:
                out = drv.sched.poll(drv._now())
                pool.extend(r for c in out.commands if isinstance(c, Generate) for r in c.requests)
                drv._record(out)

            poll()
            for k in range(reports * len(sizes) + 2):
                n = sizes[k % len(sizes)]
                done, pool[:n] = pool[:n], []
                results = []
                for req in done:
                    m = rng.randint(20, 120)
                    results.append(
                        GenResult(
                            req.id,
                            tuple(rng.randrange(4, tok.vocab_size) for _ in range(m)),
                            (-1.0,) * m,
                            (req.version,) * m,
                            Finish.STOP,
                        )
                    )
                now = time.perf_counter()
                rep = EngineReport(
                    0, results, Stats(steps=1, busy_s=1e-3, spans=[(now - 1e-3, now)]), [], now
                )
                t0 = time.perf_counter()
                drv._on_engine_report(rep)
                poll()
                if k >= 2:  # the first two warm up (the reward worker starts on first use)
                    rows.append((len(results), time.perf_counter() - t0))
        finally:
            drv.close()
            ses.close()
    n = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    per_n = {int(k): float(np.median(t[n == k])) for k in sorted(set(n.tolist()))}
    lo, hi = min(per_n), max(per_n)
    per_result = max(0.0, (per_n[hi] - per_n[lo]) / (hi - lo)) if hi > lo else 0.0
    return {
        "per_report_s": max(0.0, per_n[lo] - per_result * lo),
        "per_result_s": per_result,
        "median_by_results": per_n,
    }


def worker_excess(dec: dict, wk: dict, shape: ModelShape, dtype_bytes: int) -> float:
    """Seconds per running row per step that the runtime's worker spends beyond the fitted pure decode
    step at its mean batch and context (its sampling, stop checks and result packaging, and the prompt
    prefills of admissions mixed into its steps: work that grows with the rows, not with the step)."""
    B = wk["mean_batch"]
    mem, flops = _decode_work(shape, dtype_bytes, B, B * wk["mean_row_context"])
    pred = dec["overhead_s"] + dec["per_seq_s"] * B + max(mem / dec["mem_bw"], flops / dec["flops_per_s"])
    return max(0.0, wk["mean_step_s"] - pred) / B


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


def calibrate(out: Path | None = None, quick: bool = False, progress=print, dtype: str = "float32") -> dict:
    """Measure and fit one preset: `dtype` float32 -> "cpu" (cpu.json), bfloat16 -> "cpu-bf16"."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    tdtype, name, dtype_bytes = DTYPES[dtype]
    cfg = ArchConfig()
    shape = default_shape(cfg)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(cfg, tdtype)
        progress(f"{name}: decode: real {dtype} engine steps at batch 1..64")
        rows = measure_decode(
            model, batches=(1, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64), repeats=1 if quick else 2
        )
        dec = fit_decode(rows, shape, dtype_bytes)
        progress(
            f"  overhead {dec['overhead_s'] * 1e3:.3f} ms/step, {dec['per_seq_s'] * 1e6:.1f} us/row, "
            f"{dec['mem_bw'] / 1e9:.2f} GB/s, {dec['flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"(median error {dec['rel_err_median']:.1%})"
        )
        progress(f"{name}: train: real GRPO optimizer steps{' (bf16 autocast)' if dtype_bytes == 2 else ''}")
        trainer = _trainer(cfg, tdtype)
        tr = measure_train(
            cfg,
            shape,
            shapes=((2, 32), (16, 192)) if quick else TRAIN_SHAPES,
            repeats=1 if quick else 3,
            trainer=trainer,
        )
        trf = fit_train(tr)
        train_rate = trf["flops_per_s"]
        progress(
            f"  {train_rate / 1e9:.2f} GFLOP/s + {trf['overhead_s']:.3f} s/step "
            f"({', '.join(f'{n} tok {t:.2f} s' for n, _, t in tr)})"
        )
        progress(f"{name}: weights: shared-memory publish and engine load")
        w = measure_weights(model)
        progress(
            f"  {w['bytes'] / 1e6:.1f} MB: publish {w['publish_s'] * 1e3:.2f} ms, load {w['load_s'] * 1e3:.2f} ms"
        )
        ckpt = measure_checkpoint(trainer)
        progress(f"{name}: checkpoint: {ckpt * 1e3:.1f} ms (model + optimizer)")
        progress(f"{name}: engine worker: the runtime's worker process, fed as the driver feeds it")
        wk = measure_worker(model, samples=64 if quick else 192)
        ex = worker_excess(dec, wk, shape, dtype_bytes)
        progress(
            f"  {wk['steps']} steps at batch {wk['mean_batch']:.1f}, {wk['mean_step_s'] * 1e3:.2f} ms/step busy: "
            f"{ex * 1e6:.1f} us per row per step beyond the decode fit (added to its per-row cost), "
            f"{wk['host_gap_s'] * 1e6:.0f} us/step between steps"
        )
        dec = dict(dec, per_seq_s=dec["per_seq_s"] + ex, worker_excess_s=ex)
        drv = measure_driver(model, reports=8 if quick else 24)
        progress(
            f"{name}: driver: {drv['per_report_s'] * 1e6:.0f} us per engine report + "
            f"{drv['per_result_s'] * 1e6:.0f} us per result (scoring, scheduler, journal)"
        )
        progress(f"{name}: co-running: worker steps alone vs while a trainer computes on the other core")
        co = measure_corun(model, pairs=2 if quick else 5)
        if co["alone_s"] is not None:
            progress(
                f"  {co['alone_s'] * 1e3:.2f} ms alone, {co['corun_s'] * 1e3:.2f} ms co-running: "
                f"x{co['slowdown']:.2f} (median of {', '.join(f'{r:.2f}' for r in co['ratios'])})"
            )
    finally:
        torch.set_num_threads(prev)
    peak = max(dec["flops_per_s"], train_rate)
    hw = dataclasses.replace(
        CPU_FALLBACK,
        name=name,
        peak_flops=peak,
        flops_eff=dec["flops_per_s"] / peak,
        train_mfu=train_rate / peak,
        mem_bw=dec["mem_bw"],
        bw_eff=1.0,
        step_overhead_s=dec["overhead_s"],
        per_seq_s=dec["per_seq_s"],
        dtype_bytes=dtype_bytes,
        train_step_overhead_s=trf["overhead_s"],
        sync_fixed_s=0.0,
        load_bw=w["bytes"] / max(w["load_s"], 1e-9),
        scaleup_bw=w["bytes"] / max(w["publish_s"], 1e-9),
        corun_slowdown=co["slowdown"],
        host_gap_s=wk["host_gap_s"],
        driver_report_s=drv["per_report_s"],
        driver_result_s=drv["per_result_s"],
    )
    result = {
        "hardware": hw.to_dict(),
        "decode": dec,
        "train": trf,
        "decode_points": rows,
        "train_points": tr,
        "weights": w,
        "corun": co,
        "worker": wk,
        "driver": drv,
        "extra": {"checkpoint_s": ckpt},
        "model": dataclasses.asdict(shape),
        "load_average": os.getloadavg(),
        "time": time.time(),
    }
    out = out or preset_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result
