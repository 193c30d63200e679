"""`Drafter`: what proposes draft tokens, behind one small interface; `DraftRow`: what it sees of a
request; `DraftEnv`: the engine state a model drafter may use.

A drafter only ever affects time: the engine verifies every draft against the target (see `accept`),
so a drafter may propose anything, including nothing. Two kinds exist, chosen by name
(`rollout.spec`, see `spec.DRAFTERS`):
  * lookup drafters (`HistoryDrafter`): continuations of token sequences the engine was given
    through `add_history` (earlier responses to the same prompt, finished siblings, or -- the same
    feed -- responses pre-generated in idle time, as BubbleSpec does); cost per call, not per token;
  * model drafters (`QuantDrafter`): a model run for k steps on the target's KV cache rows; cost per
    draft token. An online-trained small drafter (TLT) is one more of these, with its own weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tailrace.engine.kv_cache import KVCache
from tailrace.engine.rows import RowState
from tailrace.model.decoder import CausalLM


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One decoding request asked for a draft. `tokens`: its response so far (resumed tokens
    included; the drafter must not change it); `k`: the most draft tokens wanted; `row`, `position`:
    its cache row and the position of its last token (whose k/v the verify writes first);
    `version`: its policy version."""

    request_id: str
    prompt: tuple[int, ...]
    tokens: Sequence[int]
    k: int
    row: int
    position: int
    version: int


@dataclass(frozen=True)
class DraftEnv:
    """The engine state a model drafter works on: the paged KV cache (a draft may write positions
    [position, position + k) of its rows: the verify overwrites them before anything reads them),
    the rows' sampling state, the sampler's vocab salt and kernels, the backend factory and the
    versions' models."""

    cache: KVCache
    rows: RowState
    salt: torch.Tensor
    kernel: object | None  # ckernel.Kernels or None
    make_backend: Callable[[CausalLM], object]  # backends.select's factory, as for each version
    model_of: Callable[[int], CausalLM]  # a loaded version's model (its weights, not to be changed)


@dataclass(frozen=True, slots=True)
class Trained:
    """What one idle period's training of a drafter did: optimizer steps, seconds, the last loss."""

    steps: int
    seconds: float
    loss: float


class Drafter(Protocol):
    name: str
    per_token_cost: bool  # its time grows with the draft length (a model) rather than per call

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        """Up to rows[i].k draft tokens for each row (fewer, or none, is fine)."""
        ...

    # optional: `budget(prompt, k) -> int`, the most of k draft tokens a request of `prompt` can get
    # from this drafter whatever its response so far (a lookup drafter without history for a prompt:
    # 0); the engine cuts the draft length to it before it asks (`Speculator.budget`)

    def add_history(self, prompt: tuple[int, ...], tokens: Sequence[int]) -> None:
        """A response to `prompt` to draft from (lookup drafters; others ignore it)."""
        ...

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted or preempted): forget its state."""
        ...

    def load(self, version: int, model: CausalLM) -> None:
        """`version` now has these weights (a model drafter derived from them rebuilds)."""
        ...

    def drop(self, version: int) -> None: ...

    def train(self, budget_s: float) -> Trained | None:
        """The engine is idle: learn for at most about `budget_s` seconds (a trained drafter; None:
        nothing learnt, as drafters without weights of their own always answer)."""
        ...
