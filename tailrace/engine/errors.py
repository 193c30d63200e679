"""`EngineError`: a bad request or call, reported in one line that names the problem and the fix.

`check_request` raises it before any state changes, so the other requests in the engine are never
disturbed."""

from __future__ import annotations

from collections.abc import Container

from tailrace.common import InputError
from tailrace.types import GenRequest


class EngineError(InputError):
    pass


def check_request(
    req: GenRequest,
    live: Container[str],
    versions: Container[int],
    max_context: int,
    vocab_size: int,
    adapters: Container[str] = (),
) -> None:
    """`live`: ids of the requests in the engine; `versions`: the loaded versions; `adapters`: the
    loaded LoRA adapters (none: an engine without adapters)."""
    if not isinstance(req, GenRequest):
        raise EngineError(f"add() takes a GenRequest, got {type(req).__name__}; wrap ids in GenRequest(...)")
    rid = req.id
    if rid in live:
        raise EngineError(f"request id {rid!r} is already in the engine; give each live request a unique id")
    if not req.prompt_ids:
        raise EngineError(f"request {rid!r} has an empty prompt; give at least one prompt token")
    n_res = len(req.resume_ids)
    if not n_res == len(req.resume_logprobs) == len(req.resume_versions):
        raise EngineError(
            f"request {rid!r}: resume_ids/resume_logprobs/resume_versions have lengths "
            f"{n_res}/{len(req.resume_logprobs)}/{len(req.resume_versions)}; pass a partial "
            "GenResult's token_ids/logprobs/versions unchanged"
        )
    if req.version not in versions:
        raise EngineError(
            f"request {rid!r} wants version {req.version}, which is not loaded; "
            f"load_weights(state, {req.version}) first"
        )
    if req.adapter and req.adapter not in adapters:
        raise EngineError(
            f"request {rid!r} wants adapter {req.adapter!r}, which is not loaded; load_adapter"
            f"({req.adapter!r}, adapter) first (an engine whose capabilities.adapters is false has none)"
        )
    n = len(req.prompt_ids) + n_res
    if n >= max_context:
        raise EngineError(
            f"request {rid!r}: prompt ({len(req.prompt_ids)}) + resumed ({n_res}) = {n} tokens "
            f"leave no room for a new token in max_context={max_context}; shorten it or raise max_context"
        )
    ids = req.prompt_ids + req.resume_ids + req.params.stop_token_ids
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise EngineError(
            f"request {rid!r} has token id {bad} outside the vocabulary [0, {vocab_size}); "
            "check the tokenizer matches the model"
        )
