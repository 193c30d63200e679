"""`Hardware`: one accelerator's datasheet numbers plus the few efficiency constants the cost model
applies to them, and presets.

Datasheet numbers are dense (no 2:4 sparsity) BF16 tensor-core peaks, HBM bandwidth and capacity,
scale-up (NVLink) bandwidth per GPU per direction, and the scale-out NIC per GPU. The efficiency
constants are the simulator's assumptions, the same for every GPU preset so that no published row is
fitted by hand: decode reaches 75% of HBM bandwidth and 50% of peak FLOPs (vLLM/SGLang-class kernels),
a decode step costs 3 ms of fixed scheduling/sampling/launch overhead, training runs at 35% MFU
(Megatron/FSDP RL trainers on dense 1-32B models), and a weight load has 2 s of fixed latency
(resharding, cache reset) on top of its bytes over the NIC.

"cpu" is this machine, fitted by `tailrace sim calibrate` and loaded from
$TAILRACE_CACHE/sim/cpu.json (default ~/.cache/tailrace/sim/cpu.json); without that file the
built-in fit below (measured on the 2-core testbed) is used.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tailrace.common import cache_root

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense BF16 FLOP/s per device
    mem_bw: float  # HBM bytes/s per device
    mem_bytes: float  # HBM capacity per device
    scaleup_bw: float  # NVLink bytes/s per device, one direction
    net_bw: float  # scale-out NIC bytes/s per device (weights to engines on other nodes)
    dtype_bytes: int = 2  # weights and KV cache (bf16)
    bw_eff: float = 0.75  # fraction of mem_bw a decode step reaches
    flops_eff: float = 0.5  # fraction of peak_flops decode/prefill matmuls reach
    step_overhead_s: float = 3e-3  # fixed cost of one decode step (scheduler, sampling, launches)
    per_seq_s: float = 0.0  # extra cost per running sequence per decode step (host-side work)
    tp_sync_s: float = 10e-6  # latency of one tensor-parallel all-reduce (2 per layer per step)
    train_mfu: float = 0.35  # model FLOPs utilization of the trainer
    train_step_overhead_s: float = 1.0  # per optimizer step: optimizer update, loss bookkeeping
    sync_fixed_s: float = 2.0  # fixed latency of one weight load on an engine
    load_bw: float = 0.0  # bytes/s a weight load reaches per device; 0 = net_bw
    link_latency_s: float = 20e-6  # one network hop's latency (a broadcast tree level adds it)
    # Decode steps take this factor longer while the trainer computes on the same host: on a CPU
    # testbed the two roles share memory bandwidth and the last-level cache (measured by calibrate);
    # separate GPUs do not slow each other, so 1.0 there.
    corun_slowdown: float = 1.0
    # Host time between two decode steps that is not a step: the engine worker's loop (polling its
    # pipe, taking requests, sending results). It delays the next step but is not busy time, so it
    # shows as rollout bubble (measured by calibrate on the CPU testbed; 0 where it overlaps the device).
    host_gap_s: float = 0.0
    # Host time of the run's driver per engine report it handles (scoring through the reward worker,
    # the scheduler, events and journal): per report + per result in it. Where the driver shares the
    # roles' cores (the CPU testbed: engine and trainer pinned to one core each, the driver unpinned), it
    # wakes on the reporting engine's core whenever the trainer's core is busy, and the engine's next
    # step waits for it (measured by calibrate); 0 on a cluster, where the driver has host cores to itself.
    driver_report_s: float = 0.0
    driver_result_s: float = 0.0

    def __post_init__(self) -> None:
        for k in ("peak_flops", "mem_bw", "mem_bytes", "net_bw"):
            if not getattr(self, k) > 0:
                raise ValueError(f"hardware {self.name}: {k} must be positive")
        if not self.corun_slowdown >= 1.0:
            raise ValueError(f"hardware {self.name}: corun_slowdown={self.corun_slowdown} must be >= 1")
        for k in ("host_gap_s", "driver_report_s", "driver_result_s"):
            if not getattr(self, k) >= 0.0:
                raise ValueError(f"hardware {self.name}: {k}={getattr(self, k)} must be >= 0")
        for k in ("bw_eff", "flops_eff", "train_mfu"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"hardware {self.name}: {k}={getattr(self, k)} must lie in (0, 1]")

    @property
    def weight_load_bw(self) -> float:
        return self.load_bw or self.net_bw

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


GPUS: dict[str, Hardware] = {
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TF BF16 dense, 2,039 GB/s HBM2e, NVLink3 600 GB/s total
    # (300 per direction); DGX A100: one 200 Gb/s HDR NIC per GPU.
    "a100-80g": Hardware("a100-80g", 312 * TB, 2039 * GB, 80 * GB, 300 * GB, 25 * GB),
    # NVIDIA H100 datasheet (SXM5): 989 TF BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3, NVLink4
    # 900 GB/s total; DGX H100: one 400 Gb/s NDR NIC per GPU.
    "h100": Hardware("h100", 989 * TB, 3350 * GB, 80 * GB, 450 * GB, 50 * GB),
    # H800 (SXM5): the H100 die and HBM3 with NVLink cut to 400 GB/s total; 400 Gb/s NIC per GPU.
    "h800": Hardware("h800", 989 * TB, 3350 * GB, 80 * GB, 200 * GB, 50 * GB),
    # H20: 148 TF BF16 dense, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s total; 400 Gb/s NIC.
    "h20": Hardware("h20", 148 * TB, 4000 * GB, 96 * GB, 450 * GB, 50 * GB),
    # NVIDIA H200 datasheet (SXM): 989 TF BF16 dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s total.
    "h200": Hardware("h200", 989 * TB, 4800 * GB, 141 * GB, 450 * GB, 50 * GB),
    # GB200 NVL72 datasheet, per Blackwell GPU: 180 PF BF16 dense / 72 = 2.5 PF, 576 TB/s / 72 = 8 TB/s
    # HBM3e, 13.4 TB / 72 = 186 GB, NVLink5 1.8 TB/s total; one 400 Gb/s NIC per GPU.
    "gb200": Hardware("gb200", 2500 * TB, 8000 * GB, 186 * GB, 900 * GB, 50 * GB),
}

# The 2-core testbed (DESIGN.md §6), fitted by `tailrace sim calibrate` on one core each for the engine
# and the trainer, fp32. Effective numbers: efficiencies are folded in (bw_eff = flops_eff = 1).
CPU_FALLBACK = Hardware(
    "cpu",
    peak_flops=2.0e10,
    mem_bw=1.0e10,
    mem_bytes=8 * GB,
    scaleup_bw=5 * GB,
    net_bw=5 * GB,
    dtype_bytes=4,
    bw_eff=1.0,
    flops_eff=1.0,
    step_overhead_s=6e-4,
    per_seq_s=4e-6,
    tp_sync_s=0.0,
    train_mfu=0.5,
    train_step_overhead_s=0.01,
    sync_fixed_s=1e-3,
    load_bw=2 * GB,
)


def cache_dir() -> Path:
    """Where calibration results live (the same root as tailrace's warm-start cache)."""
    return cache_root() / "sim"


CPU_PRESETS = ("cpu", "cpu-bf16")  # fp32 engine and trainer; bf16 engine and bf16-autocast trainer


def preset_path(name: str) -> Path:
    """The JSON `tailrace sim calibrate` writes for a cpu preset: cpu.json, cpu-bf16.json."""
    return cache_dir() / f"{name}.json"


def cpu_hardware(path: Path | None = None, name: str = "cpu") -> Hardware:
    """A calibrated cpu preset; without its file, the fallback above (bf16: half the bytes per value)."""
    path = path or preset_path(name)
    if not path.is_file():
        return CPU_FALLBACK if name == "cpu" else dataclasses.replace(CPU_FALLBACK, name=name, dtype_bytes=2)
    d = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Hardware)}
    return Hardware(**{k: v for k, v in d["hardware"].items() if k in fields})


def get_hardware(name: str) -> Hardware:
    key = name.lower()
    if key in ("cpu", "this-cpu"):
        return cpu_hardware()
    if key in CPU_PRESETS:
        return cpu_hardware(name=key)
    if key not in GPUS:
        raise KeyError(f"unknown hardware preset {name!r}; use one of {', '.join([*GPUS, *CPU_PRESETS])}")
    return GPUS[key]
