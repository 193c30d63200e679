"""The toggle: whether, and how far, to speculate, predicted from the engine's own step timings
(pure Python; durations are passed in, nothing reads a clock).

With per-token acceptance alpha and draft length g, a verify step emits on average
    L(alpha, g) = (1 - alpha^(g + 1)) / (1 - alpha)        (g + 1 when alpha = 1)
tokens per row (Leviathan et al.), against one for a plain decode step. EfficientRollout's roofline
form of the speed-up at active batch b:
    speed-up = L / (g r + v),   v = T_verify(b, g) / T_decode(b),   r = D(b, g) / (g T_decode(b)),
with D the drafter's time. `Toggle` measures T_decode(b) directly (every decode step at batch b) and
models a verify step as that plus its excess, x per draft token through the weights and y per row that
verifies (its bookkeeping) -- fitted to the excess of every verify step over T_decode at its batch,
and before any verify from the decode steps alone (x: the marginal cost of a row). On a CPU at these
sizes both the fixed cost of a step and the cost per token are large, so v grows fast with b g: the
toggle turns a request's draft length into the one up to the ladder's with the best predicted
speed-up, or 0 (no speculation) where even that is below `min_speedup`.

The model can be wrong (a fit from few or noisy timings, costs it leaves out), so the toggle also
checks what it gets: per batch bucket, the realized speed-up of the steps that verified drafts (tokens
emitted per row over the step's time with drafting, against the average plain decode step there). A
bucket whose realized speed-up falls below VETO over JUDGED verify steps is vetoed (no drafts at all)
for RETRY plain steps there, then tried afresh (acceptance changes: a history fills, weights move);
each time a retried bucket is vetoed again it waits twice as long (up to RETRY_MAX), so a batch where
drafting keeps losing costs ever fewer trials, and a trial that pays resets the wait.
"""

from __future__ import annotations

import bisect
import math

# Every fitted time moves toward a new timing by FALL when it is lower, RISE when higher: on a shared
# machine timings err upward (a neighbour's burst), so the fits track the uncontended cost, which is
# what decode and verify steps are compared by; a lasting change still shows within ~50 steps.
FALL, RISE = 0.3, 0.05
REFIT_EVERY = 32  # observations between recomputations of the toggle's tables
ALPHAS = 20  # the toggle's table resolution in alpha: buckets of 1/ALPHAS
TRUSTED = 8  # verify timings before their fit replaces the prior (a draft token costs a decode row)
VETO, JUDGED = 1.0, 4  # realized speed-up below which a bucket is vetoed, after this many verify steps
RETRY = 256  # plain steps a vetoed bucket waits before it is tried again; twice that after each failed
RETRY_MAX = 16_384  # retry, up to this (a trial that pays resets it): a losing batch is tried ever less
GAIN_EMA = 0.2  # weight of a step in its bucket's realized speed-up (and plain step time)


def expected_length(alpha: float, gamma: int) -> float:
    """Mean tokens a verify of `gamma` drafts emits per row at per-token acceptance `alpha`."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, r: float, v: float) -> float:
    """EfficientRollout's predicted speed-up: expected length over (gamma r + v) (see module doc)."""
    return expected_length(alpha, gamma) / (gamma * r + v)


class LowFit:
    """y ~ w . x tracking the uncontended (low) side of noisy samples: a normalized least-mean-squares
    step toward each sample, FALL of the way when the sample is below the prediction, RISE when above
    (for one feature, the asymmetric average `ByBatch` keeps). Starts from `prior`."""

    def __init__(self, prior: list[float]):
        self.w = list(prior)
        self.weight = 0  # samples seen

    def observe(self, x: list[float], y: float) -> None:
        r = y - self(x)
        norm = sum(v * v for v in x)
        if norm > 0:
            step = (FALL if r < 0 else RISE) * r / norm
            self.w = [w + step * v for w, v in zip(self.w, x)]
        self.weight += 1

    def __call__(self, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self.w, x))


