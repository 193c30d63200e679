"""Held-out evaluation on the rollout engines: pass@1 accuracy of the sampling policy, and lengths."""

from __future__ import annotations

import zlib
from multiprocessing.connection import wait

from tailrace.config import EvalConfig
from tailrace.runtime.engine_worker import EngineReport
from tailrace.runtime.metrics import percentile
from tailrace.types import GenRequest, SamplingParams


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


class Evaluator:
    def __init__(self, session, engine_conns, cfg: EvalConfig) -> None:
        self.ses, self.conns, self.cfg = session, engine_conns, cfg
        self.prompts = session.heldout(cfg.n)

    def run(self, tag: str, version: int, on_report) -> dict:
        """Generate one sample per held-out prompt on the engines (under `version`) and score them.
        `on_report(report)` lets the driver account the engines' reports; it returns eval results."""
        c = self.cfg
        reqs = [
            GenRequest(
                id=f"eval.{tag}.{i}",
                prompt_ids=p.token_ids,
                version=version,
                params=SamplingParams(
                    temperature=c.temperature,
                    max_new_tokens=c.max_new_tokens,
                    stop_token_ids=(self.ses.tok.eos_id,),
                    seed=zlib.crc32(f"eval/{p.id}".encode()),
                ),
            )
            for i, p in enumerate(self.prompts)
        ]
        for i, conn in enumerate(self.conns):
            conn.send(("eval", reqs[i :: len(self.conns)]))
        results = {}
        while len(results) < len(reqs):
            for conn in wait(self.conns, timeout=5.0):
                msg = conn.recv()
                if isinstance(msg, EngineReport):
                    for r in on_report(msg):
                        results[r.request_id] = r
        ordered = [results[r.id] for r in reqs]
        scores = self.ses.score_results(self.prompts, ordered)
        return summarize([len(r.token_ids) for r in ordered], [ok for _, ok in scores])
