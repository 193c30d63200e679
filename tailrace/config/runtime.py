"""Where the worker processes run: this machine's cores (local) or a Ray cluster (ray)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tailrace.config.fields import need, setting


@dataclass
class RuntimeConfig:
    kind: Literal["local", "ray"] = setting(
        "local",
        "local: one process per role on this machine, pinned to its cores; ray: Ray actors in a placement "
        "group (pip install 'tailrace[ray]')",
    )
    address: str | None = setting(
        None,
        "ray: the cluster to join (auto: the one `ray start` runs here; ray://host:10001); null = "
        "Ray's default (RAY_ADDRESS, else a cluster started for the run)",
    )
    trainer_cpus: float = setting(1.0, "ray: CPUs reserved for the trainer actor (its torch threads)")
    trainer_gpus: float = setting(0.0, "ray: GPUs reserved for the trainer actor")
    engine_cpus: float = setting(1.0, "ray: CPUs reserved for each engine actor")
    engine_gpus: float = setting(0.0, "ray: GPUs reserved for each engine actor")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = setting(
        "PACK", "ray: how the placement group's bundles (trainer, then each engine) spread over nodes"
    )
    weights: Literal["object_store", "collective"] = setting(
        "object_store",
        "ray: how published weights reach the engines: object_store (one object per version, read "
        "by every engine that loads it); collective (a broadcast to every engine, gloo on CPU, NCCL on "
        "GPU, each staging it in a ring of its own; the object store keeps every version as well)",
    )

    def __post_init__(self) -> None:
        for k in ("trainer_cpus", "engine_cpus"):
            need(
                getattr(self, k) >= 1,
                f"runtime.{k}={getattr(self, k)}: must be >= 1 (a worker's torch threads)",
            )
        for k in ("trainer_gpus", "engine_gpus"):
            need(getattr(self, k) >= 0, f"runtime.{k}={getattr(self, k)}: must be >= 0")
        need(
            self.weights != "collective" or self.kind == "ray",
            "runtime.weights=collective needs runtime.kind=ray (the local runtime moves weights through its "
            "shared-memory ring): add --runtime.kind=ray, or drop runtime.weights",
        )
