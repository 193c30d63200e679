"""The trainer's mixture-of-experts paths on CUDA (skipped without a GPU): routing replay and the
load-balancing loss, against the same step on the CPU."""

from __future__ import annotations

import pytest
import torch

from tailrace.config import TrainerConfig
from tailrace.model import CausalLM
from tailrace.trainer.grpo import GRPOTrainer
from tests.trainer.test_grpo import make_groups, moe_config, with_routes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def replay_on(device: str, bf16: bool) -> None:
    """One GRPO step of a Qwen3-MoE (and a Qwen2-MoE, its shared expert beside) on `device`, its
    routes replayed: the model's own routes train as no replay does (fp32: to rounding, the experts'
    sums may run in another order), other routes are taken and counted as flips; a bf16 step takes
    the fp32 model's routes, every one, and counts where its own router would have chosen others.
    The fp32 step's loss equals the CPU's."""
    for cfg in (moe_config(), moe_config(shared=40)):
        groups = with_routes(
            make_groups(CausalLM.from_config(cfg, seed=0)), CausalLM.from_config(cfg, seed=0)
        )
        other = with_routes(groups, CausalLM.from_config(cfg, seed=0), shift=1)
        runs = {}
        for name, gs, replay, where in (
            ("cpu", groups, True, "cpu"),
            ("plain", groups, False, device),
            ("own", groups, True, device),
            ("other", other, True, device),
        ):
            if name == "cpu" and bf16:
                continue
            model = CausalLM.from_config(cfg, seed=0).to(where)
            tr = GRPOTrainer(
                model, TrainerConfig(lr=1e-2, routing_replay=replay, bf16=bf16 and where != "cpu")
            )
            runs[name] = (tr.step(gs, trainer_version=0), tr.flat.buffer.detach().to("cpu").clone())
        (plain, w_plain), (own, w_own), (other_m, w_other) = runs["plain"], runs["own"], runs["other"]
        assert own["routes_replayed"] == 1.0 and other_m["routes_replayed"] == 1.0
        assert other_m["moe_route_flips"] == 1.0 and not torch.allclose(w_other, w_plain)
        if bf16:
            assert 0.0 <= own["moe_route_flips"] < 0.5 and torch.isfinite(w_own).all()
            continue
        assert own["moe_route_flips"] == 0.0
        assert own["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
        assert torch.allclose(w_own, w_plain, rtol=0, atol=1e-6)
        cpu, w_cpu = runs["cpu"]
        assert own["loss"] == pytest.approx(cpu["loss"], rel=1e-4, abs=1e-6)
        assert torch.allclose(w_own, w_cpu, rtol=0, atol=1e-4)


@pytest.mark.parametrize("bf16", [False, True])
def test_cuda_routing_replay_takes_the_engines_experts(bf16):
    replay_on("cuda", bf16)


def test_cuda_load_balancing_loss_adds_to_the_loss_as_on_the_cpu():
    """train.moe_aux_loss on CUDA: the logged term and the step's loss are the CPU's."""
    got = []
    for device in ("cpu", "cuda"):
        model = CausalLM.from_config(moe_config(), seed=0).to(device)
        tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, moe_aux_loss=0.5))
        got.append(tr.step(make_groups(CausalLM.from_config(moe_config(), seed=0)), trainer_version=0))
    cpu, cuda = got
    assert cuda["moe_aux_loss"] == pytest.approx(cpu["moe_aux_loss"], rel=1e-5)
    assert cuda["loss"] == pytest.approx(cpu["loss"], rel=1e-4, abs=1e-6)
