"""A multi-turn sample on the engine: the turn ends at a tool-call stop (its slot freed; its KV freed,
or kept with `keep_finished`), and its continuation -- the whole context as a resumed part, under the
episode's seed -- draws exactly what one uninterrupted request with that context draws, in a busy
batch or alone (flow/turns.py); with kept KV it prefills only the observation and what follows it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tailrace.engine.engine import TailraceEngine
from tailrace.engine.errors import EngineError
from tailrace.engine.kv_cache import KVCache
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


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_continuation_in_a_busy_batch_draws_what_one_uninterrupted_request_draws(model, temperature, keep):
    turn_req, free, k = first_turn(model, temperature)
    eng = TailraceEngine(model, num_slots=3, keep_finished=keep)
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
    # kept: the prompt and the turn but its last token were not prefilled again
    assert eng.reused_tokens == (len(turn_req.prompt_ids) + k if keep else 0)
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


def kept_engine(model, **kw):
    return TailraceEngine(model, num_slots=2, keep_finished=True, **kw)


def first_of(r):
    """`r` with room for a continuation: its first turn ends at 6 new tokens (LENGTH) of 20."""
    return replace(r, params=replace(r.params, max_new_tokens=6)), r.params


def test_kept_kv_serves_only_its_own_version_and_prefix(model):
    r, params = first_of(req("t", 10, 20, seed=5))
    eng = kept_engine(model)
    eng.load_weights(model.state_dict(), version=1)
    (turn,) = eng.generate([r])
    cached = len(r.prompt_ids) + len(turn.token_ids) - 1
    other = replace(turn, token_ids=(turn.token_ids[0] ^ 1,) + turn.token_ids[1:])  # another history
    eng.generate([continuation("t.1", r.prompt_ids, params, 0, other, OBS)])
    eng.generate([continuation("t.2", r.prompt_ids, params, 1, turn, OBS)])  # another version
    assert eng.reused_tokens == 0  # neither begins with the kept tokens under their weights
    (t3,) = eng.generate([continuation("t.3", r.prompt_ids, params, 0, turn, OBS)])
    assert eng.reused_tokens == cached
    # the turn's blocks went to t.3: a second continuation of the turn prefills whole
    eng.generate([continuation("t.4", r.prompt_ids, params, 0, turn, OBS)])
    assert eng.reused_tokens == cached
    # t.3's own (finished, kept) serve the episode's next turn
    eng.generate([continuation("t.5", r.prompt_ids, replace(params, max_new_tokens=30), 0, t3, OBS)])
    assert eng.reused_tokens == cached + len(r.prompt_ids) + len(t3.token_ids) - 1


def test_a_weight_load_in_place_forgets_the_kept_kv_of_its_version(model):
    r, params = first_of(req("t", 10, 20, seed=5))
    eng = kept_engine(model)
    (turn,) = eng.generate([r])
    eng.load_weights(tiny_model(seed=4).state_dict(), version=0)
    cont = continuation("t.1", r.prompt_ids, params, 0, turn, OBS)
    got = eng.generate([cont])[0]
    assert eng.reused_tokens == 0
    assert got.token_ids == TailraceEngine(tiny_model(seed=4), num_slots=1).generate([cont])[0].token_ids


def test_kept_blocks_go_back_before_anyone_is_preempted_or_waits(model):
    """A pool of 6 blocks of 16: two kept turns would leave too little for two long requests; the pool
    takes the kept blocks back and nobody is preempted (the same as without keeping)."""
    out = {}
    for keep in (False, True):
        gib = 6 * 16 * KVCache.token_bytes(model, torch.float32) / 2**30
        eng = TailraceEngine(model, num_slots=2, max_context=48, kv_memory_gb=gib, keep_finished=keep)
        assert eng.kv_size.num_blocks == 6
        eng.generate([req("a", 20, 8, seed=1), req("b", 20, 8, seed=2)])
        assert eng.paging.num_kept_blocks == (4 if keep else 0)
        out[keep] = eng.generate([req("c", 30, 18, seed=3), req("d", 30, 18, seed=4)])
        assert eng.preemptions == 0
    assert [r.token_ids for r in out[True]] == [r.token_ids for r in out[False]]


def test_keep_finished_refuses_speculation(model):
    with pytest.raises(EngineError, match="keep_finished"):
        TailraceEngine(model, num_slots=2, keep_finished=True, spec="history")
