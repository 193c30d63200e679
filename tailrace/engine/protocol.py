"""`Engine`: what the runtime needs of a rollout engine, and `Capabilities`: what one can do.

Token ids in; token ids, per-token behaviour logprobs and per-token policy versions out. tailrace's own
engine (`TailraceEngine`) implements this protocol, and an adapter to another engine (vLLM) is a second
implementation of it. Callers depend on this protocol and read `capabilities` (a `types.Capabilities`,
which the scheduler reads too), never an engine's class or backend name.

Contract shared by every implementation:
  * `add` queues a request (raising `EngineError`, and changing nothing, if it is malformed);
  * each `step` does a bounded amount of work and returns a `StepEvent` with the results that
    finished in it; a request ends once, as a finished result or as the partial `abort` returns;
  * `load_weights(state, v)` adds version v, or overwrites it in place; `drop_version(v)` refuses while
    requests of v are waiting or running; an engine with `versions_at_once == 1` replaces the version
    it holds by a new v instead (refusing while requests of the old one are waiting or running);
  * an engine whose `capabilities.adapters` is true also has `load_adapter(name, adapter)` (add or
    overwrite in place), `drop_adapter(name)` (refusing while requests of it are waiting or running)
    and `adapters` (the names held); `add` refuses a request naming an adapter the engine does not hold
    (every adapter, where `capabilities.adapters` is false);
  * calls are made between steps, from the thread that steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from tailrace.engine.events import StepEvent
from tailrace.engine.spec.drafter import Trained
from tailrace.types import Capabilities, GenRequest, GenResult


@runtime_checkable
class Engine(Protocol):
    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def num_running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot, and those that finished without compute (a resumed partial
        already at its token limit), which the next `step` returns: a caller that steps while this is
        non-zero hears of every request."""
        ...

    @property
    def versions(self) -> tuple[int, ...]:
        """The loaded weight versions, ascending."""
        ...

    def __contains__(self, request_id: str) -> bool:
        """Whether a request is waiting or running (so `abort` would succeed)."""
        ...

    def describe(self) -> str:
        """One line said at start-up: what the engine runs on, its memory and its capacity."""
        ...

    def add(self, req: GenRequest) -> None: ...

    def step(self) -> StepEvent: ...

    def abort(self, request_id: str) -> GenResult:
        """Take a waiting or running request out; returns its partial (finish=ABORTED)."""
        ...

    def peek(self, request_id: str) -> GenResult:
        """A waiting or running request's tokens so far, as `abort` would return them, the request
        left running (streaming)."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def drop_version(self, version: int) -> None: ...

    def add_history(self, prompt_ids: tuple[int, ...], token_ids: tuple[int, ...]) -> None:
        """A finished response to `prompt_ids` to draft from (speculative decoding; else ignored)."""
        ...

    def idle(self, budget_s: float) -> Trained | None:
        """No request is waiting or running: a drafter trained online learns for up to `budget_s`
        seconds (speculative decoding; else None at once)."""
        ...

    def generate(
        self, requests: list[GenRequest], on_done: Callable[[int, int], None] | None = None
    ) -> list[GenResult]:
        """Run `requests` to completion on an idle engine; results in request order. `on_done(done,
        total)` hears of progress as requests finish."""
        ...
