"""`Speculator`: an engine's speculative-decoding policy and books -- which decode rows draft each
step and how far, and what came of it. Plain Python: the engine does the tensor work and reports here.

Per step the draft length of a request is `Toggle.gamma(active batch, its acceptance, ladder's length)`:
the ladder (`ladder`) follows the drafter's measured acceptance round by round, the toggle (`costs`)
cuts it to what pays at this batch, or to 0. A request's acceptance is its own recent drafts' record
shrunk toward the drafter's recent one (a few drafts say little), so a request whose drafts keep
failing stops drafting, and one without a record starts from the drafter's. A request that stopped
drafts PROBE tokens on every EXPLORE-th step where the drafter's own acceptance would pay, so a record
that has turned (a history that now matches) is seen again; a drafter that always fails costs those
probes until its own acceptance falls too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tailrace.engine.spec.costs import Toggle
from tailrace.engine.spec.drafter import DraftEnv, Drafter, Trained
from tailrace.engine.spec.ladder import Rung, climb, rungs
from tailrace.engine.spec.stats import SpecStats

ROUND = 32  # steps with verifies per ladder round
PRIOR = 4.0  # weight, in judged draft tokens, of the drafter's acceptance in a request's estimate
DECAY = 0.995  # per verify: how fast the drafter's acceptance forgets (about the last 200 verifies)
ALPHA0 = 0.5  # the drafter's acceptance before any verify
FORGET = 0.8  # per verify of a request: the weight its older record keeps
EXPLORE, PROBE = 16, 2


@dataclass(frozen=True)
class SpecOptions:
    """How an engine speculates. `drafter`: a name in `spec.DRAFTERS` or a factory of a `Drafter`;
    `toggle`: draft only where the fitted cost model predicts at least `min_speedup` at the active
    batch (False: every decode row drafts the ladder's length, for measurements); the ladder runs
    from `gamma_min` to `gamma_max` draft tokens (see `ladder.rungs`); `train_s`: the seconds a trained
    drafter may learn per idle period of the engine (0: never: a frozen drafter)."""

    drafter: str | Callable[[DraftEnv], Drafter] = "history"
    toggle: bool = True
    min_speedup: float = 1.05
    gamma_min: int = 5
    gamma_max: int = 11
    train_s: float = 5.0

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_min <= self.gamma_max:
            raise ValueError(
                f"gamma bounds {self.gamma_min}..{self.gamma_max}: need 1 <= gamma_min <= gamma_max"
            )
        if self.min_speedup <= 0:
            raise ValueError(f"min_speedup={self.min_speedup}: must be > 0")
        if not self.train_s >= 0:
            raise ValueError(f"train_s={self.train_s}: seconds of drafter training per idle period, >= 0")


class Speculator:
    def __init__(self, drafter: Drafter, options: SpecOptions | None = None):
        o = options or SpecOptions()
        self.drafter, self.toggled, self.train_s = drafter, o.toggle, o.train_s
        self._idle_left = o.train_s  # training seconds left in this idle period
        # a drafter may say what a draft step costs before it is timed (`cost_prior`; quant8 on the int8
        # GEMM: about 0.6 of a decode step) and what it accepts before any verify (`alpha_prior`; int8
        # RTN: ~0.9); without them, the toggle's default for its kind and ALPHA0
        self.toggle = Toggle(drafter.per_token_cost, o.min_speedup, getattr(drafter, "cost_prior", None))
        self.rung = Rung(rungs=rungs(o.gamma_min, o.gamma_max))
        self.stats = SpecStats(gamma=self.rung.gamma)
        alpha0 = getattr(drafter, "alpha_prior", None) or ALPHA0
        self._acc, self._cmp = alpha0 * PRIOR, PRIOR  # the drafter's decayed record
        self._round = [0, 0, 0]  # steps with verifies, accepted, compared in this round
        self._budget = getattr(drafter, "budget", None)  # optional (see `budget`): looked up once

    @property
    def alpha(self) -> float:
        return self._acc / self._cmp

    def cap(self, batch: int) -> int:
        """The ladder's draft length if drafting could pay at this active batch at all (and it is not
        vetoed on measurement), else 0 -- then no row is even asked."""
        g = self.rung.gamma
        return g if not self.toggled or self.toggle.gamma(batch, 1.0, g) else 0

    def gamma(self, accepted: float, compared: float, batch: int, cap: int, step: int) -> int:
        """Draft length at decode step `step` for a request whose recent drafts had `accepted` of
        `compared` tokens accepted (see `record`)."""
        if not self.toggled:
            return cap
        alpha = (accepted + PRIOR * self.alpha) / (compared + PRIOR)
        g = self.toggle.gamma(batch, alpha, cap)
        if g or step % EXPLORE or not self.toggle.gamma(batch, self.alpha, cap):
            return g
        return min(PROBE, cap)

    def budget(self, prompt: tuple[int, ...], k: int) -> int:
        """`k` cut to what the drafter says it can give a request of `prompt` (its optional `budget`)."""
        return self._budget(prompt, k) if self._budget is not None and k > 0 else k

    @staticmethod
    def record(accepted: float, compared: float, a: int, c: int) -> tuple[float, float]:
        """A request's record after a verify that accepted a of c judged draft tokens."""
        return accepted * FORGET + a, compared * FORGET + c

    def verified(self, version: int, drafted: int, accepted: int, compared: int) -> None:
        """One row's verify (a request of policy `version`): `accepted` of `drafted` draft tokens,
        `compared` of them judged."""
        self.stats.verified(version, drafted, accepted, compared)
        self._acc = self._acc * DECAY + accepted
        self._cmp = self._cmp * DECAY + compared
        self._round[1] += accepted
        self._round[2] += compared

    def idle(self, budget_s: float) -> Trained | None:
        """The engine has nothing to run: the drafter may learn for up to `budget_s` seconds of what
        is left of this idle period's `train_s` (a step of the engine starts a new period)."""
        take = min(budget_s, self._idle_left)
        done = self.drafter.train(take) if take > 0 else None
        if done is not None:
            self._idle_left -= done.seconds
            self.stats.trained(done.steps, done.seconds, done.loss)
        return done

    def step(self, active: int, verifies: int, emitted: int) -> None:
        """A step's decode rows: how many verified a draft, tokens emitted; closes ladder rounds."""
        self._idle_left = self.train_s
        if not active:
            return
        self.stats.step(active, verifies, emitted)
        if not verifies:
            return
        self._round[0] += 1
        if self._round[0] >= ROUND:
            _, acc, cmp = self._round
            self.rung = climb(self.rung, acc / cmp if cmp else 0.0)
            self.stats.gamma = self.rung.gamma
            self._round = [0, 0, 0]
