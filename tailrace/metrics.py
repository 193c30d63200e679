"""Metric definitions of DESIGN.md §5 shared by real runs (runtime/) and simulated runs (sim/).

Pure Python on records, no torch, so both layers import the same formulas.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from tailrace.records import StepRecord
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
    return {
        "p50": p50,
        "p90": percentile(lens, 90),
        "p99": percentile(lens, 99),
        "max": mx,
        "mean": mean,
        "max_over_median": mx / p50 if p50 else float("nan"),
        "intra_prompt_std": sum(stds) / len(stds) if stds else 0.0,
        "truncated_frac": sum(t.result.finish == Finish.LENGTH for t in trajs) / len(trajs),
        "bubble": (mx - mean) / mx if mx else 0.0,
    }


def generated_stats(lengths: list[int]) -> dict:
    """Count, tokens and tail of the lengths generated (trained or not)."""
    return {
        "n": len(lengths), "tokens": sum(lengths), "p50": percentile(lengths, 50),
        "p99": percentile(lengths, 99), "max": max(lengths),
    }  # fmt: skip


def _std(v: list[float]) -> float:
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / len(v))


def staleness_hist(trajs: list[Trajectory], trainer_version: int) -> dict[str, int]:
    c = Counter(trainer_version - t.oldest_version for t in trajs)
    return {str(k): v for k, v in sorted(c.items())}


def utilization(start: float, cur: tuple, prev: tuple, slots: int, engine_busy: float) -> dict:
    """The time figures of a step record, cumulative since `start` and over the window since `prev`.
    `cur`, `prev`: (time, trainer busy s, engine slot-time s, generated tokens, trained tokens).

    trainer waiting ratio = trainer idle (waiting for data) / wall time;
    rollout bubble ratio = engine slot-time idle / engine slot-time available (`slots` in all; 1 while
    the job has no engine: every engine left it);
    mean active batch = engine slot-time / engine busy time (sequences per step while generating)."""
    now, busy, slot_time, gen, trained = cur
    wall, dt = max(1e-9, now - start), max(1e-9, now - prev[0])

    def idle(used: float, span: float) -> float:  # no engine at all (every one left the job): all idle
        return 1.0 - min(1.0, used / (slots * span)) if slots > 0 else 1.0

    return {
        "wall_s": wall,
        "trainer_wait_ratio": 1.0 - min(1.0, busy / wall),
        "bubble_ratio": idle(slot_time, wall),
        "mean_active_batch": slot_time / engine_busy if engine_busy > 0 else 0.0,
        "step_s": dt,
        "step_trainer_wait_ratio": 1.0 - min(1.0, (busy - prev[1]) / dt),
        "step_bubble_ratio": idle(slot_time - prev[2], dt),
        "gen_tok_s": (gen - prev[3]) / dt,
        "train_tok_s": (trained - prev[4]) / dt,
    }


def speculation(
    rows: int,
    verifies: int,
    drafted: int,
    accepted: int,
    by_version: dict[int, list[int]] | None = None,
    train: tuple[int, float] = (0, 0.0),
) -> dict:
    """A window's speculative-decoding figures from its engines' counts: decode rows (one row in one
    target forward each), rows that verified a draft, draft tokens verified, of them accepted; per
    policy version of the drafting requests, [drafted, accepted]; a trained drafter's optimizer steps
    and their seconds (in the engines' idle time).
    An accepted draft token is a token without a forward of its own, so forwards per generated token
    = rows / (rows + accepted) (1 without speculation; a draft cut by a stop token counts as accepted)."""
    steps, secs = train
    return {
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "spec_accepted_share": accepted / drafted if drafted else 0.0,
        "spec_mean_accepted": accepted / verifies if verifies else 0.0,  # per verify
        "spec_on_fraction": verifies / rows if rows else 0.0,  # decode rows that drafted
        "spec_forwards_per_token": rows / (rows + accepted) if rows else 1.0,
        "spec_by_version": {
            str(v): {"drafted": d, "accepted": a, "accepted_share": a / d if d else 0.0}
            for v, (d, a) in sorted((by_version or {}).items())
        },
        "spec_train_steps": steps,
        "spec_train_s": secs,
        "spec_train_step_s": secs / steps if steps else 0.0,  # the drafter's training time per step
    }


def step_record(
    step: int,
    version: int,
    trajs: list[Trajectory],
    trainer_version: int,
    ledger: dict,
    reward_errors: dict[str, int],
    train: dict[str, float],
    time: dict[str, float],
    generated: list[int] | None = None,
    tool_errors: int | None = None,
    rewards: dict[str, float] | None = None,
) -> StepRecord:
    """The record of one optimizer step over `trajs`, trained from `trainer_version`; `ledger` is the
    scheduler's books after it (`Scheduler.ledger_record`), with `generated`: the lengths produced
    since the previous step before shaping selected (`Scheduler.take_generated`; the `length` key
    holds the trained ones). Real and simulated runs both use this. `tool_errors`: tool calls that
    failed since the previous step (multi-turn runs; None: not one). `rewards`: each reward function's
    mean since the previous step (a list of them in task.reward; `Session.take_reward_parts`)."""
    n = len(trajs)
    tools = {}
    if tool_errors is not None:
        tools = tool_stats(trajs, tool_errors)
        time = {**time, **tool_wait(trajs)}
    if generated:
        ledger = {**ledger, "generated": generated_stats(generated)}
    return StepRecord(
        step=step,
        version=version,
        reward=sum(t.reward for t in trajs) / n,
        accuracy=sum(t.correct for t in trajs) / n,
        samples=n,
        length=length_stats(trajs),
        staleness=staleness_hist(trajs, trainer_version),
        discards=dict(ledger["discarded"]),
        ledger=ledger,
        reward_errors=dict(reward_errors),
        train={k: v for k, v in train.items() if isinstance(v, (int, float))},
        time=time,
        tools=tools,
        rewards=dict(rewards or {}),
    )


def tool_stats(trajs: list[Trajectory], errors: int) -> dict:
    """A multi-turn step's tool use: calls answered, turns per trajectory (calls + 1), observation
    tokens (context, not trained), the share of trajectories that called a tool, failed calls."""
    calls = [len(t.observed) for t in trajs]
    n = max(1, len(trajs))
    return {
        "calls": sum(calls), "turns_mean": sum(calls) / n + 1, "turns_max": max(calls, default=0) + 1,
        "observed_tokens": sum(b - a for t in trajs for a, b in t.observed),
        "calling": sum(c > 0 for c in calls) / n, "errors": errors,
    }  # fmt: skip


def tool_wait(trajs: list[Trajectory]) -> dict:
    """Seconds the step's trajectories were parked waiting on tools (the third source of tail, after
    length and the engines): summed over them, and the most any one waited."""
    waits = [t.tool_s for t in trajs]
    return {"tool_wait_s": sum(waits), "tool_wait_max_s": max(waits, default=0.0)}


def time_to_accuracy(points: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which held-out accuracy reached `target`, from (wall_s, accuracy)
    evaluations in time order; None if it never did. Its resolution is the evaluation cadence."""
    return next((t for t, acc in sorted(points) if acc >= target), None)
