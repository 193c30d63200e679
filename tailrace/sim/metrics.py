"""Metric helpers for simulated runs, with the definitions of DESIGN.md §5 (the same formulas as
tailrace/runtime/metrics.py, which sim may not import: runtime sits above sim in the layering), plus
the published systems' own figures: RolloutPipe's rollout-to-train-end window and first dispatch,
DORA's per-step bubble and rollout-only share.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict

from tailrace.types import Finish, Trajectory


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def length_stats(trajs: list[Trajectory]) -> dict:
    """Tail of the response lengths of one step; `bubble` is DORA's (max - mean) / max."""
    lens = [t.length for t in trajs]
    if not lens:
        return {}
    by_prompt = defaultdict(list)
    for t in trajs:
        by_prompt[t.group].append(t.length)
    stds = [_std(v) for v in by_prompt.values() if len(v) > 1]
    p50, mx = percentile(lens, 50), max(lens)
    mean = sum(lens) / len(lens)
    return {"p50": p50, "p90": percentile(lens, 90), "p99": percentile(lens, 99), "max": mx, "mean": mean,
            "max_over_median": mx / p50 if p50 else float("nan"),
            "intra_prompt_std": sum(stds) / len(stds) if stds else 0.0,
            "truncated_frac": sum(t.result.finish == Finish.LENGTH for t in trajs) / len(trajs),
            "bubble": (mx - mean) / mx if mx else 0.0}


def _std(v: list[float]) -> float:
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def staleness_hist(trajs: list[Trajectory], trainer_version: int) -> dict[str, int]:
    c = Counter(trainer_version - t.oldest_version for t in trajs)
    return {str(k): v for k, v in sorted(c.items())}


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    total, end = 0.0, -math.inf
    for t0, t1 in sorted(spans):
        if t1 <= end:
            continue
        total += t1 - max(t0, end)
        end = t1
    return total


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for t0, t1 in sorted(spans):
        if out and t0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t1)
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def minus_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) minus union(b)."""
    a, b = merge(a), merge(b)
    total, j = 0.0, 0
    for t0, t1 in a:
        cut = 0.0
        while j < len(b) and b[j][1] <= t0:
            j += 1
        k = j
        while k < len(b) and b[k][0] < t1:
            cut += min(t1, b[k][1]) - max(t0, b[k][0])
            k += 1
        total += (t1 - t0) - cut
    return total
