"""A step of several optimizer updates (train.mini_batches, train.epochs): PPO's loop, checked against the
same loop written out by hand with the trainer's own pieces."""

import copy
import dataclasses
import math

import pytest
import torch

from tailrace.config import ConfigError, LossConfig, TrainerConfig, load_config
from tailrace.trainer.advantages import ADVANTAGES
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.grpo import GRPOTrainer, NonFiniteError, mini_batches
from tailrace.trainer.logprobs import entropy_from_logits, token_logprobs
from tailrace.trainer.losses import CORRECTIONS, LOSSES, Bounds
from tests.trainer.test_grpo import TinyLM, equal_rewards, make_groups


def test_groups_split_in_order_into_runs_differing_by_one_at_most():
    assert mini_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert mini_batches(list(range(4)), 1) == [[0, 1, 2, 3]]
    assert mini_batches(list(range(2)), 4) == [[0], [1]]  # no more runs than groups
    assert mini_batches(list(range(6)), 6) == [[i] for i in range(6)]


def by_hand(model, parts, epochs, correction, lr, clip, advantage="grpo"):
    """PPO's loop over mini-batches `parts` (lists of groups): the advantages over all of them, the
    pre-update logprobs of every part, then `epochs` passes, one AdamW update a part, each part its own
    loss normaliser."""
    loss = LOSSES["grpo"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    advs = iter(ADVANTAGES[advantage]([[t.reward for t in g.trajectories] for p in parts for g in p]))
    parts = [[dataclasses.replace(g, advantages=tuple(next(advs))) for g in p] for p in parts]
    batches = [TrainBatch.from_groups(p, trainer_version=0, token_scale=loss.token_scale) for p in parts]
    with torch.no_grad():
        prox = [token_logprobs(model(b.input_ids), b.targets) for b in batches]
    bounds = Bounds(2.0, 0.5, 2.0)
    for _ in range(epochs):
        for b, px in zip(batches, prox):
            opt.zero_grad()
            logp = token_logprobs(model(b.input_ids), b.targets)
            corr = CORRECTIONS[correction](b.behav_logp, px, b.mask, bounds)
            pg, _ = loss(
                logp, corr.old_logp, b.adv, b.mask, corr.weight, eps_low=None, eps_high=None, scale=b.scale
            )
            pg.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            opt.step()


@pytest.mark.parametrize(
    "correction,advantage", [("none", "grpo"), ("behaviour", "grpo"), ("none", "batch_std")]
)
@pytest.mark.parametrize(
    "k,epochs,cut",
    [(2, 1, [0, 2, 4]), (1, 2, [0, 4]), (3, 2, [0, 2, 3, 4])],  # cut: where the hand's parts begin and end
)
def test_a_step_of_several_updates_is_ppos_loop(k, epochs, cut, correction, advantage):
    """(batch_std scales by the step's rewards, not a mini-batch's.)"""
    base = TinyLM()
    groups = make_groups(base, noise=0.3, n_groups=4)  # behaviour != current: the two anchors differ
    groups = [dataclasses.replace(g, trajectories=scaled(g, 1 + g.id)) for g in groups]  # spreads differ
    cfg = TrainerConfig(
        lr=1e-1,
        mini_batches=k,
        epochs=epochs,
        grad_clip=0.5,
        loss=LossConfig(correction=correction),
        advantage=advantage,
    )
    tr = GRPOTrainer(copy.deepcopy(base), cfg)
    m = tr.step(groups, trainer_version=0)
    hand = copy.deepcopy(base)
    by_hand(hand, [groups[a:b] for a, b in zip(cut, cut[1:])], epochs, correction, 1e-1, 0.5, advantage)
    for (n, p), q in zip(tr.model.named_parameters(), hand.parameters()):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=0, msg=n)
    assert m["updates"] == (len(cut) - 1) * epochs and tr.steps == 1
    assert m["clip_frac"] > 0  # the later updates' ratios leave the clip range: the test exercises it


def scaled(g, by):
    return tuple(dataclasses.replace(t, reward=t.reward * by) for t in g.trajectories)


def test_the_first_update_is_on_policy_and_each_token_counts_once():
    base = TinyLM()
    groups = make_groups(base, n_groups=4)  # behaviour = current
    one = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-12, mini_batches=2)).step(groups, 0)
    assert one["ratio_max"] == pytest.approx(1.0, abs=1e-6)  # the kept logprobs are the update's own
    single = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-1)).step(groups, 0)
    twice = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-1, epochs=2, mini_batches=2)).step(groups, 0)
    assert twice["tokens"] == single["tokens"] == one["tokens"] > 0
    assert twice["sequences"] == single["sequences"] == 16 and twice["stale_tokens"] == 0
    assert (single["updates"], twice["updates"]) == (1, 4)
    assert twice["ratio_max"] > 1.01 and twice["clip_frac"] > single["clip_frac"] == 0


