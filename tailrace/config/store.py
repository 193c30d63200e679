"""The store section: the trajectory store's entry filter (flow/filters.py) and replay buffer
(flow/replay.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.config.fields import need, setting


@dataclass
class StoreConfig:
    replay: float = setting(
        0.0,
        "replayed groups per fresh group in each optimizer step (experience replay; 0 = off): groups "
        "trained before whose rewards differ, largest reward variance first, trained again off-policy "
        "against the logprobs that sampled them",
    )
    capacity: int = setting(64, "replay: groups the buffer holds (the newest)")
    max_age: int = setting(
        4,
        "replay: the staleness filter on exit: a group whose oldest token lags the trainer by more "
        "versions than this is evicted untrained",
    )
    uses: int = setting(1, "replay: times a group may be replayed")
    filter: str | None = setting(
        None,
        "your entry filter, module:function or path/to/file.py:function: keep(prompt, samples) -> bool "
        "is asked once per complete group; a group it refuses leaves untrained (discarded, reason "
        "filtered) and a fresh prompt takes its place, at most flow.extra_groups a step (past it, "
        "groups are trained as they are); null = none (flow.zero_signal is the built-in one)",
    )

    def __post_init__(self) -> None:
        need(0 <= self.replay <= 4, f"store.replay={self.replay}: must be between 0 (off) and 4")
        need(self.capacity >= 1, f"store.capacity={self.capacity}: must be at least 1")
        need(self.max_age >= 0, f"store.max_age={self.max_age}: must be >= 0")
        need(self.uses >= 1, f"store.uses={self.uses}: must be at least 1")
        where, sep, name = (self.filter or "x:x").rpartition(":")
        need(
            bool(sep and where) and name.isidentifier(),
            f"store.filter={self.filter!r}: write it as module:function or path/to/file.py:function",
        )

    def options(self) -> dict:
        """The options of `flow.replay.ReplayOptions`."""
        return {"ratio": self.replay, "capacity": self.capacity, "max_age": self.max_age, "uses": self.uses}
