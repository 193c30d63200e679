"""GAE, the advantages' whitening and the clipped value loss against values worked out by hand (PPO's
critic: `train.advantage=gae`)."""

import math

import pytest
import torch

from tailrace.trainer.gae import explained_variance, gae, moments, value_loss, whitened

V = torch.tensor([[0.5, 0.2, 0.8]], dtype=torch.float64)
STEPS = torch.tensor([[True, True, True]])


def test_gamma_and_lambda_one_give_the_reward_less_each_value():
    adv, ret = gae(torch.tensor([1.0], dtype=torch.float64), V, STEPS, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=torch.float64))


def test_discounted_and_smoothed_by_hand():
    # r = [0, 0, 1]; d2 = 1 - 0.8 = 0.2; d1 = 0.9 * 0.8 - 0.2 = 0.52; d0 = 0.9 * 0.2 - 0.5 = -0.32
    # A2 = 0.2; A1 = 0.52 + 0.45 * 0.2 = 0.61; A0 = -0.32 + 0.45 * 0.61 = -0.0455
    adv, ret = gae(torch.tensor([1.0], dtype=torch.float64), V, STEPS, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.0455, 0.61, 0.2]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.4545, 0.81, 1.0]], dtype=torch.float64))


def test_positions_the_policy_did_not_sample_are_stepped_over():
    """A prompt, a tool's observation inside the response and the padding after it take no advantage,
    and the recursion runs from each sampled token to the next sampled one, as if they were not there."""
    values = torch.tensor(
        [[7.0, 0.5, 9.0, 0.2, 0.8, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=torch.float64
    )
    steps = torch.tensor([[False, True, False, True, True, False], [False] * 6])
    adv, ret = gae(torch.tensor([1.0, 1.0], dtype=torch.float64), values, steps, gamma=0.9, lam=0.5)
    torch.testing.assert_close(
        adv, torch.tensor([[0, -0.0455, 0, 0.61, 0.2, 0], [0.0] * 6], dtype=torch.float64)
    )
    torch.testing.assert_close(ret, torch.where(steps, adv + values, 0.0))


def test_whitened_over_the_live_tokens_of_every_part():
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    m = moments(x[:1], mask[:1]) + moments(x[1:], mask[1:])  # two shards' sums add up
    torch.testing.assert_close(m, torch.tensor([4.0, 10.0, 30.0], dtype=torch.float64))
    w = whitened(x, mask, m)
    std = math.sqrt(5.0 / 3.0 + 1e-8)  # mean 2.5, unbiased variance 5 / 3 (verl's masked_whiten)
    expect = torch.tensor([[-1.5, -0.5, 0.0], [0.5, 1.5, 0.0]], dtype=torch.float64) / std
    torch.testing.assert_close(w, expect)


def test_value_loss_clipped_around_the_old_values():
    """0.5 max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), token mean: a value moved past the clip
    towards its return is held at the clipped one's loss, its gradient zero."""
    v = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.2, 0.2]], dtype=torch.float64)
    ret = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, st = value_loss(v, old, ret, mask, mask / 2, clip=0.5)
    # token 0: clipped to 0.7, (0.7 - 1)^2 = 0.09 > 0; token 1: inside, (0 - 1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (0.09 + 1.0) / 2, abs=1e-12)
    assert st["vf_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -0.5]], dtype=torch.float64))
    free, st = value_loss(v.detach(), old, ret, mask, mask / 2, clip=None)
    assert free.item() == pytest.approx(0.5 * (0.0 + 1.0) / 2) and st["vf_clip_frac"].item() == 0.0


def test_explained_variance():
    ret = torch.tensor([[1.0, 0.0, 1.0, 0.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)

    def ev(v):
        return explained_variance(moments(ret - v, mask), moments(ret, mask))

    assert ev(ret) == pytest.approx(1.0)
    assert ev(torch.full((1, 5), 0.5, dtype=torch.float64)) == pytest.approx(0.0)
    assert ev(1 - ret) == pytest.approx(-3.0)  # R - v = [1, -1, 1, -1]: variance 1 against 0.25
    assert math.isnan(explained_variance(moments(ret, mask), moments(torch.ones(1, 5), mask)))
