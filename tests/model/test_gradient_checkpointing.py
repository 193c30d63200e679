"""Gradient checkpointing (`CausalLM.gradient_checkpointing`, `decoder.recomputed`): the backward runs each
layer again from its input, and the gradients are those of the plain forward, bit for bit, in every
layout, fp32 and bf16 autocast; a mixture of experts takes the same experts in the second run (routing
replay's or its own) and counts its load once."""

from __future__ import annotations

import pytest
import torch
from model_helpers import CONFIGS, make_config, random_model

from tailrace.config.train import LoraConfig
from tailrace.model import lora
from tailrace.model.moe import SparseMoE, balance_loss, balancing, replaying, take_load
from tests.engine.test_engine_routes import own_routes


def _grads(model, ids, on: bool, bf16: bool = False, routes=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing = on
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16), replaying(model, routes):
        out = model(ids)
    out.float().logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ids(T: int = 24) -> torch.Tensor:
    return torch.randint(1, 53, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recomputed_layers_give_the_plain_forwards_gradients_bit_for_bit(name, bf16):
    model, ids = random_model(make_config(**CONFIGS[name])), _ids()
    plain = _grads(model, ids, False, bf16)
    assert len(plain) == sum(1 for p in model.parameters())  # every weight reached
    again = _grads(model, ids, True, bf16)
    assert plain.keys() == again.keys()
    assert all(torch.equal(plain[k], again[k]) for k in plain), name


def test_it_keeps_only_the_layers_inputs_and_runs_them_again_in_the_backward():
    """What autograd keeps: with it, a handful of tensors a layer (its input, the step's tables) where the
    plain forward keeps dozens; and the backward calls each layer's forward a second time."""
    model, ids = random_model(make_config(num_hidden_layers=4)), _ids()
    calls = []

    def counted(forward):
        def run(*args):
            calls.append(forward)
            return forward(*args)

        return run

    for layer in model.model.layers:
        layer.forward = counted(layer.forward)

    def saved(on: bool) -> int:
        model.gradient_checkpointing, n = on, [0]

        def pack(t):
            n[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids)
        out.sum().backward()
        return n[0]

    plain, calls_plain = saved(False), len(calls)
    kept = saved(True)
    assert calls_plain == 4 and len(calls) - calls_plain == 8  # each layer twice: forward, then backward
    assert kept < plain / 3, (kept, plain)


def test_no_graph_no_recompute_and_the_logits_unchanged():
    model, ids = random_model(make_config()), _ids()
    with torch.no_grad():
        plain = model(ids)
        model.gradient_checkpointing = True
        assert torch.equal(model(ids), plain)


def test_a_mixture_of_experts_takes_its_first_runs_experts_again_and_counts_once():
    """The recompute routes nothing afresh: it takes the experts the first run took (those replayed, where
    routing replay gives them), its load is counted once, and the load-balancing loss's statistics once."""
    model, ids = random_model(make_config(**CONFIGS["qwen3moe-gqa2-experts-dense"])), _ids()
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    take_load(model)
    plain = _grads(model, ids, False)
    load = [list(m.load) for m in moes]
    take_load(model)
    again = _grads(model, ids, True)
    assert [list(m.load) for m in moes] == load and all(torch.equal(plain[k], again[k]) for k in plain)
    assert all(m.kept is None and m.again is None for m in moes)
    # replayed routes: another's experts for the first row, taken in both runs of each layer
    own = torch.stack([own_routes(model, tuple(row.tolist())) for row in ids]).to(torch.int16)
    other = own.clone()
    other[0] = (own[0] + 1) % 6
    take_load(model)
    plain = _grads(model, ids, False, routes=other)
    flips = take_load(model)["moe_route_flips"]
    again = _grads(model, ids, True, routes=other)
    assert take_load(model)["moe_route_flips"] == flips > 0
    assert all(torch.equal(plain[k], again[k]) for k in plain)
    # the balancing loss: its statistics collected once, in the forward, and its gradient the same
    valid = torch.ones(ids.shape, dtype=torch.bool)
    valid[1, 20:] = False
    got = []
    for on in (False, True):
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing = on
        with balancing(model, valid) as stats:
            out = model(ids)
        n = len(stats)
        (out.sum() + balance_loss(stats, 6)).backward()
        assert n == len(stats) == len(moes)
        got.append({k: p.grad.clone() for k, p in model.named_parameters()})
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])


def test_a_lora_adapters_gradients_are_the_same():
    model, ids = random_model(make_config(num_hidden_layers=3)), _ids()
    lora.attach(model, LoraConfig(rank=4, alpha=8))
    for p in model.parameters():  # B starts at zero: move it, so A's gradient is not zero
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    plain = _grads(model, ids, False, bf16=True)
    assert plain and all("lora" in k for k in plain)
    again = _grads(model, ids, True, bf16=True)
    assert all(torch.equal(plain[k], again[k]) for k in plain)
