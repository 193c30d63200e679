"""The shaping section: how the response-length distribution is shaped on top of any flow.mode."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.config.fields import need, setting


@dataclass
class ShapingConfig:
    name: str = setting(
        "none",
        "none (every sample trained), darts (extra candidates for the prompts whose lengths spread widest, train the "
        "shortest + the longest) or tailbatch (sync only: rounds of eta x R prompts keep the first R to complete, "
        "the slow ones rerun together in a tail round) or april (sync only: rounds of `over` x R prompts train the "
        "first R to complete and carry the rest, partials resumed under the new weights) or sorted (sync only: "
        "SortedRL, a round's groups trained U at a time as they complete, within flow.max_staleness): a shaping of "
        "flow/shaping",
    )
    extra: float | None = setting(
        None,
        "darts: extra candidates per round, a fraction of R x G, to the prompts of widest length spread "
        "(null: the budget of least predicted round time, from the engines' and the trainer's measured costs)",
    )
    longest: int = setting(1, "darts: L, the longest non-truncated candidates kept (the rest: the shortest)")
    early_stop: float = setting(
        0.1, "darts: fraction of a round's prompts (the widest spread) that keep their first G finishers"
    )
    ema: float = setting(0.5, "darts: weight of a prompt's newest group in its length statistics")
    eta: float = setting(
        1.25, "tailbatch: prompts a short round opens, x flow.prompts_per_round (keeps the first R)"
    )
    eta_responses: float = setting(
        1.25,
        "tailbatch: candidates per prompt in a short round, x flow.samples_per_prompt (keeps the first M)",
    )
    over: float = setting(
        2.0,
        "april: prompts a round keeps going, x flow.prompts_per_round (carried ones included; trains the first R); "
        "sorted: the rollout batch, x flow.prompts_per_round (trained U groups at a time)",
    )

    def __post_init__(self) -> None:
        need(
            self.extra is None or 0 <= self.extra <= 1,
            f"shaping.extra={self.extra}: must lie in [0, 1] (0 = no extra candidates), or null (the "
            "budget of least predicted round time)",
        )
        need(self.longest >= 0, f"shaping.longest={self.longest}: must be >= 0")
        need(0 <= self.early_stop <= 1, f"shaping.early_stop={self.early_stop}: must lie in [0, 1]")
        need(0 < self.ema <= 1, f"shaping.ema={self.ema}: must lie in (0, 1]")
        need(1 <= self.eta <= 2, f"shaping.eta={self.eta}: must lie in [1, 2] (1 = no extra prompts)")
        need(
            1 <= self.over <= (8 if self.name == "sorted" else 2),
            f"shaping.over={self.over}: must lie in [1, 2] (april; 1 = no over-provisioning), [1, 8] for sorted",
        )
        need(
            1 <= self.eta_responses <= 2,
            f"shaping.eta_responses={self.eta_responses}: must lie in [1, 2] (1 = no extra candidates)",
        )

    def options(self) -> dict:
        """The options of `flow.shaping.make_shaping` (all but the name)."""
        return {
            "extra": self.extra, "longest": self.longest,
            "early_stop": self.early_stop, "ema": self.ema,
            "eta": self.eta, "eta_responses": self.eta_responses, "over": self.over,
        }  # fmt: skip
