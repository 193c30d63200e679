"""Controlling the engine: abort and resume, versions, bad requests, pause, step events."""

from __future__ import annotations

import pytest
import torch

from tailrace.engine import Capabilities, Engine, EngineError, TailraceEngine, build_engine
from tailrace.types import Finish, GenRequest, SamplingParams
from tests.engine.engine_helpers import full_logprobs, req, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.fixture(scope="module")
def other():
    return tiny_model(7)


def _run(eng: TailraceEngine, until=lambda e: False) -> dict:
    out = {}
    while (eng.num_running or eng.num_waiting) and not until(eng):
        for r in eng.step().finished:
            out[r.request_id] = r
    return out


def _resume(r: GenRequest, partial) -> GenRequest:
    return GenRequest(
        r.id, r.prompt_ids, r.params, r.version, partial.token_ids, partial.logprobs, partial.versions
    )


def test_abort_running_and_waiting_then_resume_gives_the_uninterrupted_tokens(model):
    reqs = [req(f"r{i}", 5 + 3 * i, 30, temperature=1.0) for i in range(6)]
    full = {r.request_id: r for r in TailraceEngine(model, num_slots=2).generate(reqs)}
    eng = TailraceEngine(model, num_slots=2, prefill_tokens=8)
    for r in reqs:
        eng.add(r)
    for _ in range(12):
        eng.step()
    assert all(r.id in eng for r in reqs)
    partials = {rid: eng.abort(rid) for rid in ("r0", "r1", "r5")}  # r0, r1 decoding; r5 still waiting
    for rid, p in partials.items():
        assert p.finish == Finish.ABORTED
        assert len(p.token_ids) == len(p.logprobs) == len(p.versions)
        assert p.token_ids == full[rid].token_ids[: len(p.token_ids)]
        assert p.versions == (0,) * len(p.token_ids)
    assert 0 < len(partials["r0"].token_ids) < 30 and partials["r5"].token_ids == ()
    rest = _run(eng)
    assert set(rest) == {"r2", "r3", "r4"} and all(rest[k].token_ids == full[k].token_ids for k in rest)
    assert "r0" not in eng and "r2" not in eng
    with pytest.raises(EngineError, match="no such request"):
        eng.abort("r0")
    resumed = eng.generate([_resume(reqs[int(k[1])], p) for k, p in partials.items()])
    for res in resumed:
        f = full[res.request_id]
        assert res.token_ids == f.token_ids and res.finish == f.finish
        assert max(abs(a - b) for a, b in zip(res.logprobs, f.logprobs)) < 1e-4


def test_abort_during_chunked_prefill(model):
    eng = TailraceEngine(model, num_slots=2, prefill_tokens=4)
    eng.add(req("long", 40, 5))
    eng.add(req("short", 3, 5))
    eng.step()
    p = eng.abort("long")
    assert p.token_ids == () and p.finish == Finish.ABORTED and eng.num_running == 1
    assert (
        _run(eng)["short"].token_ids
        == TailraceEngine(model, num_slots=1).generate([req("short", 3, 5)])[0].token_ids
    )


def test_resume_with_prefix_at_max_new_tokens_finishes_at_once(model):
    r = req("z", 4, 5)
    done = TailraceEngine(model, num_slots=1).generate([r])[0]
    again = TailraceEngine(model, num_slots=1).generate([_resume(r, done)])[0]
    assert again.token_ids == done.token_ids and again.finish == Finish.LENGTH


def test_a_request_finished_at_add_counts_as_waiting_until_a_step_returns_it(model):
    """An engine worker steps only while requests run or wait: a resumed partial already at its limit
    (finished by `add`, without compute) must count, or an idle worker never reports it (a hang)."""
    r = req("z", 4, 5)
    done = TailraceEngine(model, num_slots=1).generate([r])[0]
    eng = TailraceEngine(model, num_slots=1)
    eng.add(_resume(r, done))
    assert (eng.num_running, eng.num_waiting) == (0, 1)
    assert [x.request_id for x in eng.step().finished] == ["z"]
    assert (eng.num_running, eng.num_waiting) == (0, 0)