def bucket(n: int) -> int:
    """Bucket of a batch size: itself up to 16, then quarter-octaves (16, 19, 22, 26, 32, 38, ...)."""
    if n <= 16:
        return max(n, 1)
    return round(16 * 2 ** (round(4 * math.log2(n / 16)) / 4))


class ByBatch:
    """A step time per batch bucket (see FALL); between known buckets, linear interpolation; outside
    them, nothing."""

    def __init__(self) -> None:
        self._t: dict[int, float] = {}
        self._keys: list[int] = []

    def observe(self, batch: int, ms: float) -> None:
        b = bucket(batch)
        t = self._t.get(b)
        if t is None:
            self._t[b] = ms
            self._keys = sorted(self._t)
        else:
            self._t[b] = t + (FALL if ms < t else RISE) * (ms - t)

    def __call__(self, batch: int) -> float | None:
        b = bucket(batch)
        if b in self._t:
            return self._t[b]
        k = self._keys
        i = bisect.bisect_left(k, b)
        if i == 0 or i == len(k):
            return None
        lo, hi = k[i - 1], k[i]
        return self._t[lo] + (self._t[hi] - self._t[lo]) * (b - lo) / (hi - lo)

    def per_row(self) -> float | None:
        """The marginal cost of one more row: the slope across the known batches (None: fewer than two)."""
        k = self._keys
        if len(k) < 2:
            return None
        return max(0.0, (self._t[k[-1]] - self._t[k[0]]) / (k[-1] - k[0]))


class Realized:
    """Per batch bucket: the plain decode step's average time and the realized speed-up of verify steps
    (plain averages, not low-side fits: both sides of the comparison carry the machine's noise)."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}
        self.gain: dict[int, list[float]] = {}  # bucket -> [speed-up average, steps]

    def observe_plain(self, batch: int, ms: float) -> None:
        b = bucket(batch)
        t = self.plain.get(b)
        self.plain[b] = ms if t is None else t + GAIN_EMA * (ms - t)

    def observe_verify(self, batch: int, emitted: int, ms: float) -> float | None:
        """A verify step's speed-up over the average plain step at its batch (None: none timed yet)."""
        b = bucket(batch)
        t = self.plain.get(b)
        if t is None or ms <= 0:
            return None
        x = (emitted / batch) * t / ms
        g = self.gain.setdefault(b, [x, 0])
        g[0] += GAIN_EMA * (x - g[0])
        g[1] += 1
        return g[0]


