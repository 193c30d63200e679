"""`calibrate`: measure everything for one dtype, fit, and save the preset."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from tailrace.calibrate.engine import measure_corun, measure_decode, measure_weights
from tailrace.calibrate.fit import default_shape, fit_decode, fit_train, worker_excess
from tailrace.calibrate.models import DTYPES, random_model, random_trainer
from tailrace.calibrate.trainer import TRAIN_SHAPES, measure_checkpoint, measure_train
from tailrace.calibrate.workers import measure_driver, measure_worker
from tailrace.config import ArchConfig
from tailrace.sim.hardware import CPU_FALLBACK, preset_path


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
        model = random_model(cfg, tdtype)
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
        trainer = random_trainer(cfg, tdtype)
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
