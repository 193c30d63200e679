"""`VLLMEngine` serving LoRA adapters (vLLM's own LoRA support): a LoRA run's versions as adapters over
one base on vLLM. Rows of several versions share a step and each gets what tailrace's engine gives the
same version; seeded rows do not depend on the batch; new weights under a held name leave requests in
flight on the weights they started with. Needs vLLM: skipped where it does not import (CI);
`make test-vllm` runs it."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from tailrace.engine import EngineError, TailraceEngine, build_engine  # noqa: E402
from tailrace.engine.adapter_versions import AdapterVersions, adapter_from_state  # noqa: E402
from tailrace.model.checkpoint import load_pretrained, save_pretrained  # noqa: E402
from tailrace.types import GenRequest, SamplingParams  # noqa: E402
from tests.engine.engine_helpers import prompt, tiny_model  # noqa: E402
from tests.engine.test_adapter_versions import CFG, published  # noqa: E402

SHAPE = dict(num_attention_heads=2, num_key_value_heads=1)  # head size 32: vLLM's CPU attention takes it
SLOTS, CONTEXT = 8, 128


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-lora") / "base"
    save_pretrained(tiny_model(seed=0, **SHAPE), path)
    return path


@pytest.fixture(scope="module")
def states(base_dir):
    base = load_pretrained(base_dir)
    return {1: published(base, 1), 2: published(base, 2)}


def _vllm(path, **kw):
    opts = dict(num_slots=SLOTS, max_context=CONTEXT, kv_memory_gb=0.0625, threads=1, lora_rank=CFG.rank)
    return build_engine(path, backend="vllm", **{**opts, **kw})


@pytest.fixture(scope="module")
def eng(base_dir, states):
    e = AdapterVersions(_vllm(base_dir, max_adapters=3), alpha=CFG.alpha)
    for v, s in states.items():
        e.load_weights(s, v)
    return e


def _req(rid: str, version: int, n_prompt=5, max_new=12, **params) -> GenRequest:
    p = prompt(sum(map(ord, rid)), n_prompt)
    return GenRequest(rid, p, SamplingParams(max_new_tokens=max_new, **params), version=version)


def test_versions_share_a_step_and_each_gets_tailraces_tokens(eng, base_dir, states):
    assert eng.capabilities.adapters and eng.capabilities.versions_at_once is None
    assert eng.versions == (0, 1, 2) and "LoRA up to rank 8, 3 adapters a step" in eng.describe()
    reqs = [_req(f"g{i}", i % 3, 3 + i, 10, temperature=0.0) for i in range(9)]
    got = eng.generate(reqs)
    ours = AdapterVersions(TailraceEngine(load_pretrained(base_dir), num_slots=SLOTS), alpha=CFG.alpha)
    for v, s in states.items():
        ours.load_weights(s, v)
    want = ours.generate(reqs)
    for r, a, b in zip(reqs, got, want):
        assert a.token_ids == b.token_ids and a.versions == (r.version,) * 10
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert len({got[i].token_ids for i in (0, 3, 6)} | {got[i].token_ids for i in (1, 4, 7)}) > 3


def test_a_seeded_row_does_not_depend_on_the_adapters_beside_it(eng):
    alone = {v: eng.generate([_req("s", v, seed=7, max_new=16)])[0] for v in (0, 1, 2)}
    crowd = [_req(f"c{i}", i % 3, 4 + i, 16, seed=i) for i in range(6)]
    for v in (0, 1, 2):
        mixed = {r.request_id: r for r in eng.generate(crowd + [_req("s", v, seed=7, max_new=16)])}
        assert mixed["s"].token_ids == alone[v].token_ids
    assert len({r.token_ids for r in alone.values()}) == 3  # the versions differ (not vacuous)


def test_new_weights_under_a_held_name_leave_requests_in_flight_on_theirs(base_dir, states):
    inner = _vllm(base_dir)
    one, two = (adapter_from_state(states[v], CFG.alpha) for v in (1, 2))
    inner.load_adapter("a", one)
    greedy = dict(temperature=0.0)
    want_one = inner.generate([dataclasses.replace(_req("w1", 0, max_new=30, **greedy), adapter="a")])[0]
    inner.add(dataclasses.replace(_req("w1", 0, max_new=30, **greedy), adapter="a"))
    inner.step()
    inner.load_adapter("a", two)  # over the held name, mid-request
    inner.add(dataclasses.replace(_req("w3", 0, max_new=30, **greedy), adapter="a"))
    with pytest.raises(EngineError, match="1 request.s. of it are waiting or running"):
        inner.drop_adapter("a")
    inner.abort("w3")
    done = []
    while inner.num_running + inner.num_waiting:
        done += inner.step().finished
    assert done[0].token_ids == want_one.token_ids
    assert len(inner._llm.list_loras()) == 1  # the old weights went once their request finished
    want_two = inner.generate([dataclasses.replace(_req("w2", 0, max_new=30, **greedy), adapter="a")])[0]
    assert want_two.token_ids != want_one.token_ids
    inner.drop_adapter("a")
    assert inner.adapters == () and not inner._llm.list_loras()


def test_what_it_refuses(base_dir, states):
    plain = _vllm(base_dir, lora_rank=0)
    assert not plain.capabilities.adapters
    with pytest.raises(EngineError, match="serves no adapters; build it with lora_rank"):
        plain.load_adapter("a", adapter_from_state(states[1], CFG.alpha))
    inner = _vllm(base_dir, lora_rank=1)
    with pytest.raises(EngineError, match="rank 4 exceeds the rank 1"):
        inner.load_adapter("a", adapter_from_state(states[1], CFG.alpha))
    with pytest.raises(EngineError, match="not loaded"):
        inner.add(dataclasses.replace(_req("x", 0), adapter="nobody"))
    with pytest.raises(EngineError, match="not loaded"):
        inner.drop_adapter("nobody")
    with pytest.raises(EngineError, match="vLLM serves ranks 1 to 512"):
        _vllm(base_dir, lora_rank=600)


@pytest.mark.parametrize(
    "family",
    [dict(model_type="smollm3", no_rope_layers=(1, 0)), dict(model_type="phi3")],
    ids=["smollm3", "phi3"],
)
def test_a_base_of_another_layout_serves_adapters_as_tailraces_engine_does(tmp_path, family):
    """SmolLM3 (a layer without RoPE, served by vLLM's transformers backend) and Phi-3 (q/k/v and gate/up
    fused: vLLM takes the adapter for its fused modules, here block-diagonal at three times the rank, k's
    block zero, as `save_peft` writes it): an adapter's greedy rows are tailrace's."""
    path = tmp_path / "base"
    save_pretrained(tiny_model(seed=0, **SHAPE, **family), path)
    base = load_pretrained(path)
    theirs, ours = (
        AdapterVersions(_vllm(path, max_adapters=2), alpha=CFG.alpha),
        AdapterVersions(TailraceEngine(base, num_slots=SLOTS), alpha=CFG.alpha),
    )
    for e in (theirs, ours):
        e.load_weights(published(base, 1), 1)
    reqs = [_req(f"s{i}", 1, temperature=0.0) for i in range(4)]
    for a, b in zip(theirs.generate(reqs), ours.generate(reqs)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
