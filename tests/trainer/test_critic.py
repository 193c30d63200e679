"""PPO with a critic (train.advantage=gae): the value model, a step against PPO's loop with GAE written
out by hand with the pure pieces, its state, and the settings it refuses."""

import copy
import dataclasses

import pytest
import torch

from tailrace.config import ConfigError, LossConfig, TrainerConfig, load_config
from tailrace.config.train import CriticConfig, LoraConfig
from tailrace.model import CausalLM, ModelConfig
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.critic import ValueModel
from tailrace.trainer.gae import gae, moments, value_loss, whitened
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.trainer.logprobs import token_logprobs
from tailrace.trainer.losses import LOSSES
from tests.trainer.test_grpo import TinyLM, V, make_groups

CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)  # fmt: skip


def policy() -> CausalLM:
    return CausalLM.from_config(CFG, seed=0)


def test_the_value_model_is_the_policy_s_decoder_with_a_scalar_head():
    model = policy()
    vm = ValueModel(model)
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    assert torch.equal(vm(ids), torch.zeros(1, 5))  # its head starts at zero
    with torch.no_grad():  # the LM head's row k as the value head: the policy's logit of token k
        vm.score.weight.copy_(model.lm_head.weight[3:4])
        torch.testing.assert_close(vm(ids), model(ids)[..., 3])
        vm.model.layers[0].mlp.up_proj.weight.add_(1.0)  # a copy: training it leaves the policy alone
    assert not torch.equal(vm.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def by_hand(model, critic, opt, copt, parts, epochs, clip, c: CriticConfig):
    """A step of PPO's loop with GAE: the critic's values before any update, GAE per row, the advantages
    whitened over the whole step's live tokens, then for each part one policy update and one critic's."""
    pg_loss = LOSSES["grpo"]
    batches = [TrainBatch.from_groups(p, trainer_version=0, token_scale=pg_loss.token_scale,
                                      advantage=lambda gs: [list(r) for r in gs]) for p in parts]  # fmt: skip
    rewards = [torch.tensor([t.reward for g in p for t in g.trajectories]) for p in parts]
    with torch.no_grad():
        prox = [token_logprobs(model(b.input_ids), b.targets) for b in batches]
        old_v = [critic(b.input_ids) for b in batches]
    got = [gae(r, v, b.versions >= 0, c.gamma, c.lam) for r, v, b in zip(rewards, old_v, batches)]
    m = sum(moments(a, b.mask) for (a, _), b in zip(got, batches))
    advs = [whitened(a, b.mask, m) for (a, _), b in zip(got, batches)]
    for _ in range(epochs):
        for b, px, adv, (_, ret), ov in zip(batches, prox, advs, got, old_v):
            opt.zero_grad()
            logp = token_logprobs(model(b.input_ids), b.targets)
            pg, _ = pg_loss(logp, px, adv, b.mask, torch.ones_like(adv), scale=b.scale)
            pg.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            opt.step()
            copt.zero_grad()
            vl, _ = value_loss(critic(b.input_ids), ov, ret, b.mask, b.mask / b.mask.sum(), c.value_clip)
            vl.backward()
            torch.nn.utils.clip_grad_norm_(list(critic.parameters()), clip)
            copt.step()


@pytest.mark.parametrize("k,epochs,cut", [(1, 1, [0, 3]), (2, 2, [0, 2, 3])])
def test_a_step_is_ppo_with_gae_by_hand(k, epochs, cut):
    base = policy()
    groups = make_groups(base, noise=0.3)
    crit = CriticConfig(lr=3e-2, gamma=0.9, lam=0.8, value_clip=0.05)
    cfg = TrainerConfig(lr=1e-2, mini_batches=k, epochs=epochs, grad_clip=0.5, advantage="gae", critic=crit)
    tr = GRPOTrainer(copy.deepcopy(base), cfg)
    for _ in range(2):  # the second step starts from values the first step trained
        m = tr.step(groups, trainer_version=0)
    hand, critic = copy.deepcopy(base), ValueModel(base)
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.0)
    copt = torch.optim.AdamW(critic.parameters(), lr=3e-2, weight_decay=0.0)
    for _ in range(2):
        by_hand(hand, critic, opt, copt, [groups[a:b] for a, b in zip(cut, cut[1:])], epochs, 0.5, crit)
    # to 1% of an update (Adam's first moves are ~lr a weight, and a weight whose gradient is ~0 takes
    # the sign of its rounding: the whitening's sums are added in another order here)
    for (n, p), q in zip(tr.model.named_parameters(), hand.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0, msg=n)
    for (n, p), q in zip(tr.critic.model.named_parameters(), critic.parameters()):
        torch.testing.assert_close(p, q, atol=3e-4, rtol=0, msg=n)
    assert m["updates"] == (len(cut) - 1) * epochs and m["value_loss"] > 0 and m["critic_lr"] == 3e-2
    assert (m["vf_clip_frac"] > 0) == (k * epochs > 1)  # the first update starts at the old values
    assert m["values_mean"] != 0 and m["critic_grad_norm"] > 0 and "adv_mean" not in m


