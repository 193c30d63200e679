"""`SpecStats`: the engine's running books of speculative decoding (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    row_steps: int = 0  # decode rows summed over steps: each is one row in one target forward
    emitted: int = 0  # tokens those rows emitted (one each, more where a draft was accepted)
    verifies: int = 0  # rows that verified a draft, summed over steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    compared: int = 0  # of them, judged (those up to the first rejection): the acceptance's denominator
    draft_passes: int = 0  # forward passes a model drafter ran
    draft_s: float = 0.0  # seconds spent drafting
    gamma: int = 0  # the ladder's draft length now
    by_batch: dict[int, list[int]] = field(default_factory=dict)  # active batch -> [row-steps, verifies]
    by_version: dict[int, list[int]] = field(
        default_factory=dict
    )  # policy version -> [drafted, accepted, compared]
    train_steps: int = 0  # a trained drafter's optimizer steps (in idle time)
    train_s: float = 0.0  # seconds they took
    train_loss: float = float("nan")  # the last step's loss

    def verified(self, version: int, drafted: int, accepted: int, compared: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.compared += compared
        c = self.by_version.setdefault(version, [0, 0, 0])
        c[0] += drafted
        c[1] += accepted
        c[2] += compared

    def trained(self, steps: int, seconds: float, loss: float) -> None:
        self.train_steps += steps
        self.train_s += seconds
        self.train_loss = loss

    def step(self, active: int, verifies: int, emitted: int) -> None:
        self.row_steps += active
        self.emitted += emitted
        self.verifies += verifies
        c = self.by_batch.setdefault(active, [0, 0])
        c[0] += active
        c[1] += verifies

    @property
    def acceptance(self) -> float:
        """Per draft token (the alpha of `costs.expected_length`)."""
        return self.accepted / self.compared if self.compared else 0.0

    def acceptance_by_version(self) -> dict[int, float]:
        """Per policy version of the drafting requests: the acceptance of its draft tokens."""
        return {v: a / c for v, (_, a, c) in sorted(self.by_version.items()) if c}

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per verify."""
        return self.accepted / self.verifies if self.verifies else 0.0

    @property
    def passes_per_token(self) -> float:
        """Target forward passes per generated token, per row: 1 without speculation."""
        return self.row_steps / self.emitted if self.emitted else 0.0

    def on_fraction(self) -> dict[int, float]:
        """Per active batch: the share of its decode rows that verified a draft."""
        return {b: v / n for b, (n, v) in sorted(self.by_batch.items()) if n}
