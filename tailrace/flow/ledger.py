"""The ledger: every finished sample is accounted for exactly once.

    produced = trained + in_store + discarded        (checked every step)

`produced` counts samples that reached a terminal state (stopped, truncated, or aborted for good);
an aborted partial that will be resumed is not produced yet. Every discard carries a reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class LedgerError(AssertionError):
    pass


@dataclass
class Ledger:
    produced: int = 0
    trained: int = 0
    discarded: Counter = field(default_factory=Counter)  # reason -> count

    def on_produced(self, n: int = 1) -> None:
        self.produced += n

    def on_trained(self, n: int) -> None:
        self.trained += n

    def on_discarded(self, reason: str, n: int = 1) -> None:
        if not reason:
            raise LedgerError("a discard needs a reason")
        self.discarded[reason] += n

    @property
    def total_discarded(self) -> int:
        return sum(self.discarded.values())

    def check(self, in_store: int) -> None:
        """Raise unless produced = trained + in_store + discarded (in_store counted by the caller)."""
        rhs = self.trained + in_store + self.total_discarded
        if self.produced != rhs:
            raise LedgerError(
                f"ledger broken: produced {self.produced} != trained {self.trained} + in_store "
                f"{in_store} + discarded {self.total_discarded} ({dict(self.discarded)})"
            )

    def state_dict(self) -> dict:
        return {"produced": self.produced, "trained": self.trained, "discarded": dict(self.discarded)}

    @classmethod
    def from_state(cls, d: dict) -> "Ledger":
        return cls(produced=d["produced"], trained=d["trained"], discarded=Counter(d["discarded"]))