def test_a_mini_batch_without_reward_signal_takes_no_update():
    base = TinyLM()
    groups = make_groups(base, n_groups=4)
    mixed = equal_rewards(groups[:2]) + groups[2:]
    tr = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-2, mini_batches=2))
    m = tr.step(mixed, 0)
    alone = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-2))
    alone.step(groups[2:], 0)
    assert m["updates"] == 1 and m["skipped"] == 0 and m["sequences"] == 16
    torch.testing.assert_close(tr.flat.buffer, alone.flat.buffer, atol=1e-7, rtol=0)
    m = tr.step(equal_rewards(groups), 0)
    assert (m["updates"], m["skipped"], m["tokens"], tr.steps) == (0, 1, 0, 2)


def test_a_non_finite_later_update_says_which_and_stops_the_step():
    model = TinyLM()
    groups = make_groups(model, n_groups=4)
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, mini_batches=2, micro_batch_tokens=10_000))
    calls = []

    def poison(_m, _i, out):  # forwards 1-2: the kept logprobs; 3: update 1; 4: update 2
        calls.append(1)
        return out * math.nan if len(calls) == 4 else out

    model.register_forward_hook(poison)
    before = tr.flat.buffer.clone()
    with pytest.raises(NonFiniteError, match=r"update 2 of 2 was not applied.*the 1 before it"):
        tr.step(groups, 0)
    assert tr.steps == 0 and not torch.equal(tr.flat.buffer, before)  # update 1 moved the trainer's copy
    assert all(p.grad is None for p in model.parameters())


def test_the_settings_are_checked():
    for bad, msg in [(dict(mini_batches=0), "train.mini_batches=0"), (dict(epochs=0), "train.epochs=0")]:
        with pytest.raises(ConfigError, match=msg):
            TrainerConfig(**bad)
    with pytest.raises(
        ConfigError, match=r"train.mini_batches=17 is more than a step's 16 groups.*16 or less"
    ):
        load_config(overrides=["--train.mini_batches=17"])
    assert load_config(overrides=["--train.mini_batches=16", "--train.epochs=2"]).train.mini_batches == 16


@pytest.mark.parametrize("k", [1, 2])
def test_top_entropy_trains_the_steps_most_uncertain_tokens_alone(k):
    """train.loss.top_entropy=0.25 ("Beyond the 80/20 Rule", TRL's top_entropy_quantile): the step's
    live tokens whose pre-update entropy is in the top quarter, over the whole step whatever its
    mini-batches, keep their share of the loss (the normaliser unchanged); the others none."""
    base = TinyLM()
    groups = make_groups(base, n_groups=4)
    cfg = TrainerConfig(lr=1e-2, mini_batches=k, grad_clip=None, loss=LossConfig(top_entropy=0.25))
    tr = GRPOTrainer(copy.deepcopy(base), cfg)
    m = tr.step(groups, 0)
    # by hand: the entropies of every live token under the step's weights, the top quarter's threshold
    loss = LOSSES["grpo"]
    whole = TrainBatch.from_groups(
        groups, trainer_version=0, token_scale=loss.token_scale, advantage=ADVANTAGES["grpo"]
    )
    with torch.no_grad():
        ent = entropy_from_logits(base(whole.input_ids))
    live = ent[whole.mask > 0]
    thr = torch.quantile(live.double(), 0.75).item()
    assert m["entropy_kept"] == pytest.approx(float((live >= thr).float().mean()), abs=1e-6)
    assert 0.2 < m["entropy_kept"] < 0.3
    hand = copy.deepcopy(base)
    parts = [groups] if k == 1 else [groups[:2], groups[2:]]
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2, weight_decay=0.0)
    batches = [
        TrainBatch.from_groups(
            p, trainer_version=0, token_scale=loss.token_scale, advantage=ADVANTAGES["grpo"]
        )
        for p in parts
    ]
    with torch.no_grad():
        keep = [(entropy_from_logits(base(b.input_ids)) >= thr).float() for b in batches]
        prox = [token_logprobs(base(b.input_ids), b.targets) for b in batches]
    for b, kp, px in zip(batches, keep, prox):
        opt.zero_grad()
        logp = token_logprobs(hand(b.input_ids), b.targets)
        ones = torch.ones_like(logp)
        pg, _ = loss(logp, px, b.adv, b.mask, ones, eps_low=None, eps_high=None, scale=b.scale * kp)
        pg.backward()
        opt.step()
    for p, q in zip(tr.model.parameters(), hand.parameters()):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=0)
    with pytest.raises(ConfigError, match="train.loss.top_entropy=0"):
        LossConfig(top_entropy=0.0)


def test_a_steps_losses_are_the_mean_of_its_updates():
    """loss, pg_loss, kl and the entropy bonus of a step of several updates: each update's (its own
    normaliser's), averaged, so they read as a one-update step's do."""
    base = TinyLM()
    groups = make_groups(base, n_groups=4)
    lc = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    one = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-12, loss=lc), ref_model=TinyLM(seed=1))
    four = GRPOTrainer(
        copy.deepcopy(base), TrainerConfig(lr=1e-12, loss=lc, epochs=4), ref_model=TinyLM(seed=1)
    )
    a, b = one.step(groups, 0), four.step(groups, 0)  # a learning rate that moves nothing: 4 equal passes
    for k in ("loss", "pg_loss", "kl", "entropy_bonus", "entropy", "clip_frac"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-9), k
    assert b["updates"] == 4 and a["kl"] > 0
