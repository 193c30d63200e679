"""Weight snapshots for evaluation during training (`eval.every`), evaluated when training is done.

Evaluating on the engines while a run trains would change its schedule (in the overlapped modes
which version a sample is dispatched under depends on timing), so the run's own clock and samples
would no longer be those of a run without evaluation. Instead, every `every`-th published version
is copied out of the shared-memory ring into the run directory (snapshots/v<version>.safetensors:
one flat buffer; the copy costs one memcpy and a file write in the driver, off the engines and the
trainer), with the step and the wall time at which it was published. When training ends, the
engines evaluate each snapshot in turn; its record carries that wall time, so held-out accuracy is
plotted against the time it took to get there. Evaluation time is excluded from the run's clock by
construction: it happens after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class Snapshot:
    step: int  # optimizer steps behind the weights
    version: int
    wall_s: float  # when the version was published, on the step records' clock
    path: Path


class Snapshots:
    def __init__(self, run_dir: Path, every: int, steps_done: int = 0) -> None:
        self.dir = Path(run_dir) / "snapshots"
        self.every = every
        self._next = self._after(steps_done)

    def _after(self, steps: int) -> int:
        return (steps // self.every + 1) * self.every if self.every > 0 else -1

    def due(self, steps_done: int) -> bool:
        """At the first publishing step at or past each multiple of `every` (not every step publishes)."""
        if self.every <= 0 or steps_done < self._next:
            return False
        self._next = self._after(steps_done)
        return True

    def take(
        self,
        step: int,
        version: int,
        wall_s: float,
        buffer: torch.Tensor,
        intact: Callable[[], bool] = lambda: True,
    ) -> Snapshot | None:
        """Save `buffer` (a view of the ring's slot). `intact`, asked once it is written: whether the
        slot still held the version throughout (the ring's seqlock); None, nothing kept, where not."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"v{version:06d}.safetensors"
        meta = {"step": str(step), "version": str(version), "wall_s": repr(wall_s)}
        tmp = path.with_suffix(".tmp")
        save_file({"flat": buffer.detach().to("cpu").contiguous()}, str(tmp), metadata=meta)
        if not intact():
            tmp.unlink()
            return None
        tmp.replace(path)
        return Snapshot(step, version, wall_s, path)

    def pending(self, evaluated: set[int]) -> list[Snapshot]:
        """Snapshots on disk whose version has no evaluation record yet, oldest first (a resumed run
        evaluates the ones its first part saved, too)."""
        out = []
        for p in sorted(self.dir.glob("v*.safetensors")):
            with open(p, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                meta = json.loads(f.read(n)).get("__metadata__", {})
            s = Snapshot(int(meta["step"]), int(meta["version"]), float(meta["wall_s"]), p)
            if s.version not in evaluated:
                out.append(s)
        return out

    @staticmethod
    def load(s: Snapshot) -> torch.Tensor:
        return load_file(str(s.path))["flat"]
