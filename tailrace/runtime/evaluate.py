"""Held-out evaluation on the rollout engines: pass@1 accuracy of the sampling policy, and lengths."""

from __future__ import annotations

import re
import zlib

from tailrace.config import EvalConfig
from tailrace.runtime.metrics import percentile
from tailrace.types import GenRequest, GenResult, SamplingParams


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


def summarize(lengths: list[int], correct: list[bool]) -> dict:
    n = len(lengths)
    return {
        "accuracy": sum(correct) / n,
        "n": n,
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "p99": percentile(lengths, 99),
        "max": max(lengths),
        "mean": sum(lengths) / n,
        "p99_over_p50": percentile(lengths, 99) / max(1e-9, percentile(lengths, 50)),
        "histogram": histogram(lengths),
    }


def by_bucket(buckets: list[str | None], correct: list[bool]) -> dict[str, dict]:
    """Accuracy and count per difficulty bucket, ordered by the number a bucket's name starts with
    ("2-4", "5-10", "11+")."""
    out: dict[str, dict] = {}
    for b in sorted(
        {b for b in buckets if b is not None}, key=lambda b: (int(re.match(r"\d*", b).group() or 0), b)
    ):
        hits = [c for x, c in zip(buckets, correct) if x == b]
        out[b] = {"accuracy": sum(hits) / len(hits), "n": len(hits)}
    return out


def difficulty_line(summary: dict) -> str:
    """'2-4 91.2% (n=300), 5-10 ...' from a summary's accuracy by bucket ('' without buckets)."""
    return ", ".join(
        f"{b} {d['accuracy']:.1%} (n={d['n']})" for b, d in summary.get("by_difficulty", {}).items()
    )


class Evaluator:
    """One sample per held-out prompt, seeded by the prompt (the same requests at every evaluation);
    the driver sends them through the engines' command path and hands back the results."""

    def __init__(self, session, cfg: EvalConfig) -> None:
        self.ses, self.cfg = session, cfg
        self.prompts = session.heldout(cfg.n)

    def requests(self, version: int) -> list[GenRequest]:
        c = self.cfg
        return [
            GenRequest(
                id=f"heldout-{i}",
                prompt_ids=p.token_ids,
                version=version,
                params=SamplingParams(
                    temperature=c.temperature,
                    max_new_tokens=c.max_new_tokens,
                    stop_token_ids=self.ses.stop_ids,
                    seed=zlib.crc32(f"eval/{p.id}".encode()),
                ),
            )
            for i, p in enumerate(self.prompts)
        ]

    def summarize(self, requests: list[GenRequest], results: list[GenResult]) -> dict:
        by_id = {r.request_id: r for r in results}
        ordered = [by_id[r.id] for r in requests]
        scores = self.ses.score(self.prompts, ordered)
        out = summarize([len(r.token_ids) for r in ordered], [s.correct for s in scores])
        buckets = [self.ses.difficulty(p) for p in self.prompts]
        if any(b is not None for b in buckets):
            out["by_difficulty"] = by_bucket(buckets, [s.correct for s in scores])
        return out
