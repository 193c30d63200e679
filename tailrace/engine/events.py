"""`StepEvent`: what one engine step did -- the raw material for slot utilization and timelines."""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.types import GenResult


@dataclass(frozen=True)
class StepEvent:
    t_start: float  # engine clock (time.perf_counter), seconds
    duration: float  # seconds
    active: int  # sequences decoded this step (the decode batch size)
    prefill_tokens: int  # prompt tokens prefilled this step
    decode_tokens: int  # tokens sampled this step (decode + first tokens of completed prefills)
    advanced: tuple[str, ...]  # ids of the requests that made progress (decoded or prefilled)
    finished: tuple[GenResult, ...]  # results completed this step, in completion order
    # speculative decoding (see engine.spec): draft tokens verified, of them accepted, and the decode
    # rows that verified a draft (decode_tokens counts the extra tokens accepted drafts emitted)
    drafted: int = 0
    accepted: int = 0
    verifies: int = 0
    by_version: tuple[tuple[int, int, int], ...] = ()  # (policy version, drafted, accepted) of those
    by_adapter: tuple[tuple[str, int, int], ...] = ()  # (adapter, drafted, accepted) of rows naming one
