"""DARTS' adaptive redundancy: how many candidates each prompt of a window gets, from what its
earlier samples said about its length spread.

`LengthStats` keeps, per prompt id, an exponential moving average of the mean and variance of its
samples' lengths (updated once per completed group); a prompt not seen yet uses the task-level prior,
the moving averages of every observed group's mean and variance. It also keeps the longest length
seen (the cap) and the task's truncated fraction, what benefit.py models runaways with. `allocate`
spends an extra-sample budget greedily on the prompts of largest variance (`by_spread`), each getting
between M and 2M candidates. The budget is a fixed share of the window (`shaping.extra`), or the one
of least predicted round time (benefit.py) under the engines' and the trainer's costs, each fitted to
their reports by `StepCost`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

CUT_DECAY = 0.99  # weight of a group's truncation counts per later group


@dataclass
class LengthStats:
    alpha: float = 0.5  # weight of the newest group in each moving average
    mean: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its mean length
    var: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its length variance
    prior: float | None = None  # EMA of every observed group's variance (cold prompts' estimate)
    typical: float | None = None  # EMA of every observed group's mean length
    longest: float | None = None  # EMA of every observed group's longest length
    cap: int | None = None  # the longest length seen (the engines cut responses there)
    cut: list[float] = field(default_factory=lambda: [0.0, 0.0])  # truncated, samples: decayed counts

    def observe(self, prompt_id: int, lengths: Sequence[int], truncated: int = 0) -> None:
        """One completed group's sample lengths (population mean and variance), `truncated` of them
        cut at the length limit."""
        if not lengths:
            return
        mu = sum(lengths) / len(lengths)
        var = sum((x - mu) ** 2 for x in lengths) / len(lengths)
        a = self.alpha
        self.mean[prompt_id] = mu if prompt_id not in self.mean else (1 - a) * self.mean[prompt_id] + a * mu
        self.var[prompt_id] = var if prompt_id not in self.var else (1 - a) * self.var[prompt_id] + a * var
        self.prior = var if self.prior is None else (1 - a) * self.prior + a * var
        self.typical = mu if self.typical is None else (1 - a) * self.typical + a * mu
        top = max(lengths)
        self.longest = top if self.longest is None else (1 - a) * self.longest + a * top
        self.cap = top if self.cap is None else max(self.cap, top)
        self.cut = [CUT_DECAY * self.cut[0] + truncated, CUT_DECAY * self.cut[1] + len(lengths)]

    def variance(self, prompt_id: int) -> float:
        """The prompt's estimated length variance (the prior for a cold prompt; 0 before any data)."""
        return self.var.get(prompt_id, self.prior or 0.0)

    def truncated(self) -> float:
        """The task's truncated fraction: truncated over samples, each group's counts weighted down by
        CUT_DECAY per later group (a rate of a few percent needs many groups, not the last one)."""
        return self.cut[0] / self.cut[1] if self.cut[1] else 0.0

    def mean_length(self, prompt_id: int) -> float:
        """The prompt's estimated mean length (the task-level one for a cold prompt; 0 before any data)."""
        return self.mean.get(prompt_id, self.typical or 0.0)

    def state_dict(self) -> dict:
        return {
            "mean": [[k, v] for k, v in self.mean.items()],
            "var": [[k, v] for k, v in self.var.items()],
            "prior": self.prior,
            "typical": self.typical,
            "longest": self.longest,
            "cap": self.cap,
            "cut": self.cut,
        }

    def load_state_dict(self, d: dict) -> None:
        self.mean = {int(k): v for k, v in d["mean"]}
        self.var = {int(k): v for k, v in d["var"]}
        self.prior = d["prior"]
        self.typical, self.longest = d.get("typical"), d.get("longest")  # older checkpoints lack them
        self.cap, self.cut = d.get("cap"), list(d.get("cut", [0.0, 0.0]))


def by_spread(variances: Sequence[float]) -> list[int]:
    """Prompt indices, largest variance first (ties: the earlier prompt first): the order extras go in."""
    return sorted(range(len(variances)), key=lambda i: (-variances[i], i))


def allocate(variances: Sequence[float], m: int, budget: int) -> list[int]:
    """Candidates per prompt: m each, then up to m more each in `by_spread` order until `budget`
    extra samples are spent. Each result lies in [m, 2m] and they sum to at most
    m * len(variances) + budget."""
    if budget < 0:
        raise ValueError(f"redundancy budget {budget} is negative")
    counts = [m] * len(variances)
    for i in by_spread(variances):
        extra = min(m, budget)
        counts[i] += extra
        budget -= extra
        if budget == 0:
            break
    return counts


@dataclass
class StepCost:
    """A step's cost, fitted to reports: busy seconds ~ fixed x steps + per_token x tokens + third x
    a third count (an engine: decode steps, decode tokens, prefill tokens; the trainer: samples,
    trained tokens, the sum of their squared lengths, attention's quadratic part), by least squares
    over every report so far (older ones weighted down by `decay` each); a part that fits negative is
    dropped (0) and the others refitted without it. `fit()` is None until the reports tell the parts
    apart."""

    decay: float = 0.99
    ata: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    atb: list[float] = field(default_factory=lambda: [0.0] * 3)
    reports: int = 0

    def add(self, steps: int, tokens: int, third: int, busy_s: float) -> None:
        if steps <= 0:
            return
        x = (float(steps), float(tokens), float(third))
        for i in range(3):
            self.atb[i] = self.decay * self.atb[i] + x[i] * busy_s
            for j in range(3):
                self.ata[i][j] = self.decay * self.ata[i][j] + x[i] * x[j]
        self.reports += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(fixed seconds a step, seconds a token, seconds a unit of the third count), or None while
        they cannot be told apart."""
        if self.reports < 4:
            return None
        used = [i for i in range(3) if self.ata[i][i] > 0]  # no third count seen: two unknowns
        while True:  # a part fitted negative is dropped and the rest refitted without it
            coef = self._solve(used)
            if coef is None or coef.get(1, 0.0) <= 0:
                return None
            negative = [i for i in used if i != 1 and coef[i] < 0]
            if not negative:
                return coef.get(0, 0.0), coef[1], coef.get(2, 0.0)
            used = [i for i in used if i != negative[0]]

    def _solve(self, used: list[int]) -> dict[int, float] | None:
        """Least squares on the columns `used`, scaled to unit norm (the counts differ by 1e9)."""
        d = [math.sqrt(self.ata[i][i]) for i in used]
        a = [[self.ata[i][j] / (d[u] * d[v]) for v, j in enumerate(used)] for u, i in enumerate(used)]
        w = _solve(a, [self.atb[i] / d[u] for u, i in enumerate(used)])
        return None if w is None else {i: w[u] / d[u] for u, i in enumerate(used)}

    def per_token_bound(self) -> float | None:
        """Seconds a token with the whole cost put on the tokens (least squares through the origin):
        from the first report with tokens, t + fixed x sum(x) / sum(x^2) >= the fitted t."""
        return self.atb[1] / self.ata[1][1] if self.ata[1][1] > 0 else None

    def state_dict(self) -> dict:
        return {"ata": self.ata, "atb": self.atb, "reports": self.reports}

    def load_state_dict(self, d: dict) -> None:
        self.ata, self.atb, self.reports = [list(r) for r in d["ata"]], list(d["atb"]), d["reports"]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b by Gaussian elimination with partial pivoting; None where a is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= 1e-12 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
