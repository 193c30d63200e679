"""What DARTS' extra candidates save against what they cost: the redundancy budget that minimizes a
round's predicted time.

Lengths. A prompt's response runs to the cap (the longest length seen: the engines stop at max_len)
with the task's truncated fraction q (runaways), else runs min(Y, cap), Y lognormal with the mean m
and variance v its moving averages estimate (redundancy.LengthStats): s^2 = ln(1 + v / m^2),
mu = ln m - s^2 / 2, F(x) = (1 - q) Phi((ln x - mu) / s) below the cap, tabulated at GRID evenly
spaced points of [0, cap] (the last one F's limit from below).

Order statistics. Of n independent draws the k-th shortest is <= x iff at least k draws are, so
    P(X_(k:n) <= x) = sum_{j >= k} C(n, j) F^j (1 - F)^(n - j),
    E[X_(k:n)] = integral over [0, cap] of (1 - P(X_(k:n) <= x)) dx        (trapezoids on the grid),
    E[X_(k:n)^2] = integral of 2x (1 - P(X_(k:n) <= x)) dx.
A group of n candidates, M trained (K = M - L shortest non-truncated plus the L longest):
    waits for all n:   completes at X_(n:n); generates sum_k E[X_(k:n)] = n E[X] tokens;
                       trains, for n > M, sum_{k <= K} E[X_(k:n)] + sum_{k > n - L} E[Z_(k:n)],
                       Z ~ X below the cap (the truncated are not trained while enough others
                       finished; a few truncated are assumed); for n = M, all of them
    stops early:       completes at X_(M:n); generates sum_{k <= M} E[X_(k:n)] + (n - M) E[X_(M:n)]
                       (the others are aborted when the M-th finishes); trains its first M
(and the sum of the trained lengths' squares likewise, from the second moments).
With n = M and no early stop this is the plain group: X_(M:M), M E[X] tokens generated and trained.
Groups are independent, so the round's longest wait is E[max_i C_i] = integral of (1 - prod_i
P(C_i <= x)) dx, C_i group i's completion.

Time. A round of R prompts generates on `engines` engines whose decode step costs `step` seconds
plus `token` a row, and trains at `train_sample` seconds a sample, `train_token` a trained token and
`train_square` a squared trained length (attention's quadratic part):
    T_gen   = step x E[round length] + token x E[generated tokens] / engines
    T_train = train_sample x R x M + train_token x E[trained tokens] + train_square x E[sum of squares]
    T       = T_gen + T_train            (generation, then training: sync, pipe)
    T       = max(T_gen, T_train)        (`overlap`: a streaming mode trains while it generates)
Extras cut the trained tokens (the shortest of more candidates are trained) and, on early-stopped
prompts, the round length (the M-th of 2M finishes before the last of M); they add generated tokens,
and round length where a group waits for all 2M. Where the two overlap, only the slower side's
change counts: extras that save the trainer time are free while the engines keep ahead. The budget
is searched over whole prompts raised to 2M in darts' order (largest variance first; the first
`early` of them stop early), b = 0, M, ..., R x M, keeping the least T among those whose generated
tokens fit in the slots over the round (slots x E[round length]); ties go to the smaller budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

GRID = 129  # points of [0, cap] each distribution is tabulated at


@dataclass(frozen=True)
class Costs:
    step: float  # seconds of an engine's decode step, fixed part
    token: float  # seconds a decode row adds to a step
    train_sample: float  # seconds the trainer spends per trained sample
    train_token: float  # seconds the trainer spends per trained token
    train_square: float  # seconds the trainer spends per squared trained length
    engines: int  # engines decoding in parallel
    slots: int  # their rows in all
    overlap: bool = False  # generation and training run at once (the round takes the slower's time)


@dataclass(frozen=True)
class Group:
    done: list[float]  # P(the group has completed by x), on the grid
    generated: float  # expected tokens generated
    trained: float  # expected tokens trained
    squares: float  # expected sum of the trained lengths' squares


def lognormal_cdf(mean: float, var: float, cap: float, runaway: float = 0.0, grid: int = GRID) -> list[float]:
    """F(x) at `grid` even points of [0, cap] of a length that runs to the cap with probability
    `runaway`, else is lognormal of this mean and variance (cut at the cap)."""
    if mean <= 0 or var < 0 or cap <= 0 or not 0 <= runaway < 1:
        raise ValueError(
            f"lognormal_cdf: needs mean > 0, var >= 0, cap > 0, 0 <= runaway < 1 (got {mean}, {var}, {cap}, "
            f"{runaway})"
        )
    s = max(math.sqrt(math.log1p(var / mean**2)), 1e-9)
    mu = math.log(mean) - s * s / 2
    xs = (cap * g / (grid - 1) for g in range(grid))
    return [
        0.0 if x == 0 else (1 - runaway) * 0.5 * math.erfc((mu - math.log(x)) / (s * math.sqrt(2)))
        for x in xs
    ]


def expect(done: Sequence[float], h: float, power: int = 1) -> float:
    """E[C^power] (power 1 or 2) = integral of power x^(power-1) (1 - P(C <= x)) dx by trapezoids
    at spacing h (C within the grid)."""
    tail = [(1.0 - p) * (1 if power == 1 else 2 * g * h) for g, p in enumerate(done)]
    return h * (sum(tail) - (tail[0] + tail[-1]) / 2)


def order_cdfs(f: Sequence[float], n: int) -> list[list[float]]:
    """[P(X_(k:n) <= x) on the grid for k = 1..n], X with CDF f on the grid."""
    out = [[0.0] * len(f) for _ in range(n)]
    comb = [math.comb(n, j) for j in range(n + 1)]
    for g, p in enumerate(f):
        at_least = 0.0  # P(at least j of n draws <= x), j from n down
        for j in range(n, 0, -1):
            at_least += comb[j] * p**j * (1 - p) ** (n - j)
            out[j - 1][g] = min(at_least, 1.0)
    return out


def group(f: Sequence[float], h: float, n: int, m: int, longest: int, early: bool) -> Group:
    """Completion, generated and trained tokens of a group of n >= m candidates (module doc)."""
    cdfs = order_cdfs(f, n)
    means = [expect(c, h) for c in cdfs]  # E[X_(k:n)], k = 1..n
    squares = [expect(c, h, 2) for c in cdfs]  # E[X_(k:n)^2]
    if early:
        return Group(cdfs[m - 1], sum(means[:m]) + (n - m) * means[m - 1], sum(means[:m]), sum(squares[:m]))
    if n == m or not longest:
        kept = [*range(m - longest), *range(n - longest, n)]
        return Group(cdfs[n - 1], sum(means), sum(means[k] for k in kept), sum(squares[k] for k in kept))
    below = [p / f[-1] for p in f] if f[-1] > 0 else list(f)  # Z: X given it stopped below the cap
    top = order_cdfs(below, n)[n - longest :]
    trained = sum(means[: m - longest]) + sum(expect(c, h) for c in top)
    return Group(
        cdfs[n - 1], sum(means), trained, sum(squares[: m - longest]) + sum(expect(c, h, 2) for c in top)
    )


def best_budget(
    means: Sequence[float],
    variances: Sequence[float],
    cap: float,
    runaway: float,
    m: int,
    longest: int,
    early: int,
    costs: Costs,
    order: Sequence[int],
) -> int:
    """The extra candidates (a multiple of m, in [0, m x len(means)]) of least predicted round time,
    lengths cut at `cap` and a `runaway` share running to it, the prompts raised to 2m in `order`
    and the first `early` of them stopping early (module doc)."""
    h = cap / (GRID - 1)
    fs = [lognormal_cdf(mu, v, cap, runaway) for mu, v in zip(means, variances)]
    base = [group(fs[i], h, m, m, longest, False) for i in order]
    raised = [group(fs[i], h, 2 * m, m, longest, k < early) for k, i in enumerate(order)]
    rest = [[1.0] * GRID]  # rest[j][g] = prod over k >= j of base[k].done[g]
    for b in reversed(base):
        rest.insert(0, [p * q for p, q in zip(b.done, rest[0])])
    head = [1.0] * GRID  # prod over k < j of raised[k].done
    gen, trained = sum(b.generated for b in base), sum(b.trained for b in base)
    squares = sum(b.squares for b in base)
    best, best_t = 0, math.inf
    for j in range(len(order) + 1):
        if j:
            head = [p * q for p, q in zip(head, raised[j - 1].done)]
            gen += raised[j - 1].generated - base[j - 1].generated
            trained += raised[j - 1].trained - base[j - 1].trained
            squares += raised[j - 1].squares - base[j - 1].squares
        length = expect([p * q for p, q in zip(head, rest[j])], h)
        if j and gen > costs.slots * length:
            continue  # the extras do not fit in the slots over the round
        t_gen = costs.step * length + costs.token * gen / max(costs.engines, 1)
        t_train = (
            costs.train_sample * m * len(order) + costs.train_token * trained + costs.train_square * squares
        )
        t = max(t_gen, t_train) if costs.overlap else t_gen + t_train
        if t < best_t * (1 - 1e-12):
            best, best_t = j * m, t
    return best