def test_two_versions_each_match_their_own_weights(model, other):
    reqs = [req(f"v{i}", 4 + 5 * i, 15 + i, version=i % 2, temperature=0.9) for i in range(8)]
    eng = TailraceEngine(tiny_model(0), num_slots=5, prefill_tokens=16)
    eng.load_weights(other.state_dict(), 1)
    assert eng.versions == (0, 1)
    both = eng.generate(reqs)
    only0 = TailraceEngine(model, num_slots=5).generate([r for r in reqs if r.version == 0])
    only1 = TailraceEngine(other, num_slots=5).generate(
        [GenRequest(r.id, r.prompt_ids, r.params) for r in reqs if r.version == 1]
    )
    ref = {r.request_id: r.token_ids for r in only0 + only1}
    for r, res in zip(reqs, both):
        assert res.token_ids == ref[r.id] and res.versions == (r.version,) * len(res.token_ids)
        lm = model if r.version == 0 else other
        ref_lp = full_logprobs(lm, r.prompt_ids, res.token_ids, 0.9)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref_lp)) < 1e-4


def test_load_weights_mid_run_affects_only_that_version(model, other):
    eng = TailraceEngine(tiny_model(0), num_slots=4)
    eng.load_weights(tiny_model(0).state_dict(), 1)  # version 1 starts as a copy of version 0
    reqs = [req("a", 6, 20, version=0, temperature=0.0), req("b", 6, 20, version=1, temperature=0.0, pseed=1)]
    for r in reqs:
        eng.add(r)
    for _ in range(6):
        eng.step()
    eng.load_weights(other.state_dict(), 1)  # overwrite version 1 in place
    out = _run(eng)
    base = TailraceEngine(model, num_slots=1).generate([reqs[0]])[0]
    assert out["a"].token_ids == base.token_ids  # version 0 untouched
    b_old = TailraceEngine(model, num_slots=1).generate(
        [GenRequest("b", reqs[1].prompt_ids, reqs[1].params)]
    )[0]
    assert out["b"].token_ids[:6] == b_old.token_ids[:6] and out["b"].token_ids != b_old.token_ids
    assert out["b"].versions == (1,) * 20
    # after the load, version 1 generates with the new weights from scratch
    fresh = eng.generate([GenRequest("c", reqs[1].prompt_ids, reqs[1].params, version=1)])[0]
    assert (
        fresh.token_ids
        == TailraceEngine(other, num_slots=1)
        .generate([GenRequest("c", reqs[1].prompt_ids, reqs[1].params)])[0]
        .token_ids
    )


def test_drop_version_refuses_while_in_use(model, other):
    eng = TailraceEngine(tiny_model(0), num_slots=1)
    eng.load_weights(other.state_dict(), 3)
    eng.add(req("a", 4, 5, version=3))
    eng.add(req("b", 4, 5, version=3))  # waits: one slot
    with pytest.raises(EngineError, match="waiting or running"):
        eng.drop_version(3)
    _run(eng)
    eng.drop_version(3)
    assert eng.versions == (0,)
    with pytest.raises(EngineError, match="not loaded"):
        eng.drop_version(3)
    with pytest.raises(EngineError, match="only version"):
        eng.drop_version(0)
    with pytest.raises(EngineError):
        eng.load_weights({"nope": torch.zeros(1)}, 5)
    assert eng.versions == (0,)


def test_a_one_version_engine_replaces_its_version_only_while_idle(model, other):
    """max_versions=1 (as vLLM): a load of another version replaces the held one, and is refused while a
    request waits or runs; a seeded request gets the tokens a default engine with those weights gives."""
    eng = TailraceEngine(tiny_model(0), num_slots=1, max_versions=1)
    assert eng.capabilities.versions_at_once == 1
    eng.load_weights(other.state_dict(), 3)
    assert eng.versions == (3,)
    r = req("a", 5, 12, version=3, temperature=1.0)
    eng.add(r)
    eng.step()
    with pytest.raises(EngineError, match="one version at a time .*let them finish or abort them"):
        eng.load_weights(model.state_dict(), 4)
    eng.load_weights(other.state_dict(), 3)  # the held version: overwritten in place, as on any engine
    out = _run(eng)["a"]
    ref = TailraceEngine(tiny_model(0), num_slots=1)
    ref.load_weights(other.state_dict(), 3)
    want = ref.generate([r])[0]
    assert out.token_ids == want.token_ids and out.versions == (3,) * 12
    assert max(abs(a - b) for a, b in zip(out.logprobs, want.logprobs)) < 1e-5
    with pytest.raises(EngineError, match="max_versions=2: use None .* or 1"):
        TailraceEngine(model, max_versions=2)


