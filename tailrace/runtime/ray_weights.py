"""Weight transfer trainer -> engines through Ray's object store: one object per version.

The ring's interface is runtime/weights.py's (write / read / holds / slots), so the trainer and engine
bodies do not know which runtime they serve. The trainer puts its flat buffer, as bytes, into the
object store — one copy, timed as the local memcpy is — and records the object under slot v % slots
in a `Registry` actor; an engine looks the version up there and reads the object (zero-copy from its
node's store, or one fetch across nodes) when it loads it. The registry owns every object, so a
version outlives the trainer process that put it (a replacement engine still finds it), and an
object is freed once its slot is overwritten and no engine holds it any more.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tailrace.model.flat import FlatWeights, Layout
from tailrace.runtime.weights import VersionGone


class Registry:
    """A Ray actor (no CPU of its own): slot -> (version, [object ref]); a ref in a list is not
    resolved by Ray when passed or returned."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held: dict[int, tuple[int, list]] = {}

    def put(self, version: int, boxed: list) -> None:
        self.held[version % self.slots] = (version, boxed)

    def get(self, version: int) -> list | None:
        version_held, boxed = self.held.get(version % self.slots, (-1, None))
        return boxed if version_held == version else None

    def holding(self, version: int) -> int:
        return self.held.get(version % self.slots, (-1, None))[0]


class StoreWeights:
    def __init__(self, ray: Any, layout: Layout, dtype: torch.dtype, slots: int) -> None:
        self.ray, self.layout, self.dtype, self._slots = ray, layout, dtype, slots
        self.registry = ray.remote(Registry).options(num_cpus=0).remote(slots)

    @classmethod
    def like(cls, ray: Any, flat: FlatWeights, slots: int = 4) -> "StoreWeights":
        return cls(ray, flat.layout, flat.buffer.dtype, slots)

    def __reduce__(self):  # to a worker: the same registry, the ray module it imports itself
        return (_rebuild, (self.layout, self.dtype, self._slots, self.registry))

    @property
    def slots(self) -> int:
        return self._slots

    def write(self, version: int, buffer: torch.Tensor) -> None:
        flat = buffer.detach().reshape(-1).to("cpu", self.dtype)  # rounded to the ring's dtype
        data = flat.view(torch.uint8).numpy()  # bytes: numpy has no bf16
        ref = self.ray.put(data, _owner=self.registry)
        self.ray.get(self.registry.put.remote(version, [ref]))

    def holds(self, version: int) -> bool:
        return self.ray.get(self.registry.get.remote(version)) is not None

    def arrivals(self) -> list[tuple[int, float, float]]:
        """Versions that reached a reader's own copy since it last asked: none, an engine reads the store."""
        return []

    def intact(self, version: int, flat: FlatWeights) -> bool:
        """Always: an object in the store is never written again."""
        return True

    def read(self, version: int) -> FlatWeights:
        boxed = self.ray.get(self.registry.get.remote(version))
        if boxed is None:
            held = self.ray.get(self.registry.holding.remote(version))
            raise VersionGone(
                f"weights of version {version} are not in the object store (slot holds {held}); "
                f"more versions are live than the ring's {self._slots} slots"
            )
        data = self.ray.get(boxed[0])
        with warnings.catch_warnings():  # the store's buffer is read-only; Engine.load_weights copies it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(data).view(self.dtype)
        return FlatWeights(flat, self.layout)


def _rebuild(layout: Layout, dtype: torch.dtype, slots: int, registry: Any) -> StoreWeights:
    from tailrace.runtime.ray_hosts import import_ray

    ring = StoreWeights.__new__(StoreWeights)
    ring.ray, ring.layout, ring.dtype, ring._slots, ring.registry = (
        import_ray(),
        layout,
        dtype,
        slots,
        registry,
    )
    return ring
