"""How many KV blocks an engine gets: a memory budget turned into a block count and a context limit.

The budget is `kv_memory_gb` GiB when given, else `FREE_FRACTION` of the memory available at start-up
(MemAvailable on CPU, free device memory on CUDA): the trainer, its optimizer state and the other
engines share the machine, and engines that start together each see the same free memory. No more is
taken than the work needs: every slot holding a request of `expected_context` tokens (what the run's
prompts and response limit add up to; default the context limit). The pool must
hold one request of the context limit, so a request that passed `add` can always run to its end alone
(preempting the others): an explicit limit that does not fit is an error; the default limit (the
model's max_position_embeddings) shrinks to what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrace.engine.errors import EngineError
from tailrace.model.device import available_bytes

FREE_FRACTION = 0.4
GIB = 1 << 30


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    block_size: int  # tokens per block
    block_bytes: int  # k and v of one block in every layer
    max_context: int  # tokens per request, prompt + response
    budget: int  # bytes
    source: str  # where the budget came from, for the start-up line

    def describe(self, num_slots: int) -> str:
        """The start-up line: memory, blocks, tokens and what the slots may hold."""
        n, bs = self.num_blocks, self.block_size
        return (
            f"KV {_bytes(n * self.block_bytes)} of a {_bytes(self.budget)} budget ({self.source}): "
            f"{n:,} blocks of {bs} tokens = {n * bs:,} tokens, {num_slots} slots of up to {self.max_context:,}"
        )


def size_pool(
    *,
    token_bytes: int,
    block_size: int,
    num_slots: int,
    max_context: int,
    context_given: bool,
    budget_gib: float | None,
    device: torch.device,
    expected_context: int | None = None,
) -> PoolSize:
    """`token_bytes`: k and v of one token in every layer; `context_given`: `max_context` was asked for
    (not the model's default); `expected_context`: tokens a request of this work holds at most (its
    prompt and its response limit): the pool holds `num_slots` of them, or one of `max_context` when
    that is given and larger, and the default context limit shrinks to the pool."""
    if expected_context is not None and expected_context < 2:
        raise EngineError(
            f"expected_context={expected_context} must be at least 2 (a prompt token and a new one)"
        )
    if block_size < 1:
        raise EngineError(f"block_size={block_size} must be at least 1")
    if budget_gib is not None and budget_gib <= 0:
        raise EngineError(f"kv_memory_gb={budget_gib} must be positive (GiB of KV cache), or unset")
    if budget_gib is None:
        avail = available_bytes(device)
        budget, source = int(FREE_FRACTION * avail), f"{FREE_FRACTION:.0%} of {_bytes(avail)} available"
    else:
        budget, source = int(budget_gib * GIB), "kv_memory_gb"
    block_bytes, asked = token_bytes * block_size, max_context
    per_request = -(-max_context // block_size)
    fit = budget // block_bytes
    need = num_slots * -(-min(expected_context or max_context, max_context) // block_size)
    if context_given:
        num_blocks = min(fit, max(need, per_request))
    else:  # the model's limit shrinks to the pool: no request can hold more than all of it
        num_blocks = min(fit, need)
        max_context = min(max_context, num_blocks * block_size)
    if num_blocks < per_request and context_given or max_context < 2:
        raise EngineError(
            f"a KV budget of {_bytes(budget)} ({source}) holds {fit * block_size:,} tokens, fewer "
            f"than one request of max_context={asked:,}; raise kv_memory_gb or lower max_context"
        )
    return PoolSize(num_blocks, block_size, block_bytes, max_context, budget, source)


def _bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"