BAD = {
    "empty prompt": GenRequest("bad", (), SamplingParams()),
    "longer than the context": GenRequest("bad", tuple(range(5)) * 13, SamplingParams()),
    "unknown version": GenRequest("bad", (1, 2), SamplingParams(), version=9),
    "duplicate id": GenRequest("dup", (1, 2), SamplingParams()),
    "unequal resume": GenRequest(
        "bad", (1, 2), SamplingParams(), resume_ids=(3, 4), resume_logprobs=(-1.0,), resume_versions=(0, 0)
    ),
    "token outside vocab": GenRequest("bad", (1, 200), SamplingParams()),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_raises_one_line_error_and_others_complete(model, case):
    eng = TailraceEngine(model, num_slots=2, max_context=64)
    good = [req("dup", 5, 12), req("g2", 9, 12)]
    for r in good:
        eng.add(r)
    eng.step()
    with pytest.raises(EngineError) as e:
        eng.add(BAD[case])
    assert "\n" not in str(e.value) and len(str(e.value)) < 250
    out = _run(eng)
    ref = TailraceEngine(model, num_slots=2, max_context=64).generate(good)
    assert [out[r.id].token_ids for r in good] == [r.token_ids for r in ref]


def test_step_events(model):
    eng = TailraceEngine(model, num_slots=3, prefill_tokens=10)
    for i in range(4):
        eng.add(req(f"e{i}", 6, 3 + i))
    events = []
    while eng.num_running or eng.num_waiting:
        events.append(eng.step())
    assert events[0].prefill_tokens == 10 and events[0].active == 0  # budget: one prompt and a chunk
    assert sum(e.prefill_tokens for e in events) == 24
    assert sum(e.decode_tokens for e in events) == 3 + 4 + 5 + 6
    assert max(e.active for e in events) == 3
    assert sorted(r.request_id for e in events for r in e.finished) == ["e0", "e1", "e2", "e3"]
    for e in events:
        assert e.duration > 0 and e.active <= len(e.advanced)
    res = [r for e in events for r in e.finished]
    assert all(r.submitted <= r.first_token <= r.finished for r in res)
    with pytest.raises(EngineError, match="unique id"):
        eng.generate([req("x", 3, 2), req("x", 3, 2)])


def test_built_engine_implements_the_protocol_and_states_its_capabilities(model):
    eng = build_engine(model, num_slots=1)
    assert isinstance(eng, Engine) and isinstance(eng, TailraceEngine)
    assert eng.capabilities == Capabilities(
        abort_resume=True, versions_at_once=None, per_request_seed=True, speculative=False, adapters=True
    )


def test_generate_reports_progress_and_returns_what_it_would_without(model):
    reqs = [req(f"p{i}", 3 + i, 4 + 3 * i) for i in range(5)]
    seen = []
    with_progress = TailraceEngine(model, num_slots=2).generate(reqs, lambda d, n: seen.append((d, n)))
    plain = TailraceEngine(model, num_slots=2).generate(reqs)
    assert [r.token_ids for r in with_progress] == [r.token_ids for r in plain]
    assert seen[-1] == (5, 5) and all(n == 5 for _, n in seen)
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})  # strictly growing


def test_waiting_requests_are_admitted_lowest_priority_first_in_arrival_order_among_equals(model):
    """Several policies in one run stamp their requests (flow/multi.py); unstamped ones stay a FIFO."""
    from dataclasses import replace

    eng = TailraceEngine(model, num_slots=1)
    stamps = {"a": (5.0, 1), "b": (1.0, 0), "c": (5.0, 1), "d": (1.0, 1), "e": (9.0, 0)}
    for rid, p in stamps.items():
        eng.add(replace(req(rid, 4, 3, temperature=1.0), priority=p))
    order = []
    while eng.num_running or eng.num_waiting:
        order += [r.request_id for r in eng.step().finished]
    assert order == ["b", "d", "a", "c", "e"]
    fifo = TailraceEngine(model, num_slots=1)
    for rid in "xyz":
        fifo.add(req(rid, 4, 3, temperature=1.0))
    assert list(_run(fifo)) == ["x", "y", "z"]


def test_priority_queue_inserts_after_its_equals():
    from collections import deque

    from tailrace.types import queue_by_priority

    q: deque = deque()
    for x in [(2, "a"), (1, "b"), (2, "c"), (0, "d"), (1, "e")]:
        queue_by_priority(q, x, lambda t: (t[0],))
    assert [t[1] for t in q] == ["d", "b", "e", "a", "c"]
