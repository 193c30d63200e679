"""The runtime's own processes measured as a run uses them: the engine worker fed as the driver
feeds it, and the driver's handling of an engine report."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from tailrace.model.decoder import CausalLM
from tailrace.tokenizer import char_tokenizer
from tailrace.types import Finish, GenRequest, GenResult, SamplingParams


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
    from tailrace.runtime.messages import EngineReport
    from tailrace.runtime.procs import placement
    from tailrace.runtime.weights import SharedWeights
    from tailrace.runtime.workers import Workers

    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    tok = char_tokenizer()
    _, engine_cores = placement(1)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)  # in its dtype; the worker loads it in the same one
        spec = EngineSpec(d, slots, 512, 1, engine_cores[0], 0, dtype)
        workers = Workers(timeout_s=120.0)  # a lost worker raises, in one line
        weights = SharedWeights.like(flatten_parameters(model), slots=1)
        engine = workers.start("engine0", engine_main, 0, spec, weights)
        try:
            workers.ready([engine])
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
                    workers.send(engine, Generate(0, batch))
                return len(batch)

            sent += send(slots + lookahead)
            while done < samples:
                for _, rep in workers.receive(timeout=1.0):
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
        finally:
            workers.close()
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