def test_every_group_trains_even_when_its_rewards_are_equal():
    """R - V is never all zero: a group whose samples all scored the same still teaches both models."""
    base = policy()
    groups = [
        dataclasses.replace(g, trajectories=tuple(dataclasses.replace(t, reward=1.0) for t in g.trajectories))
        for g in make_groups(base)
    ]
    tr = GRPOTrainer(base, TrainerConfig(lr=1e-2, advantage="gae"))
    assert tr.critic.lr == pytest.approx(10 * tr.lr)  # verl's ratio when train.critic.lr is null
    first = tr.step(groups, trainer_version=0)
    assert first["skipped"] == 0 and first["values_mean"] == 0.0  # the head starts at zero
    assert tr.step(groups, trainer_version=0)["values_mean"] > 0  # and moves towards the returns


@pytest.mark.parametrize("k", [1, 2])
def test_the_critic_warms_up_alone_then_the_policy_starts_its_schedule(k):
    """train.critic.warmup_steps=2: two steps move the critic and leave the policy's weights as they
    were, bit for bit (no pass of its own: no update, no proximal forward); the third moves both, the
    policy at its schedule's first rate (lr / 4 of a 4-step warmup), the critic at its third."""
    base = policy()
    start = {k_: p.detach().clone() for k_, p in base.named_parameters()}
    cfg = TrainerConfig(lr=1e-2, advantage="gae", lr_warmup_steps=4, mini_batches=k,
                        critic=CriticConfig(warmup_steps=2))  # fmt: skip
    tr = GRPOTrainer(base, cfg, total_steps=10)
    values = []
    for s in range(2):
        m = tr.step(make_groups(base, seed=s, n_groups=4), trainer_version=s)
        assert (m["critic_warmup"], m["updates"], m["skipped"], m["micro_batches"]) == (1, 0, 0, 0)
        assert m["value_loss"] > 0 and m["tokens"] > 0 and m["loss"] == 0.0
        assert all(torch.equal(p, start[k_]) for k_, p in base.named_parameters())
        assert tr.critic.opt.param_groups[0]["lr"] == pytest.approx(tr.critic.lr * (s + 1) / 4)
        values.append(m["values_mean"])
    assert values[0] == 0.0 != values[1]  # the critic learned
    m = tr.step(make_groups(base, seed=2, n_groups=4), trainer_version=2)
    assert "critic_warmup" not in m and m["updates"] == k and m["lr"] == pytest.approx(1e-2 / 4)
    assert tr.critic.opt.param_groups[0]["lr"] == pytest.approx(tr.critic.lr * 3 / 4)
    assert not all(torch.equal(p, start[k_]) for k_, p in base.named_parameters())


