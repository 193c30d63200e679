"""The KL reference moved to the policy every train.loss.ref_sync_steps steps (TRL's sync_ref_model, ProRL's
reset): ref = alpha x policy + (1 - alpha) x ref, by hand; a LoRA run's reference adapter becomes the
policy's; what a checkpoint keeps of it comes back; and the settings it refuses."""

import copy

import pytest
import torch

from tailrace.config import ConfigError, LossConfig, TrainerConfig
from tailrace.config.train import LoraConfig
from tailrace.model import CausalLM, ModelConfig, lora
from tailrace.trainer.grpo import GRPOTrainer
from tests.trainer.test_grpo import V, make_groups

CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


def _full(every: int, alpha: float) -> GRPOTrainer:
    model = CausalLM.from_config(CFG, seed=0)
    loss = LossConfig(kl_coef=0.1, ref_sync_steps=every, ref_sync_alpha=alpha)
    return GRPOTrainer(
        model, TrainerConfig(lr=5e-2, loss=loss), ref_model=copy.deepcopy(model).requires_grad_(False)
    )


def _params(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_every_n_steps_the_reference_moves_alpha_of_the_way_to_the_policy():
    tr = _full(every=2, alpha=0.25)
    start = _params(tr.ref_model)
    got = [tr.step(make_groups(tr.model, seed=0), trainer_version=0)]
    assert all(torch.equal(p, start[k]) for k, p in _params(tr.ref_model).items())  # step 1: as it started
    assert tr.reference_state() is None  # nothing a checkpoint needs: the start is the reference
    got.append(tr.step(make_groups(tr.model, seed=1), trainer_version=1))
    policy, ref = _params(tr.model), _params(tr.ref_model)
    assert ref.keys() == start.keys() and "lm_head.weight" not in ref  # tied: the embedding once
    for k in start:
        torch.testing.assert_close(ref[k], 0.75 * start[k] + 0.25 * policy[k], rtol=0, atol=1e-6)
    assert not torch.equal(
        ref["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"]
    )
    assert got[1]["kl"] > 0


def test_alpha_one_resets_the_reference_so_the_next_steps_kl_starts_at_zero():
    tr = _full(every=2, alpha=1.0)
    for s in range(2):
        tr.step(make_groups(tr.model, seed=s), trainer_version=s)
    assert all(torch.equal(a, b) for a, b in zip(_params(tr.model).values(), _params(tr.ref_model).values()))
    assert tr.step(make_groups(tr.model, seed=2), trainer_version=2)["kl"] == pytest.approx(0.0, abs=1e-7)


def test_a_lora_runs_reference_adapter_becomes_the_policys_adapter():
    lc = LoraConfig(rank=4, alpha=8.0)
    loss = LossConfig(kl_coef=0.1, ref_sync_steps=2)
    tr = GRPOTrainer(CausalLM.from_config(CFG, seed=0), TrainerConfig(lr=5e-2, loss=loss, lora=lc))
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    tr.step(make_groups(tr.model, seed=0), trainer_version=0)
    with torch.no_grad(), lora.as_reference(tr.model):
        base = tr.model(ids)
    assert tr.reference_state() is None and not torch.equal(base, tr.model(ids).detach())
    tr.step(make_groups(tr.model, seed=1), trainer_version=1)
    with torch.no_grad():
        policy = tr.model(ids)
        with lora.as_reference(tr.model):
            assert torch.equal(tr.model(ids), policy)
    state = tr.reference_state()
    assert state and all(k.endswith((".ref_A", ".ref_B")) for k in state)
    assert tr.step(make_groups(tr.model, seed=2), trainer_version=2)["kl"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_checkpoint_keeps_the_moved_reference_and_a_resume_takes_it_back(tmp_path, kind):
    from tailrace.runtime.checkpoint import REFERENCE, load_trainer, save_trainer

    def trainer():
        if kind == "full":
            return _full(every=1, alpha=0.5)
        loss = LossConfig(kl_coef=0.1, ref_sync_steps=1)
        return GRPOTrainer(
            CausalLM.from_config(CFG, seed=0),
            TrainerConfig(lr=5e-2, loss=loss, lora=LoraConfig(rank=4, alpha=8.0)),
        )

    tr = trainer()
    tr.step(make_groups(tr.model, seed=0), trainer_version=0)
    src = tmp_path / "src"
    src.mkdir()
    save_trainer(tr, src, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / REFERENCE).is_file()
    again = trainer()
    again.model.load_state_dict(tr.model.state_dict())  # as build_trainer loads the checkpoint's policy
    load_trainer(again, tmp_path / "ckpt")
    want, got = tr.reference_state(), again.reference_state()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    groups = make_groups(tr.model, seed=1)
    assert tr.step(groups, 1)["kl"] == again.step(groups, 1)["kl"]


@pytest.mark.parametrize(
    "loss, rank, match",
    [
        (dict(ref_sync_steps=10), 0, "with train.loss.kl_coef=0"),
        (dict(kl_coef=0.1, ref_sync_steps=-1), 0, "ref_sync_steps=-1: must be >= 0"),
        (dict(kl_coef=0.1, ref_sync_steps=5, ref_sync_alpha=0.0), 0, "must lie in \\(0, 1\\]"),
        (dict(kl_coef=0.1, ref_sync_steps=5, ref_sync_alpha=0.6), 8, "a mix of two adapters"),
    ],
)
def test_settings_it_refuses(loss, rank, match):
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(loss=LossConfig(**loss), lora=LoraConfig(rank=rank))
    if rank:  # a reset is a LoRA run's to take
        TrainerConfig(loss=LossConfig(**{**loss, "ref_sync_alpha": 1.0}), lora=LoraConfig(rank=rank))
