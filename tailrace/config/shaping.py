"""The shaping section: how the response-length distribution is shaped on top of any flow.mode."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.config.fields import need, setting


@dataclass
class ShapingConfig:
    name: str = setting(
        "none",
        "none (every sample trained) or darts (extra candidates for the prompts whose lengths spread widest, train the "
        "shortest + the longest): a shaping of flow/shaping",
    )
    extra: float = setting(
        0.5, "darts: extra candidates per round, a fraction of R x G, to the prompts of widest length spread"
    )
    longest: int = setting(1, "darts: L, the longest non-truncated candidates kept (the rest: the shortest)")
    early_stop: float = setting(
        0.1, "darts: fraction of a round's prompts (the widest spread) that keep their first G finishers"
    )
    ema: float = setting(0.5, "darts: weight of a prompt's newest group in its length statistics")

    def __post_init__(self) -> None:
        need(
            0 <= self.extra <= 1, f"shaping.extra={self.extra}: must lie in [0, 1] (0 = no extra candidates)"
        )
        need(self.longest >= 0, f"shaping.longest={self.longest}: must be >= 0")
        need(0 <= self.early_stop <= 1, f"shaping.early_stop={self.early_stop}: must lie in [0, 1]")
        need(0 < self.ema <= 1, f"shaping.ema={self.ema}: must lie in (0, 1]")

    def options(self) -> dict:
        """The options of `flow.shaping.make_shaping` (all but the name)."""
        return {"extra": self.extra, "longest": self.longest, "early_stop": self.early_stop, "ema": self.ema}
