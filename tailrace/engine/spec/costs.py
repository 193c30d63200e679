"""The toggle: whether, and how far, to speculate, predicted from the engine's own step timings
(pure Python; durations are passed in, nothing reads a clock).

With per-token acceptance alpha and draft length g, a verify step emits on average
    L(alpha, g) = (1 - alpha^(g + 1)) / (1 - alpha)        (g + 1 when alpha = 1)
tokens per row (Leviathan et al.), and costs one forward over b (g + 1) tokens plus the drafting, against
b tokens for a plain decode step at batch b. So (EfficientRollout's roofline form)
    speed-up = L / (g r + v),   v = T(b (g + 1)) / T(b),   r = D(b, g) / (g T(b)),
T(m): the engine's step time with m tokens in its forward, D(b, g): the drafter's time for b rows.
`StepCosts` fits T from every step the engine times (decode, prefill and verify steps alike: a step's
cost follows the tokens it runs through the weights), `DraftCosts` fits D from the drafter's calls.
`Toggle.gamma` turns the prediction into a draft length per request: the length up to the ladder's
that maximizes the predicted speed-up, or 0 (no speculation) where even that is below `min_speedup`.
"""

from __future__ import annotations

import bisect
import math

# A bucket's estimate moves toward a new timing by FALL when it is lower, RISE when higher: on a shared
# machine timings err upward (a step preempted by a neighbour), so the curve tracks the uncontended
# cost, which is what decode and verify steps are compared by; still, a lasting change shows in time.
FALL, RISE = 0.5, 0.05
REFIT_EVERY = 32  # observations between recomputations of the toggle's tables
ALPHAS = 20  # the toggle's table resolution in alpha: buckets of 1/ALPHAS


def expected_length(alpha: float, gamma: int) -> float:
    """Mean tokens a verify of `gamma` drafts emits per row at per-token acceptance `alpha`."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, r: float, v: float) -> float:
    """EfficientRollout's predicted speed-up: expected length over (gamma r + v) (see module doc)."""
    return expected_length(alpha, gamma) / (gamma * r + v)


def bucket(n: int) -> int:
    """Bucket of a count: itself up to 16, then quarter-octaves (16, 19, 22, 26, 32, 38, ...)."""
    if n <= 16:
        return max(n, 1)
    return round(16 * 2 ** (round(4 * math.log2(n / 16)) / 4))


class Curve:
    """A cost curve y(n) learned from noisy samples: an average per bucket of n (see FALL), linear interpolation
    between known buckets, the first bucket's value below it, and past the last one the last segment's
    slope (never below zero; proportional to n while only one bucket is known). None until then."""

    def __init__(self) -> None:
        self._x: list[int] = []  # known buckets, ascending
        self._y: list[float] = []

    def observe(self, n: int, y: float) -> None:
        b = bucket(n)
        i = bisect.bisect_left(self._x, b)
        if i < len(self._x) and self._x[i] == b:
            self._y[i] += (FALL if y < self._y[i] else RISE) * (y - self._y[i])
        else:
            self._x.insert(i, b)
            self._y.insert(i, y)

    def __call__(self, n: float) -> float | None:
        x, y = self._x, self._y
        if not x:
            return None
        if n <= x[0]:
            return y[0]
        if len(x) == 1:
            return y[0] * n / x[0]
        i = min(bisect.bisect_left(x, n), len(x) - 1)  # n in the segment [x[i-1], x[i]], or past it
        slope = max(0.0, (y[i] - y[i - 1]) / (x[i] - x[i - 1]))
        return y[i - 1] + slope * (n - x[i - 1])


class Toggle:
    """Draft lengths per (active batch, alpha) from the fitted costs. `per_token_draft`: the drafter's
    time grows with the draft length (a model drafting token by token) rather than per call (a lookup)."""

    def __init__(self, per_token_draft: bool, min_speedup: float = 1.05):
        self.per_token_draft, self.min_speedup = per_token_draft, min_speedup
        self.step = Curve()  # seconds of an engine step (drafting excluded) by tokens in the forward
        self.draft = Curve()  # seconds of one draft step (per_token_draft) or call, by rows drafted
        self._seen = 0
        self._tables: dict[tuple[int, int], list[int]] = {}

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.step.observe(tokens, seconds)
        self._tick()

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        """A drafter call over `rows` rows that ran `steps` draft steps (the longest draft)."""
        self.draft.observe(rows, seconds / max(steps, 1) if self.per_token_draft else seconds)
        self._tick()

    def _tick(self) -> None:
        self._seen += 1
        if self._seen % REFIT_EVERY == 0:
            self._tables.clear()

    def predict(self, batch: int, alpha: float, gamma: int) -> float | None:
        """Predicted speed-up of every one of `batch` rows drafting `gamma` tokens (None: no timings)."""
        t, tv = self.step(batch), self.step(batch * (gamma + 1))
        if t is None or tv is None:
            return None
        tv = max(tv, t)  # more tokens never cost less (the curve's buckets are noisy)
        d = self.draft(batch)
        if d is None:  # not measured yet: a model drafter as dear as the target, a lookup free
            d = t if self.per_token_draft else 0.0
        d *= gamma if self.per_token_draft else 1
        return speedup(alpha, gamma, d / (gamma * t), tv / t)

    def gamma(self, batch: int, alpha: float, gamma_max: int) -> int:
        """The draft length for a request with acceptance `alpha` at this active batch: the one up to
        `gamma_max` with the best predicted speed-up, 0 where that is below `min_speedup` (or unknown)."""
        key = (batch, gamma_max)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = [self._best(batch, i / ALPHAS, gamma_max) for i in range(ALPHAS + 1)]
        return table[min(ALPHAS, max(0, int(alpha * ALPHAS)))]  # rounded down: never optimistic

    def _best(self, batch: int, alpha: float, gamma_max: int) -> int:
        best, best_g = self.min_speedup, 0
        for g in range(1, gamma_max + 1):
            s = self.predict(batch, alpha, g)
            if s is not None and s >= best:
                best, best_g = s, g
        return best_g
