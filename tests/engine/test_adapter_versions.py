"""`AdapterVersions`: a LoRA run's versions as adapters over one base. A request of version v gets what
the same request gets from the engine serving adapter v itself, its tokens carry v (those it resumed
keep theirs), every version shares one forward, and the protocol's refusals hold."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tailrace.config.train import LoraConfig
from tailrace.engine.adapter_versions import AdapterVersions, adapter_from_state
from tailrace.engine.engine import TailraceEngine
from tailrace.engine.errors import EngineError
from tailrace.model import lora
from tailrace.model.flat import flatten_parameters
from tests.engine.engine_helpers import req, tiny_model

CFG = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


def published(base, seed: int) -> dict[str, torch.Tensor]:
    """What a LoRA trainer publishes: its adapter's parameters alone (B random: tokens change)."""
    torch.manual_seed(seed)
    m = lora.attach(copy.deepcopy(base), CFG)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, lora.LoRALinear):
                mod.lora_B.weight.normal_(0.0, 0.3)
    return {k: t.clone() for k, t in flatten_parameters(m, trainable=True).views().items()}


def at(r, version: int):
    return dataclasses.replace(r, version=version)


def test_versions_are_adapters_token_for_token():
    base = tiny_model(seed=0)
    states = {1: published(base, 1), 2: published(base, 2)}
    eng = AdapterVersions(TailraceEngine(copy.deepcopy(base), num_slots=16, block_size=8), alpha=CFG.alpha)
    for v, s in states.items():
        eng.load_weights(s, v)
    assert eng.versions == (0, 1, 2) and eng.capabilities.versions_at_once is None
    reqs = [at(req(f"r{i}", 4 + i, 12), i % 3) for i in range(9)]
    mixed = {r.request_id: r for r in eng.generate(reqs)}
    # the same requests on an engine given the adapters by name, each version alone
    ref = TailraceEngine(copy.deepcopy(base), num_slots=16, block_size=8)
    for v, s in states.items():
        ref.load_adapter(f"a{v}", adapter_from_state(s, CFG.alpha))
    for r in reqs:
        (alone,) = ref.generate(
            [dataclasses.replace(r, version=0, adapter=f"a{r.version}" if r.version else "")]
        )
        got = mixed[r.id]
        assert got.token_ids == alone.token_ids and got.versions == (r.version,) * len(got.token_ids)
        assert max(abs(x - y) for x, y in zip(got.logprobs, alone.logprobs)) < 1e-5
    differ = sum(mixed[f"r{i}"].token_ids != mixed[f"r{i - 1}"].token_ids for i in (1, 2, 4, 5))
    assert differ  # the versions generate differently (the test is not vacuous)


def test_a_resumed_partial_keeps_its_versions_and_drops_refuse_while_running():
    base = tiny_model(seed=0)
    eng = AdapterVersions(TailraceEngine(copy.deepcopy(base), num_slots=4, block_size=8), alpha=CFG.alpha)
    eng.load_weights(published(base, 1), 1)
    r = at(req("p", 6, 10), 1)
    eng.add(r)
    eng.step()
    eng.step()
    part = eng.abort("p")
    assert part.versions == (1,) * len(part.token_ids) and part.token_ids
    eng.load_weights(published(base, 2), 2)
    resumed = dataclasses.replace(
        r, version=2, resume_ids=part.token_ids, resume_logprobs=part.logprobs, resume_versions=part.versions
    )
    eng.add(resumed)
    with pytest.raises(EngineError, match="waiting or running"):
        eng.drop_version(2)
    eng.drop_version(1)  # nothing of it runs any more
    (done,) = _finish(eng)
    n = len(part.token_ids)
    assert done.versions[:n] == part.versions and set(done.versions[n:]) == {2}
    with pytest.raises(EngineError, match="version 1 not loaded"):
        eng.add(at(req("q", 4, 4), 1))
    with pytest.raises(EngineError, match="its version is its adapter"):
        eng.add(dataclasses.replace(at(req("q", 4, 4), 2), adapter="x"))
    with pytest.raises(EngineError, match="unexpected tensor.*load the adapter.s parameters alone"):
        eng.load_weights(flatten_parameters(copy.deepcopy(base)).views(), 3)


def _finish(eng):
    out = []
    while eng.num_running or eng.num_waiting:
        out += eng.step().finished
    return out


def test_speculation_figures_are_kept_per_version():
    """A self-drafter drafts every decode row; each row's drafted and accepted tokens are counted under
    its own version (its adapter's, the base's for version 0), and they add up to the step's."""
    from tailrace.engine.spec import SpecOptions

    base = tiny_model(seed=0)
    inner = TailraceEngine(
        copy.deepcopy(base), num_slots=16, block_size=8, spec=SpecOptions("quant8", toggle=False)
    )
    eng = AdapterVersions(inner, alpha=CFG.alpha)
    for v in (1, 2):
        eng.load_weights(published(base, v), v)
    for i in range(9):
        eng.add(at(req(f"r{i}", 4 + i, 12), i % 3))
    per: dict[int, list[int]] = {}
    drafted = accepted = 0
    while eng.num_running or eng.num_waiting:
        ev = eng.step()
        drafted, accepted = drafted + ev.drafted, accepted + ev.accepted
        assert sum(d for _, d, _ in ev.by_version) == ev.drafted
        assert sum(a for _, _, a in ev.by_version) == ev.accepted
        for v, d, a in ev.by_version:
            c = per.setdefault(v, [0, 0])
            c[0], c[1] = c[0] + d, c[1] + a
    assert set(per) == {0, 1, 2} and drafted > 0
    # the base's drafts agree with version 0 (the base itself) more than with the adapted versions
    rate = {v: a / d for v, (d, a) in per.items()}
    assert rate[0] > max(rate[1], rate[2])
