"""A multi-turn sample on the engine: the turn ends at a tool-call stop (its slot and KV freed), and its
continuation -- the whole context as a resumed part, under the episode's seed -- draws exactly what one
uninterrupted request with that context draws, in a busy batch or alone (flow/turns.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tailrace.engine.engine import TailraceEngine
from tailrace.flow.turns import continuation
from tailrace.types import Finish, GenRequest, SamplingParams
from tests.engine.engine_helpers import prompt, req, tiny_model

OBS = (3, 4, 5, 6)  # a tool's answer, as tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def first_turn(model, temperature):
    """A seeded request and a stop token it samples at its 6th position (nowhere before)."""
    base = req("episode", 12, 40, seed=1234, temperature=temperature)
    free = TailraceEngine(model, num_slots=4).generate([base])[0].token_ids
    k = next(i for i in range(5, 30) if free[i] not in free[:i])
    return replace(base, params=replace(base.params, stop_token_ids=(free[k],))), free, k


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_continuation_in_a_busy_batch_draws_what_one_uninterrupted_request_draws(model, temperature):
    turn_req, free, k = first_turn(model, temperature)
    eng = TailraceEngine(model, num_slots=3)
    others = [req(f"o{i}", 5 + 3 * i, 30, temperature=temperature) for i in range(4)]
    for r in [turn_req, *others[:2]]:
        eng.add(r)
    done = {}
    while turn_req.id not in done:
        done.update({r.request_id: r for r in eng.step().finished})
    turn = done[turn_req.id]
    assert (
        turn.finish == Finish.STOP and turn.token_ids == free[: k + 1]
    )  # the stop changes no token before it
    assert turn_req.id not in eng  # parked: it holds no slot, no KV
    for r in others[2:]:
        eng.add(r)  # the batch moves on while the tool runs
    for _ in range(3):
        done.update({r.request_id: r for r in eng.step().finished})
    cont = continuation("episode.1", turn_req.prompt_ids, turn_req.params, 0, turn, OBS)
    eng.add(cont)
    while "episode.1" not in done:
        done.update({r.request_id: r for r in eng.step().finished})
    got = done["episode.1"]
    assert got.token_ids[: k + 1 + len(OBS)] == turn.token_ids + OBS
    assert got.logprobs[k + 1 : k + 1 + len(OBS)] == (0.0,) * len(OBS)
    # one uninterrupted request with that context, alone on a fresh engine
    alone = TailraceEngine(model, num_slots=1).generate([replace(cont, id="alone")])[0]
    assert got.token_ids == alone.token_ids and got.finish == alone.finish
    assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    if temperature == 0.0:  # greedy: the same as a fresh request whose prompt is the whole context
        ctx = turn_req.prompt_ids + turn.token_ids + OBS
        plain = GenRequest(
            "plain", ctx, replace(turn_req.params, max_new_tokens=40 - len(turn.token_ids + OBS))
        )
        fresh = TailraceEngine(model, num_slots=1).generate([plain])[0]
        assert got.token_ids[len(turn.token_ids + OBS) :] == fresh.token_ids


def test_an_observation_past_the_budget_finishes_at_once(model):
    r = GenRequest("x", prompt(1, 4), SamplingParams(max_new_tokens=3, seed=1))
    turn = TailraceEngine(model, num_slots=1).generate(
        [replace(r, params=replace(r.params, max_new_tokens=2))]
    )[0]
    cont = continuation("x.1", r.prompt_ids, r.params, 0, turn, (7,))
    got = TailraceEngine(model, num_slots=1).generate([cont])[0]
    assert got.finish == Finish.LENGTH and got.token_ids == turn.token_ids + (7,)