class Toggle:
    """Draft lengths per (active batch, alpha) from fitted costs (milliseconds). `per_token_draft`: the
    drafter's time grows with the draft length (a model drafting token by token) rather than per call
    (a lookup)."""

    def __init__(self, per_token_draft: bool, min_speedup: float = 1.05, draft_prior: float | None = None):
        """`draft_prior`: a draft step's time over a plain decode step's at the same batch, until the
        drafter's own time is measured (None: 1 for a model drafter, 0 for a lookup). A prior of 1
        never predicts a gain, so such a drafter is never tried: a cheaper one must say so."""
        self.per_token_draft, self.min_speedup = per_token_draft, min_speedup
        self.draft_prior = draft_prior if draft_prior is not None else 1.0 if per_token_draft else 0.0
        self.decode = ByBatch()  # a decode step without drafts or prefill, by active batch
        self.excess: LowFit | None = None  # a verify's excess, per [draft token, verifying row]
        self.draft: LowFit | None = None  # the drafter's time per [call, 8 rows], per draft step or call
        self.realized = Realized()
        self.vetoed: dict[int, int] = {}  # batch bucket where drafting measured not to pay -> steps left
        self.wait: dict[int, int] = {}  # batch bucket -> plain steps its next veto lasts (absent: RETRY)
        self._seen = 0
        self._tables: dict[tuple[int, int, int], int] = {}  # (batch, gamma_max, alpha bucket) -> gamma

    def observe_step(
        self, batch: int, drafted: int, verifies: int, seconds: float, draft_s: float = 0.0, emitted: int = 0
    ) -> None:
        """An engine step without prefill: `batch` decode rows, `verifies` of them with `drafted` draft
        tokens in all, `seconds` without the drafter's `draft_s`; its rows emitted `emitted` tokens."""
        ms = seconds * 1e3
        b = bucket(batch)
        if not verifies:
            self.decode.observe(batch, ms)
            self.realized.observe_plain(batch, ms)
            if b in self.vetoed:
                self.vetoed[b] -= 1
                if not self.vetoed[b]:  # a fresh trial
                    del self.vetoed[b]
                    self.realized.gain.pop(b, None)
            return self._tick()
        gain = self.realized.observe_verify(batch, emitted, ms + draft_s * 1e3)
        if gain is not None and self.realized.gain[b][1] >= JUDGED:
            if gain < VETO:
                self.vetoed[b] = self.wait.get(b, RETRY)
                self.wait[b] = min(2 * self.vetoed[b], RETRY_MAX)
            else:
                self.wait.pop(b, None)
        t, per_row = self.decode(batch), self.decode.per_row()
        if t is None or per_row is None:
            return
        if self.excess is None:
            self.excess = LowFit([per_row, 0.0])
        self.excess.observe([drafted, verifies], ms - t)
        self._tick()

    def observe_draft(self, rows: int, steps: int, seconds: float) -> None:
        """A drafter call over `rows` rows that ran `steps` draft steps (the longest draft)."""
        ms = seconds * 1e3 / (max(steps, 1) if self.per_token_draft else 1)
        if self.draft is None:
            self.draft = LowFit([ms, 0.0])
        self.draft.observe([1.0, rows / 8], ms)
        self._tick()

    def _tick(self) -> None:
        self._seen += 1
        if self._seen % REFIT_EVERY == 0:
            self._tables.clear()

    def predict(self, batch: int, alpha: float, gamma: int) -> float | None:
        """Predicted speed-up of every one of `batch` rows drafting `gamma` tokens (None: the decode time
        at this batch is not known yet)."""
        t = self.decode(batch)
        if t is None or t <= 0:
            return None
        if self.excess is not None and self.excess.weight >= TRUSTED:
            extra = self.excess([batch * gamma, batch])
        else:  # no verify timed yet: a draft token costs what one more decode row does
            per_row = self.decode.per_row()
            if per_row is None:
                return None
            extra = per_row * batch * gamma
        if self.draft is not None:
            d = self.draft([1.0, batch / 8])
        else:  # not measured yet: the drafter's prior (a model as dear as the target, a lookup free)
            d = t * self.draft_prior
        d = max(d, 0.0) * (gamma if self.per_token_draft else 1)
        v = 1.0 + max(extra, 0.0) / t  # a verify never costs less than the decode step it replaces
        return speedup(alpha, gamma, d / (gamma * t), v)

    def is_vetoed(self, batch: int) -> bool:
        return bool(self.vetoed) and bucket(batch) in self.vetoed

    def gamma(self, batch: int, alpha: float, gamma_max: int, veto: bool = True) -> int:
        """The draft length for a request with acceptance `alpha` at this active batch: the one up to
        `gamma_max` with the best predicted speed-up, 0 where that is below `min_speedup` (or unknown),
        or where the batch is vetoed (unless `veto` is False: what the model alone says)."""
        if veto and self.is_vetoed(batch):
            return 0
        a = min(ALPHAS, max(0, int(alpha * ALPHAS)))  # rounded down: never optimistic
        key = (batch, gamma_max, a)
        g = self._tables.get(key)
        if g is None:  # filled as asked: the batch moves every few steps while a rollout drains
            g = self._tables[key] = self._best(batch, a / ALPHAS, gamma_max)
        return g

    def _best(self, batch: int, alpha: float, gamma_max: int) -> int:
        best, best_g = self.min_speedup, 0
        for g in range(1, gamma_max + 1):
            s = self.predict(batch, alpha, g)
            if s is not None and s >= best:
                best, best_g = s, g
        return best_g
