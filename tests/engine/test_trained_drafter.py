"""The trained drafter (TLT) learns: its loss on a fixed set of the policy's responses falls with
training; it trains only while the engine is idle, within its budget per idle period; its drafts are
booked per policy version; bad settings fail in one line naming the fix. (Its exactness is tested
with every other drafter's in test_spec_engine.py.)"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from tailrace.config import ConfigError, load_config
from tailrace.engine import TailraceEngine
from tailrace.engine.spec import SpecOptions
from tailrace.engine.spec.costs import Toggle
from tailrace.engine.spec.draftnet import DraftNet
from tailrace.engine.spec.trained import TrainedDrafter
from tests.engine.engine_helpers import req, tiny_model


def _responses(model, n=24, seed=0):
    reqs = [req(f"r{seed}-{i}", 3 + i % 7, 48, temperature=1.0) for i in range(n)]
    out = TailraceEngine(model, num_slots=8).generate(reqs)
    return [(r.prompt_ids, o.token_ids) for r, o in zip(reqs, out)]


def test_training_lowers_the_drafters_loss_on_a_fixed_set_of_responses():
    """The policy's own sampled responses: 40 steps cut the next-token loss by a fifth or more (the
    untrained net, the policy cut after its first layer, is far from the policy's distribution)."""
    model = tiny_model(0)
    data = _responses(model)
    net = DraftNet(model, layers=1)
    embed, head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    with torch.no_grad():
        before = net.loss(data, embed, head).item()
    rng = random.Random(0)
    for _ in range(40):
        net.train_step(data, embed, head, rng)
    with torch.no_grad():
        after = net.loss(data, embed, head).item()
    assert after < 0.8 * before, (before, after)


def test_it_trains_only_when_idle_and_within_its_budget_per_idle_period():
    eng = TailraceEngine(tiny_model(0), num_slots=4, spec=SpecOptions("trained", train_s=0.15))
    for r in _responses(tiny_model(0), n=8):
        eng.add_history(*r)
    eng.add(req("busy", 4, 30))
    assert eng.idle(1.0) is None  # a request waits: no training
    eng.step()
    assert eng.idle(1.0) is None  # it runs: no training
    while eng.num_running:
        eng.step()
    done = eng.idle(1.0)
    step_s = done.seconds / done.steps
    assert done.steps >= 1 and done.seconds <= 0.15 + 2 * step_s
    assert eng.idle(1.0) is None  # the idle period's budget is spent
    eng.generate([req("next", 4, 10)])  # a step starts a new period
    again = eng.idle(0.05)  # and a slice of it is what the caller gives
    assert again is not None and again.seconds <= 0.05 + 2 * step_s
    st = eng.spec_stats
    assert st.train_steps == done.steps + again.steps and st.train_s == pytest.approx(
        done.seconds + again.seconds
    )


def test_a_frozen_drafter_never_trains_and_one_without_data_has_nothing_to_learn():
    eng = TailraceEngine(tiny_model(0), num_slots=4, spec=SpecOptions("trained", train_s=0))
    eng.generate([req(f"f{i}", 4, 20) for i in range(4)])
    assert eng.idle(1.0) is None and eng.spec_stats.train_steps == 0
    assert TailraceEngine(tiny_model(0), num_slots=4, spec="trained").idle(1.0) is None


def test_acceptance_is_booked_per_policy_version():
    eng = TailraceEngine(tiny_model(0), num_slots=4, spec=SpecOptions("trained", toggle=False))
    eng.load_weights(tiny_model(5).state_dict(), 3)
    events = []
    for r in [req(f"a{i}", 4, 30, version=(0, 3)[i % 2]) for i in range(4)]:
        eng.add(r)
    while eng.num_running or eng.num_waiting:
        events.append(eng.step())
    st = eng.spec_stats
    assert set(st.by_version) == {0, 3} and set(st.acceptance_by_version()) == {0, 3}
    for v in (0, 3):
        drafted = sum(d for e in events for ver, d, _ in e.by_version if ver == v)
        accepted = sum(a for e in events for ver, _, a in e.by_version if ver == v)
        assert [drafted, accepted] == st.by_version[v][:2] and drafted > 0


def test_bad_settings_say_what_to_fix_in_one_line():
    with pytest.raises(ValueError, match=r"train_s=-1.*>= 0"):
        SpecOptions("trained", train_s=-1)
    with pytest.raises(ValueError, match=r"3 layers over a 2-layer policy: use 1..2"):
        TailraceEngine(tiny_model(0), num_slots=2, spec=functools.partial(TrainedDrafter, layers=3))
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["--rollout.spec.train_s=-0.5"])
    assert "rollout.spec.train_s=-0.5" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("attention", ["kernel", "bmm"])
def test_drafts_over_its_own_cache_are_the_drafting_models_whole_sequence_greedy_continuations(
    monkeypatch, attention
):
    """Greedy requests: each draft, built on the drafter's paged cache (caught up piece by piece since
    the request's last draft, across row moves as requests finish), is what the drafting model's
    whole-sequence forward continues greedily; a stale or misplaced k/v would show as a mismatch."""
    monkeypatch.setattr(Toggle, "gamma", lambda self, batch, alpha, gamma_max, veto=True: gamma_max)
    model = tiny_model(0)
    eng = TailraceEngine(model, num_slots=3, spec="trained", attention=attention)
    drafter = eng._spec.drafter
    seen = []
    propose = drafter.propose

    def record(rows):
        out = propose(rows)
        seen.extend((r.prompt + tuple(r.tokens), r.version, d) for r, d in zip(rows, out))
        return out

    monkeypatch.setattr(drafter, "propose", record)
    reqs = [req(f"g{i}", 3 + 2 * i, 20 + 7 * i, temperature=0.0) for i in range(5)]
    plain = TailraceEngine(model, num_slots=3, attention=attention).generate(reqs)
    assert [r.token_ids for r in eng.generate(reqs)] == [r.token_ids for r in plain]
    assert len(seen) > 20
    same = 0
    for ids, v, draft in seen:
        m, _ = drafter._models[v]
        want, x = [], list(ids)
        with torch.no_grad():
            for _ in draft:
                want.append(int(m(torch.tensor([x]))[0, -1].argmax()))
                x.append(want[-1])
        same += want == draft
    assert same >= 0.95 * len(seen), (same, len(seen))


@pytest.mark.parametrize(
    "family",
    [
        {},
        dict(model_type="olmo2"),  # its final norm scales in fp32
        dict(model_type="gemma3_text", sliding_window=6, layer_types=("sliding_attention", "full_attention")),
    ],
    ids=["llama", "olmo2", "gemma3"],
)
@torch.no_grad()
def test_a_drafter_of_every_layer_starts_as_the_policy(family):
    """Initialized from the policy's layers and final norm: with all of them it is the policy (its final
    norm the policy's kind: OLMo2's scales in fp32, Gemma's by 1 + w, here moved off its init of 0)."""
    model = tiny_model(0, **family)
    model.model.norm.weight.add_(0.3)
    net = DraftNet(model, layers=model.config.num_hidden_layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    got = net(ids, model.model.embed_tokens.weight, model.lm_head.weight)
    assert (got - model(ids)).abs().max() < 1e-5
