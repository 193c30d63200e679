"""DARTS' adaptive redundancy: how many candidates each prompt of a window gets, from what its
earlier samples said about its length spread.

`LengthStats` keeps, per prompt id, an exponential moving average of the mean and variance of its
samples' lengths (updated once per completed group); a prompt not seen yet uses the task-level prior,
the moving average of every observed group's variance. `allocate` spends an extra-sample budget
greedily on the prompts of largest variance, each getting between M and 2M candidates.

The budget is a fixed share of the window (`shaping.extra`), or chosen from what the engines'
steps cost (`cost_budget`, with `StepCost` fitted to their reports): a decode step costs a fixed
part (the weights' pass) plus a part per row. A round without extras lasts about
    T0 = fixed x L_max + per_token x n x L_mean
(n samples; the fixed part is paid at every step until the longest one ends), and each extra
candidate adds about per_token x L_mean. The budget is the most extras that add at most a
`tolerance` share of T0 and whose tokens still fit in the engines' slots over the round
(slots x L_max), at most n (no prompt beyond 2M). Where the fixed cost dominates -- a small batch,
a weight-bound step -- redundancy is nearly free and the budget is large; where rows cost the most,
it is small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class LengthStats:
    alpha: float = 0.5  # weight of the newest group in each moving average
    mean: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its mean length
    var: dict[int, float] = field(default_factory=dict)  # prompt id -> EMA of its length variance
    prior: float | None = None  # EMA of every observed group's variance (cold prompts' estimate)
    typical: float | None = None  # EMA of every observed group's mean length
    longest: float | None = None  # EMA of every observed group's longest length

    def observe(self, prompt_id: int, lengths: Sequence[int]) -> None:
        """One completed group's sample lengths (population mean and variance)."""
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

    def variance(self, prompt_id: int) -> float:
        """The prompt's estimated length variance (the prior for a cold prompt; 0 before any data)."""
        return self.var.get(prompt_id, self.prior or 0.0)

    def state_dict(self) -> dict:
        return {
            "mean": [[k, v] for k, v in self.mean.items()],
            "var": [[k, v] for k, v in self.var.items()],
            "prior": self.prior,
            "typical": self.typical,
            "longest": self.longest,
        }

    def load_state_dict(self, d: dict) -> None:
        self.mean = {int(k): v for k, v in d["mean"]}
        self.var = {int(k): v for k, v in d["var"]}
        self.prior = d["prior"]
        self.typical, self.longest = d.get("typical"), d.get("longest")  # older checkpoints lack them


def allocate(variances: Sequence[float], m: int, budget: int) -> list[int]:
    """Candidates per prompt: m each, then up to m more each to the prompts of largest variance first
    until `budget` extra samples are spent (ties: the earlier prompt first). Each result lies in
    [m, 2m] and they sum to at most m * len(variances) + budget."""
    if budget < 0:
        raise ValueError(f"redundancy budget {budget} is negative")
    counts = [m] * len(variances)
    for i in sorted(range(len(variances)), key=lambda i: (-variances[i], i)):
        extra = min(m, budget)
        counts[i] += extra
        budget -= extra
        if budget == 0:
            break
    return counts


def cost_budget(
    n: int, slots: int, fixed: float, per_token: float, mean_len: float, max_len: float, tolerance: float
) -> int:
    """Extra candidates for a window of `n` samples on engines of `slots` rows in all, a decode step
    costing `fixed` + `per_token` x rows, responses of `mean_len` tokens on average and `max_len` at
    the longest: the most that add at most `tolerance` x the round's time and fit in its slots (see
    the module doc), in [0, n]."""
    if min(fixed, per_token, tolerance) < 0 or mean_len <= 0 or max_len < mean_len:
        raise ValueError(
            f"cost_budget: needs non-negative costs and tolerance and 0 < mean_len <= max_len (got "
            f"fixed={fixed}, per_token={per_token}, tolerance={tolerance}, mean={mean_len}, max={max_len})"
        )
    t0 = fixed * max_len + per_token * n * mean_len
    by_time = tolerance * t0 / (per_token * mean_len) if per_token > 0 else float(n)
    by_slots = slots * max_len / mean_len - n
    return max(0, min(n, int(by_time), int(by_slots)))


@dataclass
class StepCost:
    """The engines' step cost, fitted to their reports: busy seconds ~ fixed x steps + per_token x
    decode tokens + per_prefill x prefill tokens, by least squares over every report so far (older
    ones weighted down by `decay` each), with each coefficient kept >= 0. `fit()` is None until the
    reports tell the parts apart."""

    decay: float = 0.99
    ata: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    atb: list[float] = field(default_factory=lambda: [0.0] * 3)
    reports: int = 0

    def add(self, steps: int, decode_tokens: int, prefill_tokens: int, busy_s: float) -> None:
        if steps <= 0:
            return
        x = (float(steps), float(decode_tokens), float(prefill_tokens))
        for i in range(3):
            self.atb[i] = self.decay * self.atb[i] + x[i] * busy_s
            for j in range(3):
                self.ata[i][j] = self.decay * self.ata[i][j] + x[i] * x[j]
        self.reports += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds a step, seconds a decode token), or None while they cannot be told apart."""
        if self.reports < 4:
            return None
        used = [i for i in range(3) if self.ata[i][i] > 0]  # no prefill seen: two unknowns
        w = _solve([[self.ata[i][j] for j in used] for i in used], [self.atb[i] for i in used])
        if w is None:
            return None
        coef = dict(zip(used, w))
        fixed, per_token = coef.get(0, 0.0), coef.get(1, 0.0)
        if per_token <= 0:
            return None
        return max(fixed, 0.0), per_token

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
