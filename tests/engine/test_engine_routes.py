"""Routing replay's engine side (`TailraceEngine(routes=True)`): a mixture of experts' results carry the
experts each position's forward chose, kept in the KV cache beside its k/v, so they are the routes the
model itself takes over the whole sequence, through chunked prefill, paging and preemption, speculation
and aborts (fp32: the engine's forwards and the model's agree to rounding, far from any near-tie here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tailrace.engine import EngineError, TailraceEngine, ckernel
from tailrace.engine.kv_budget import GIB
from tailrace.engine.kv_cache import KVCache
from tailrace.engine.spec import SpecOptions
from tailrace.model.decoder import CausalLM
from tailrace.model.moe import routes_of
from tailrace.types import GenRequest, GenResult
from tests.engine.engine_helpers import MOE, QWEN2_MOE, req, tiny_model


def own_routes(model: CausalLM, ids: tuple[int, ...]) -> torch.Tensor:
    """(positions, sparse layers, k) sorted: what each sparse layer chooses in one forward over `ids`."""
    got, hooks = [], []
    for m in (layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")):
        hooks.append(
            m.register_forward_hook(lambda mod, a, o: got.append(torch.topk(mod.gate(a[0]), mod.k, -1)[1]))
        )
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, 2)[0].sort(-1).values


def assert_own(model: CausalLM, reqs: list[GenRequest], results: list[GenResult]) -> None:
    for r, res in zip(reqs, results):
        seq = r.prompt_ids + res.token_ids
        got = routes_of(res.routes, model.config)
        assert got.shape[0] == len(seq) - 1, r.id  # every position but the last token's (never fed)
        assert torch.equal(got.long().sort(-1).values, own_routes(model, seq[:-1])), r.id


@pytest.mark.parametrize("attention,moe", [("kernel", MOE), ("bmm", MOE), ("kernel", QWEN2_MOE)])
def test_results_carry_the_models_own_routes_through_chunked_prefill_and_preemption(attention, moe):
    if attention == "kernel" and ckernel.unavailable():
        pytest.skip("no C compiler")
    model = tiny_model(0, **moe)
    reqs = [
        req(f"r{i}", 3 + 2 * i, 20 + 3 * i, temperature=1.0, pseed=1 if i < 3 else None) for i in range(10)
    ]
    budget = 24 * 4 * KVCache.token_bytes(model, torch.float32) / GIB  # 24 blocks of 4: preemptions
    eng = TailraceEngine(
        model,
        num_slots=6,
        block_size=4,
        kv_memory_gb=budget,
        prefill_tokens=8,
        attention=attention,
        routes=True,
    )
    got = eng.generate(reqs)
    assert eng.preemptions > 0
    assert_own(model, reqs, got)
    plain = TailraceEngine(
        model, num_slots=6, block_size=4, kv_memory_gb=budget, prefill_tokens=8, attention=attention
    )
    assert [r.token_ids for r in plain.generate(reqs)] == [
        r.token_ids for r in got
    ]  # recording changes nothing
    assert all(r.routes == b"" for r in plain.generate(reqs[:2]))


def test_speculated_tokens_carry_the_routes_their_verification_took():
    """A verify forward routes the drafted positions; a rejected draft's position is routed again when
    the target's own token there is fed."""
    model = tiny_model(0, **MOE)
    reqs = [req(f"s{i}", 4 + i, 40, temperature=1.0) for i in range(4)]
    eng = TailraceEngine(model, num_slots=4, spec=SpecOptions("quant8", toggle=False), routes=True)
    got = eng.generate(reqs)
    assert eng.spec_stats.accepted > 0 and eng.spec_stats.drafted > eng.spec_stats.accepted
    assert_own(model, reqs, got)


def test_an_aborted_request_carries_the_routes_of_the_positions_it_fed():
    model = tiny_model(0, **MOE)
    eng = TailraceEngine(model, num_slots=2, routes=True)
    r, waiting = req("a", 7, 50, temperature=1.0), req("w", 5, 50)
    eng.add(r)
    for _ in range(6):
        eng.step()
    part = eng.abort("a")
    assert len(part.token_ids) > 1
    assert_own(model, [r], [part])
    eng.add(waiting)
    assert eng.abort("w").routes == b""  # never prefilled: no routes


def test_routes_need_a_mixture_of_experts():
    with pytest.raises(EngineError, match="has no experts"):
        TailraceEngine(tiny_model(0), routes=True)


def test_a_resumed_partial_keeps_the_routes_its_tokens_were_drawn_with():
    """An aborted partial resumed under a newer version (partial rollout): the positions whose next token
    the old version drew keep the old version's routes (`resume_routes`); the re-prefill's own routes of
    them are the new version's, and the positions after are the new version's too."""
    old, new = tiny_model(0, **MOE), tiny_model(1, **MOE)
    eng = TailraceEngine(old, num_slots=2, routes=True)
    eng.load_weights(new.state_dict(), 1)
    r = req("p", 6, 30, temperature=1.0)
    eng.add(r)
    for _ in range(8):
        eng.step()
    part = eng.abort("p")
    assert len(part.token_ids) > 2
    resumed = dataclasses.replace(
        r, version=1, resume_ids=part.token_ids, resume_logprobs=part.logprobs, resume_versions=part.versions
    )
    full, plain = [
        eng.generate([dataclasses.replace(resumed, id=i, resume_routes=b)])[0]
        for i, b in (("kept", part.routes), ("none", b""))
    ]
    assert full.token_ids == plain.token_ids and len(full.token_ids) > len(part.token_ids)
    cut = len(r.prompt_ids) + len(part.token_ids) - 1  # positions whose next token the old version drew
    seq = r.prompt_ids + full.token_ids
    got, theirs = routes_of(full.routes, old.config), routes_of(plain.routes, old.config)
    assert torch.equal(got[:cut], routes_of(part.routes, old.config))
    assert torch.equal(got[cut:], theirs[cut:])
    assert torch.equal(
        theirs.long().sort(-1).values, own_routes(new, seq[:-1])
    )  # all re-routed by the new one
    assert not torch.equal(got[:cut].long().sort(-1).values, own_routes(new, seq[:cut]))  # other weights
