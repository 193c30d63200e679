"""A sample's identity, and the one place it is turned into a request id and back.

Sample `index` of group `group`, dispatch `attempt` (0 for a fresh sample; +1 each time an aborted
partial is resumed). The request id an engine sees is `str(key)`; engines treat it as opaque.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class SampleKey:
    group: int
    index: int
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.group}.{self.index}.{self.attempt}"

    @classmethod
    def parse(cls, request_id: str) -> SampleKey:
        try:
            group, index, attempt = (int(x) for x in request_id.split("."))
        except ValueError:
            raise ValueError(f"request id {request_id!r} is not a sample key (group.index.attempt)") from None
        return cls(group, index, attempt)

    def next_attempt(self) -> SampleKey:
        return SampleKey(self.group, self.index, self.attempt + 1)


def sample_seed(run_seed: int, request_id: str) -> int:
    """A per-request sampling seed: the same request gets the same tokens whatever batch it runs in."""
    return zlib.crc32(f"{run_seed}/{request_id}".encode()) & 0x7FFFFFFF
