"""Multi-turn samples: a turn that ends in a tool call parks until its observation, then continues.

A parked sample holds no engine slot (its request finished: the engine freed its slot and KV), so
the tool never blocks the batch. Its continuation is one request carrying the whole context as its
resumed part -- the generated tokens with their behaviour logprobs and versions, the observation's
tokens with logprob 0 and the request's version -- under the first request's seed: the engine's noise
is a function of (seed, response position), so the continuation draws exactly the tokens one
uninterrupted request with that context would (`Capabilities.abort_resume`). The observation's
positions travel with the trajectory (`Trajectory.observed`): the trainer conditions on them and never
trains on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tailrace.types import GenRequest, GenResult


def continuation(req_id: str, prompt_ids: tuple[int, ...], params, version: int, turn: GenResult,
                 observation: tuple[int, ...]) -> GenRequest:  # fmt: skip
    """The request `req_id` that continues `turn` (a result ended by a tool call, its tokens the whole
    response so far) after `observation`, under `params` (seed included) and `version`."""
    n = len(observation)
    return GenRequest(
        req_id, prompt_ids, replace(params), version, turn.token_ids + observation,
        turn.logprobs + (0.0,) * n, turn.versions + (version,) * n, resume_routes=turn.routes,
    )  # fmt: skip


@dataclass
class Episode:
    """A multi-turn sample's record of its tool calls so far (the scheduler's, per sample)."""

    observed: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of observation tokens
    calls: int = 0  # tool calls answered
    tool_s: float = 0.0  # seconds parked waiting for tools, summed over its calls


@dataclass
class AtTool:
    """A sample parked while its tool runs."""

    engine: int  # where its turn ran
    version: int
    seed: int | None  # its requests' seed (every turn's)
    turn: GenResult  # the response so far (every turn, every observation), ended by the call
    since: float  # when it parked (the scheduler's clock)
