"""Held-out evaluation on the rollout engines: pass@1 accuracy of the sampling policy, and lengths."""

from __future__ import annotations

import re
import zlib

from tailrace.config import EvalConfig
from tailrace.flow.turns import continuation
from tailrace.runtime.metrics import percentile
from tailrace.types import GenRequest, GenResult, Prompt, SamplingParams


def histogram(lengths: list[int], bins: int = 12) -> list[tuple[int, int, int]]:
    """(lo, hi, count) bins of equal width over [0, max]."""
    if not lengths:
        return []
    top = max(lengths) + 1
    width = max(1, -(-top // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, n // width)] += 1
    return [(i * width, (i + 1) * width - 1, c) for i, c in enumerate(counts)]


def summarize(lengths: list[int], correct: list[bool], samples: int = 1) -> dict:
    """Accuracy and lengths of held-out results, `samples` a prompt in prompt order (prompt i's at
    i x samples onwards). Accuracy is the mean over every sample (avg@k: the pass@1 of the sampling
    policy, with less sampling noise than one sample a prompt); with several, pass@k (the share of
    prompts with a right sample) beside it. `n`: the prompts."""
    if len(lengths) % samples:
        raise ValueError(f"{len(lengths)} results are not {samples} samples of each prompt")
    n, prompts = len(lengths), len(lengths) // samples
    several = {}
    if samples > 1:
        hit = sum(any(correct[i * samples : (i + 1) * samples]) for i in range(prompts))
        several = {"samples": samples, "pass_at_k": hit / prompts}
    return {
        "accuracy": sum(correct) / n,
        "n": prompts,
        **several,
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": max(lengths),
        "mean": sum(lengths) / n,
        "p99_over_p50": percentile(lengths, 99) / max(1e-9, percentile(lengths, 50)),
        "histogram": histogram(lengths),
    }


def by_bucket(buckets: list[str | None], correct: list[bool], samples: int = 1) -> dict[str, dict]:
    """Accuracy (over every sample) and prompts per difficulty bucket, ordered by the number a bucket's
    name starts with ("2-4", "5-10", "11+"); `samples` results a prompt, as `summarize` takes them."""
    out: dict[str, dict] = {}
    for b in sorted(
        {b for b in buckets if b is not None}, key=lambda b: (int(re.match(r"\d*", b).group() or 0), b)
    ):
        hits = [c for x, c in zip(buckets, correct) if x == b]
        out[b] = {"accuracy": sum(hits) / len(hits), "n": len(hits) // samples}
    return out


def difficulty_line(summary: dict) -> str:
    """'2-4 91.2% (n=300), 5-10 ...' from a summary's accuracy by bucket ('' without buckets)."""
    return ", ".join(
        f"{b} {d['accuracy']:.1%} (n={d['n']})" for b, d in summary.get("by_difficulty", {}).items()
    )


class Evaluator:
    """`eval.samples` samples per held-out prompt, each seeded by the prompt and its index (the same
    requests at every evaluation; the first sample's seed is the prompt's alone, as with one sample); the
    driver sends them through the engines' command path and hands back the results."""

    def __init__(self, session, cfg: EvalConfig) -> None:
        self.ses, self.cfg = session, cfg
        self.prompts = session.heldout(cfg.n)
        self.per_request = [p for p in self.prompts for _ in range(cfg.samples)]  # aligned with requests()

    def requests(self, version: int) -> list[GenRequest]:
        c = self.cfg
        return [
            GenRequest(
                id=f"heldout-{i}" + (f".{j}" if j else ""),
                prompt_ids=p.token_ids,
                version=version,
                params=SamplingParams(
                    temperature=c.temperature,
                    max_new_tokens=c.max_new_tokens,
                    stop_token_ids=self.ses.stop_ids,
                    seed=zlib.crc32(f"eval/{p.id}".encode() + (f"/{j}".encode() if j else b"")),
                ),
            )
            for i, p in enumerate(self.prompts)
            for j in range(c.samples)
        ]

    def summarize(self, requests: list[GenRequest], results: list[GenResult]) -> dict:
        by_id = {r.request_id: r for r in results}
        ordered = [by_id[r.id] for r in requests]
        scores = self.ses.score(self.per_request, ordered)
        out = summarize([len(r.token_ids) for r in ordered], [s.correct for s in scores], self.cfg.samples)
        buckets = [self.ses.difficulty(p) for p in self.per_request]
        if any(b is not None for b in buckets):
            out["by_difficulty"] = by_bucket(buckets, [s.correct for s in scores], self.cfg.samples)
        return out


def next_turn(
    session, p: Prompt, req: GenRequest, r: GenResult, calls: int, context: int
) -> GenRequest | None:
    """A held-out episode's next request: `r` (the result of `req`, `calls` tool calls answered before
    it) stopped at a tool call the environment answers and the budget and the context limit leave room
    for an answer, so the tool runs here, at once, and its continuation comes back (the same id: the
    summary finds the episode's last result by it). None: `r` is the episode's final result."""
    budget = min(req.params.max_new_tokens, context - len(req.prompt_ids))
    if session.env is None or len(r.token_ids) >= budget or not session.is_call(r, calls):
        return None
    obs = session.observation_ids(session.turn(p, r, calls))[: budget - len(r.token_ids) - 1]
    return continuation(req.id, req.prompt_ids, req.params, req.version, r, obs)


def generate_episodes(engine, session, prompts: list[Prompt], reqs: list[GenRequest], context: int,
                      on_done=None) -> list[GenResult]:  # fmt: skip
    """Held-out requests run to the end of their episodes on one idle in-process engine, turn by turn
    (single-turn tasks: one pass); results in request order."""
    by_id = {r.id: (p, r) for p, r in zip(prompts, reqs)}
    calls = dict.fromkeys(by_id, 0)
    final: dict[str, GenResult] = {}
    pending = list(reqs)
    while pending:
        results, pending = engine.generate(pending, on_done if len(pending) == len(reqs) else None), []
        for r in results:
            p, req = by_id[r.request_id]
            nxt = next_turn(session, p, req, r, calls[r.request_id], context)
            if nxt is None:
                final[r.request_id] = r
            else:
                calls[r.request_id] += 1
                by_id[r.request_id] = (p, nxt)
                pending.append(nxt)
    return [final[r.id] for r in reqs]
