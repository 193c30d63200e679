"""april: APRIL's active partial rollout (TECHNIQUES.md §6), for round-based modes (sync).

A round opens `over` x R prompts (over-provisioning) and stops as soon as R groups are complete:
those are trained, and the rest is carried into the next round instead of waited for — a complete
group as it is, an open one with its unfinished samples aborted, parked, and resumed under the new
weights (their tokens keep the version that produced them; the trainer's partial-rollout masking and
off-policy correction apply). The next round opens only as many fresh prompts as make `over` x R with
the carried ones. Nothing is discarded. A group is never carried past the staleness bound K
(flow.max_staleness): one that would be is trained in the round, which waits for it.
"""

from __future__ import annotations

import math

from tailrace.flow.shaping.base import Shaping


class April(Shaping):
    name = "april"
    modes = ("sync",)
    carries = True

    def __init__(self, over: float = 2.0) -> None:
        if not 1 <= over <= 2:  # at most R carried, so the groups a round must train fit in its R
            raise ValueError(f"shaping.over={over}: must lie in [1, 2] (prompts a round opens, x R)")
        self.over = over

    @classmethod
    def from_options(cls, over: float = 2.0, **_) -> April:
        return cls(over)

    def round_open(self, r: int) -> int:
        return math.ceil(self.over * r - 1e-9)

    def round_keep(self, r: int) -> int | None:
        return r