def test_state_round_trips_and_a_restored_trainer_takes_the_same_step():
    base = policy()
    groups = make_groups(base, noise=0.3)
    cfg = TrainerConfig(lr=1e-2, advantage="gae")
    a = GRPOTrainer(copy.deepcopy(base), cfg)
    a.step(groups, trainer_version=0)
    b = GRPOTrainer(copy.deepcopy(base), cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    ma, mb = a.step(groups, trainer_version=1), b.step(groups, trainer_version=1)
    assert ma["value_loss"] == mb["value_loss"]
    for p, q in zip(a.critic.model.parameters(), b.critic.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_lora_run_s_critic_is_an_adapter_of_its_own_on_the_shared_frozen_base(bf16):
    """No copy of the base: the critic's frozen tensors are the policy's (kept in bf16 with train.bf16,
    once); what trains, and what its state holds, is its adapter and head alone."""
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "up_proj"))
    model = policy().to(torch.bfloat16).float() if bf16 else policy()  # bf16 keeps a base bf16 holds exactly
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, advantage="gae", lora=lora, bf16=bf16))
    mine, theirs = tr.critic.model.model.layers[0], model.model.layers[0]
    assert mine.self_attn.q_proj.weight is theirs.self_attn.q_proj.weight  # the same tensor
    assert mine.self_attn.q_proj.weight.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert mine.self_attn.k_proj.weight is theirs.self_attn.k_proj.weight
    assert mine.self_attn.q_proj.lora_A.weight is not theirs.self_attn.q_proj.lora_A.weight
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    own = {n: p.detach().clone() for n, p in tr.critic.model.named_parameters() if p.requires_grad}
    assert sorted(own) == sorted(tr.critic.state_dict()["model"])
    assert len(own) == 2 * 2 * 2 + 2  # A and B of 2 targets x 2 layers, and the head's weight and bias
    groups = make_groups(model, noise=0.3)
    for _ in range(2):
        m = tr.step(groups, trainer_version=0)
    assert m["values_mean"] != 0 and m["value_loss"] > 0
    for n, p in model.named_parameters():  # the base is untouched by either model's updates
        if n in base:
            assert torch.equal(p, base[n]), n
    moved = [
        n for n, p in tr.critic.model.named_parameters() if p.requires_grad and not torch.equal(p, own[n])
    ]
    assert "score.weight" in moved and any("lora_B" in n for n in moved)  # (A follows once B is off 0)
    b = GRPOTrainer(policy(), TrainerConfig(lr=1e-2, advantage="gae", lora=lora, bf16=bf16))
    b.critic.load_state_dict(tr.critic.state_dict())
    for n, p in b.critic.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, dict(tr.critic.model.named_parameters())[n]), n


def test_what_gae_refuses():
    with pytest.raises(ConfigError, match="train.critic.warmup_steps=-1: must be >= 0"):
        CriticConfig(warmup_steps=-1)
    with pytest.raises(ConfigError, match="warmup_steps=8 is not under flow.steps=8: the policy would never"):
        load_config(None, ["--train.advantage=gae", "--train.critic.warmup_steps=8", "--flow.steps=8"])
    with pytest.raises(ConfigError, match="train.critic.warmup_steps set with train.advantage=null"):
        load_config(None, ["--train.critic.warmup_steps=2"])
    with pytest.raises(ConfigError, match="train.advantage=gae with train.external"):
        TrainerConfig(advantage="gae", external=True)
    with pytest.raises(ConfigError, match="train.critic.lam=1.5"):
        CriticConfig(lam=1.5)
    with pytest.raises(
        ConfigError, match="train.critic.lr set with train.advantage=null: the critic trains only"
    ):
        load_config(None, ["--train.critic.lr=1e-5"])
    with pytest.raises(ConfigError, match="set flow.zero_signal=train"):
        load_config(None, ["--train.advantage=gae", "--flow.samples_per_prompt=1", "--flow.train_batch=16",
                           "--flow.prompts_per_round=16"])  # fmt: skip
    with pytest.raises(ConfigError, match="needs a tailrace decoder"):
        GRPOTrainer(TinyLM(), TrainerConfig(advantage="gae", loss=LossConfig()))


def test_evaluate_takes_the_critic_s_advantages_and_moves_nothing():
    base = policy()
    groups = make_groups(base, noise=0.3)
    tr = GRPOTrainer(base, TrainerConfig(lr=1e-2, advantage="gae"))
    tr.step(groups, trainer_version=0)  # values off zero
    before = [p.detach().clone() for p in (*tr.model.parameters(), *tr.critic.model.parameters())]
    m = tr.evaluate(groups, trainer_version=1)
    after = [*tr.model.parameters(), *tr.critic.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    batch = tr.make_batch(groups, 1)  # its advantages are GAE's, whitened: mean 0 over the live tokens
    (got,), _ = tr.critic.prepare([batch], [float(batch.mask.sum())], tr.micro.tokens, tr._autocast, 1)
    assert abs(float(got.adv.sum())) < 1e-4
    # on policy every ratio is 1: the loss is -sum(scale * A), with the critic's A (not the rewards)
    assert m["pg_loss"] == pytest.approx(-float((got.scale * got.adv).sum()), abs=1e-6)
