"""tailrace.client's parts that need no run: the weights laid out as the engines hold them (the names
and shapes checked, tied names in one slice), an optimizer's state through tensors and back, and a
trainer on another machine than the run's trainer process refused in one line."""

import threading

import pytest
import torch
from torch import nn

from tailrace.client import (
    TrainerClient,
    TrainerClientError,
    flatten_weights,
    load_optimizer_state,
    optimizer_state,
)
from tailrace.config import TrainerConfig
from tailrace.model.flat import flatten_parameters
from tailrace.runtime.join import listen, unlisten
from tailrace.runtime.relay import NAME, Handshake, send


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 2)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_a_state_dict_fills_the_engines_layout_tied_names_in_one_slice():
    torch.manual_seed(0)
    model = Tied()
    want = flatten_parameters(model)
    other = Tied()  # another model's state_dict, by the same names
    got = flatten_weights(other.state_dict(), want.layout, want.buffer.numel(), torch.float32, "here")
    assert got.numel() == 15 + 6 + 2  # the tied head shares the embedding's slice
    views = {
        n: got[o : o + s.numel()].view(s) for n, s, o in ((n, torch.Size(s), o) for n, s, o in want.layout)
    }
    for name, t in other.state_dict().items():
        assert torch.equal(views[name], t), name


def test_a_missing_name_or_a_wrong_shape_is_one_line_naming_the_tensor():
    flat = flatten_parameters(Tied())
    layout, n = flat.layout, flat.buffer.numel()
    state = Tied().state_dict()
    with pytest.raises(TrainerClientError, match=r"lack 'proj.bias' \(1 of 4 names\).*loaded from ckpt"):
        flatten_weights(
            {k: v for k, v in state.items() if k != "proj.bias"}, layout, n, torch.float32, "ckpt"
        )
    state["proj.weight"] = torch.zeros(3, 2)
    with pytest.raises(
        TrainerClientError, match=r"weights\['proj.weight'\] has shape \(3, 2\), the run's model \(2, 3\)"
    ):
        flatten_weights(state, layout, n, torch.float32, "ckpt")


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe", "qwen2_moe"])
def test_transformers_fused_weights_fill_the_engines_layout_of_separate_projections(tmp_path, family):
    """transformers' Phi-3 keeps q/k/v and gate/up fused, and transformers 5's Qwen3-MoE (Qwen2-MoE's too,
    beside its shared expert) all experts of a layer in one 3-D weight each for gate/up and down: their
    state_dicts fill a layout by tailrace's separate projections (split by rows; by expert), so the engines'
    model is transformers' to the bit."""
    from transformers import AutoModelForCausalLM

    from tailrace.model import CausalLM, ModelConfig, save_pretrained

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24) if family != "phi3" else {}
    if family == "qwen2_moe":  # its shared expert beside the stacked ones
        moe["shared_expert_intermediate_size"] = 40
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, model_type=family, **moe)  # fmt: skip
    ours = CausalLM.from_config(cfg, seed=0)
    save_pretrained(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert any(n.endswith(("qkv_proj.weight", "experts.gate_up_proj")) for n in hf.state_dict())
    want = flatten_parameters(ours)
    got = flatten_weights(hf.state_dict(), want.layout, want.buffer.numel(), torch.float32, str(tmp_path))
    assert torch.equal(got, want.buffer)


def test_an_optimizers_state_goes_through_tensors_and_back():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
    saved = optimizer_state(opt)
    assert all(isinstance(t, torch.Tensor) for t in saved.values()) and "state.0.exp_avg" in saved
    twin = nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(twin.parameters(), lr=0.1)
    load_optimizer_state(opt2, saved)
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)


def test_a_trainer_on_another_machine_than_the_relay_is_told_where_to_run(tmp_path):
    """On Ray the relay may be on another node: the weights go through its machine's memory, so a
    trainer elsewhere is refused at the handshake, naming the machine."""
    listener = listen(tmp_path, NAME)
    staging = tmp_path / "staging"
    staging.write_bytes(b"")
    hello = Handshake(str(tmp_path), {}, 0, (), 0, str(staging), "node-7", "float32", 1.0, 0,
                      TrainerConfig(), (), 1)  # fmt: skip

    def relay():
        with listener.accept() as conn:
            send(conn, hello)

    t = threading.Thread(target=relay)
    t.start()
    try:
        with pytest.raises(
            TrainerClientError, match=r"trainer process is on node-7.*start your trainer there"
        ):
            TrainerClient(tmp_path, wait_s=10)
    finally:
        t.join(timeout=10)
        unlisten(listener, tmp_path, NAME)


def test_a_batchs_tensors_carry_the_engines_routes_under_routing_replay(tmp_path):
    """An external trainer of an MoE run with train.routing_replay gets each position's experts as the
    engine chose them (`TrainBatch.routes`), for its own forward to take."""
    import types

    from tailrace.client import Batch
    from tailrace.engine import TailraceEngine
    from tailrace.model import CausalLM, ModelConfig, save_pretrained
    from tailrace.model.moe import routes_of
    from tailrace.runtime.relay import Work
    from tailrace.types import GenRequest, Group, SamplingParams, Trajectory

    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, **moe
    )
    model = CausalLM.from_config(cfg, seed=0)
    save_pretrained(model, tmp_path / "moe")
    reqs = [GenRequest(f"0.{i}", (1, 5, 7), SamplingParams(max_new_tokens=6, seed=i)) for i in range(2)]
    results = TailraceEngine(model, num_slots=2, routes=True).generate(reqs)
    group = Group(
        0, 0, tuple(Trajectory(0, i, 0, (1, 5, 7), r, float(i), i == 1) for i, r in enumerate(results))
    )
    work = Work(0, (group,), 0, True, False, False)
    for replay in (False, True):
        client = types.SimpleNamespace(
            config=TrainerConfig(routing_replay=replay), start=str(tmp_path / "moe")
        )
        batch = Batch(work, client).tensors()
        if not replay:
            assert batch.routes is None
    assert batch.routes.shape == (2, 8, 2, 2)
    assert torch.equal(batch.routes[1], routes_of(results[1].routes, cfg))
