"""Loss variants, KL, corrections and the staleness mask against numbers worked out by hand.

The shared case: 2 sequences x 3 tokens, ratios r = exp(logp - old_logp)
    seq 0: r = [1.5, 1.25, 0.9], A = +1, all 3 tokens live
    seq 1: r = [0.5, 1.1, 10.0], A = -1, last token is padding (its wild ratio must not count)
With eps = 0.2 tokens (0,0) and (0,1) are clipped above (A > 0) and (1,0) below (A < 0).
"""

import math

import pytest
import torch

from tailrace.config import ConfigError, LossConfig
from tailrace.trainer.losses import (
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSSES,
    Bounds,
    fresh_mask,
    k3,
    kl_penalty,
    seq_mean_scale,
)

R = [[1.5, 1.25, 0.9], [0.5, 1.1, 10.0]]
OLD = torch.full((2, 3), -1.0, dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ONES = torch.ones(2, 3, dtype=torch.float64)


def _logp():
    return (torch.tensor(R, dtype=torch.float64).log() + OLD).requires_grad_(True)


def test_grpo_seq_mean_then_batch_mean():
    logp = _logp()
    loss, st = LOSSES["grpo"](logp, OLD, ADV, MASK, ONES)
    # per-token -min(rA, clip(r)A): seq0 [-1.2, -1.2, -0.9] -> mean -1.1; seq1 [0.8, 1.1] -> mean 0.95
    assert loss.item() == pytest.approx((-1.1 + 0.95) / 2, abs=1e-12)
    assert st["clip_frac"].item() == pytest.approx(3 / 5)
    assert st["ratio_mean"].item() == pytest.approx((1.5 + 1.25 + 0.9 + 0.5 + 1.1) / 5)
    assert st["ratio_max"].item() == pytest.approx(1.5)
    kl = sum(r - 1 - math.log(r) for r in [1.5, 1.25, 0.9, 0.5, 1.1]) / 5
    assert st["approx_kl"].item() == pytest.approx(kl)
    assert st["tokens"].item() == 5
    loss.backward()
    # clipped and padded tokens get no gradient; (0,2): -r*A/(3*2) = -0.15; (1,1): +r/(2*2) = 0.275
    expect = torch.tensor([[0.0, 0.0, -0.15], [0.0, 0.275, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expect, atol=1e-12, rtol=0)


def test_dapo_clip_higher_token_mean():
    loss, st = LOSSES["dapo"](_logp(), OLD, ADV, MASK, ONES)
    # eps_high 0.28: seq0 [-1.28, -1.25, -0.9], seq1 [0.8, 1.1]; mean over 5 tokens
    assert loss.item() == pytest.approx((-1.28 - 1.25 - 0.9 + 0.8 + 1.1) / 5, abs=1e-12)
    assert loss.item() == pytest.approx(-0.306, abs=1e-12)
    assert st["clip_frac"].item() == pytest.approx(2 / 5)  # 1.25 is inside the raised ceiling


def test_drgrpo_constant_normaliser():
    loss, st = LOSSES["drgrpo"](_logp(), OLD, ADV, MASK, ONES, max_new_tokens=4)
    # (sum of per-token terms) / (max_new_tokens 4 * 2 sequences)
    assert loss.item() == pytest.approx((-1.2 - 1.2 - 0.9 + 0.8 + 1.1) / 8, abs=1e-12)
    assert st["clip_frac"].item() == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        LOSSES["drgrpo"](_logp(), OLD, ADV, MASK, ONES)


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    """GSPO: one ratio a sequence, s = exp(mean of its live tokens' log r): s0 = 1.6875^(1/3) = 1.1906,
    s1 = 0.55^(1/2) = 0.7416 (the padding's 10.0 left out). At its own range (1 - 3e-4, 1 + 4e-4) both are
    clipped in their advantage's direction: seq0 -1.0004 a token, seq1 +0.9997, and no gradient flows."""
    logp = _logp()
    loss, st = LOSSES["gspo"](logp, OLD, ADV, MASK, ONES)
    assert loss.item() == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-12)
    assert st["clip_frac"].item() == 1.0
    s0, s1 = 1.6875 ** (1 / 3), 0.55**0.5
    assert st["ratio_mean"].item() == pytest.approx((3 * s0 + 2 * s1) / 5)
    assert st["ratio_max"].item() == pytest.approx(s0)
    loss.backward()
    assert not logp.grad.any()


def test_gspo_unclipped_gradient_is_the_sequence_ratio_on_every_token():
    """Inside a wide range every token of sequence i gets d/d logp = -A_i * s_i / (|y_i| * sequences):
    the sequence's ratio, not its own token's (GRPO's (0, 0) would take 1.5, GSPO takes s0 = 1.1906)."""
    logp = _logp()
    loss, st = LOSSES["gspo"](logp, OLD, ADV, MASK, ONES, eps_low=0.6, eps_high=1.0)
    s0, s1 = 1.6875 ** (1 / 3), 0.55**0.5
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    assert st["clip_frac"].item() == 0.0
    loss.backward()
    expect = torch.tensor([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expect, atol=1e-12, rtol=0)


def test_cispo_clips_the_weight_not_the_gradient():
    """CISPO: every live token's gradient is -sg(clip(r, 1 - eps_low, 1 + eps_high)) x A / tokens, its
    own ratio's weight capped above at 1.28 (no lower bound: eps_low 1), where PPO zeroes a clipped token.
    Token mean over the 5 live tokens: weights [1.28, 1.25, 0.9] (A = +1), [0.5, 1.1] (A = -1)."""
    logp = _logp()
    loss, st = LOSSES["cispo"](logp, OLD, ADV, MASK, ONES)
    assert loss.item() == pytest.approx((-1.28 - 1.25 - 0.9 + 0.5 + 1.1) / 5, abs=1e-12)
    assert st["clip_frac"].item() == pytest.approx(1 / 5)  # 1.5 capped; 0.5 is above the bound of 0
    loss.backward()
    expect = torch.tensor([[-1.28, -1.25, -0.9], [0.5, 1.1, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(logp.grad, expect, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name, same", [("gspo", "grpo"), ("cispo", "dapo")])
def test_a_variant_off_policy_only_is_its_twin_on_policy(name, same):
    """With the anchor at the current weights (ratio 1 everywhere) GSPO's loss and gradient are GRPO's and
    CISPO's are DAPO's: the sequence ratio and the capped weight only matter off-policy (a stale or
    engine-sampled sequence)."""
    torch.manual_seed(0)
    adv, mask = torch.randn(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    mask[2, 3] = 0.0
    out = {}
    for variant in (name, same):
        logp = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        logp.requires_grad_(True)
        loss, _ = LOSSES[variant](logp, logp.detach(), adv, mask, torch.ones_like(mask))
        loss.backward()
        out[variant] = (loss.item(), logp.grad)
    assert out[name][0] == pytest.approx(out[same][0], abs=1e-12)
    torch.testing.assert_close(out[name][1], out[same][1], atol=1e-12, rtol=0)


def test_weight_scales_tokens_and_explicit_scale_matches():
    w = ONES.clone()
    w[0, 0] = 2.0
    loss, _ = LOSSES["grpo"](_logp(), OLD, ADV, MASK, w)
    assert loss.item() == pytest.approx(((-2.4 - 1.2 - 0.9) / 3 + 0.95) / 2, abs=1e-12)
    loss2, _ = LOSSES["grpo"](_logp(), OLD, ADV, MASK, w, scale=seq_mean_scale(MASK))
    assert loss2.item() == loss.item()


# dual clip: seq 0 A = +1, r = [4, 1, 0.5]; seq 1 A = -1, r = [4, 2, 0.5]; every token live
DUAL_R = [[4.0, 1.0, 0.5], [4.0, 2.0, 0.5]]
DUAL_OLD = torch.zeros(2, 3, dtype=torch.float64)


def _dual_logp():
    return torch.tensor(DUAL_R, dtype=torch.float64).log().requires_grad_(True)


def test_dual_clip_caps_a_negative_advantage_s_loss_at_c_times_its_size():
    """verl's clip_ratio_c: where A < 0 the per-token loss -A max(r, clip(r)) stops at -A c, so a token
    the policy has made far likelier than the sampler did (r > c) pushes it down no further."""
    mask = torch.ones(2, 3, dtype=torch.float64)
    plain, st0 = LOSSES["grpo"](_dual_logp(), DUAL_OLD, ADV, mask, mask)
    # seq 0: [-1.2, -1, -0.5] mean -0.9; seq 1: [4, 2, 0.8] mean 6.8/3
    assert plain.item() == pytest.approx((-0.9 + 6.8 / 3) / 2, abs=1e-12)
    assert st0["dual_clip_frac"].item() == 0.0
    logp = _dual_logp()
    loss, st = LOSSES["grpo"](logp, DUAL_OLD, ADV, mask, mask, clip_c=3.0)
    assert loss.item() == pytest.approx((-0.9 + 5.8 / 3) / 2, abs=1e-12)  # seq 1's 4 capped at 3
    assert st["dual_clip_frac"].item() == pytest.approx(1 / 6)
    assert st["clip_frac"].item() == st0["clip_frac"].item() == pytest.approx(2 / 6)  # PPO's own, apart
    loss.backward()
    # scale 1/6 a token; the capped token and the clipped ones get none; (1,1): -A r / 6 = 2/6
    expect = torch.tensor([[0.0, -1 / 6, -0.5 / 6], [0.0, 2 / 6, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expect, atol=1e-12, rtol=0)


def test_dual_clip_above_every_ratio_changes_nothing():
    mask = torch.ones(2, 3, dtype=torch.float64)
    for name in ("grpo", "dapo", "gspo"):
        plain, _ = LOSSES[name](_dual_logp(), DUAL_OLD, ADV, mask, mask)
        wide, st = LOSSES[name](_dual_logp(), DUAL_OLD, ADV, mask, mask, clip_c=5.0)
        assert wide.item() == plain.item() and st["dual_clip_frac"].item() == 0.0


def test_custom_clip_range_overrides_default():
    loss, st = LOSSES["grpo"](_logp(), OLD, ADV, MASK, ONES, eps_low=0.6, eps_high=1.0)
    # nothing clipped: seq0 [-1.5, -1.25, -0.9] mean -3.65/3; seq1 [0.5, 1.1] mean 0.8
    assert loss.item() == pytest.approx((-3.65 / 3 + 0.8) / 2, abs=1e-12)
    assert st["clip_frac"].item() == 0.0


def test_k3_values_and_aggregation():
    logp = torch.zeros(1, 3, dtype=torch.float64)
    ref = torch.tensor([[math.log(2), 0.0, -math.log(2)]], dtype=torch.float64)
    # e^d - d - 1: d=ln2 -> 1 - ln2; d=0 -> 0; d=-ln2 -> ln2 - 1/2
    expect = [1 - math.log(2), 0.0, math.log(2) - 0.5]
    assert k3(logp, ref)[0].tolist() == pytest.approx(expect, abs=1e-12)
    mask = torch.ones(1, 3, dtype=torch.float64)
    assert kl_penalty(logp, ref, mask, seq_mean_scale(mask)).item() == pytest.approx(0.5 / 3, abs=1e-12)


def test_the_kl_estimators_values_and_their_gradients_on_policy():
    """k1 = logp - ref (verl's kl), k2 = (logp - ref)^2 / 2 (mse), k3 (low_var_kl, the default). Their
    per-token gradients in logp: 1; logp - ref; 1 - exp(ref - logp)."""
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(2), 0.0, -math.log(2)]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    d = [-math.log(2), 0.0, math.log(2)]  # logp - ref
    for kind, value, grad in [
        ("k1", d, [1.0, 1.0, 1.0]),
        ("k2", [x * x / 2 for x in d], d),
        ("k3", [1 - math.log(2), 0.0, math.log(2) - 0.5], [1 - 2.0, 0.0, 1 - 0.5]),
    ]:
        assert KL_ESTIMATORS[kind](logp, ref)[0].tolist() == pytest.approx(value, abs=1e-12), kind
        (g,) = torch.autograd.grad(kl_penalty(logp, ref, mask, mask, kind), logp)
        assert g[0].tolist() == pytest.approx(grad, abs=1e-12), kind


BEHAV = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
PROX = BEHAV + torch.tensor(
    [[math.log(0.5), 0.0, math.log(3.0)]], dtype=torch.float64
)  # pi_prox/pi_behav = .5, 1, 3


@pytest.mark.parametrize(
    "name, anchor, weight, keep",
    [
        ("none", PROX, [1, 1, 1], [1, 1, 1]),
        ("tis", PROX, [0.5, 1, 2], [1, 1, 1]),  # min(w, C=2)
        ("decoupled", PROX, [0.5, 1, 0], [1, 1, 0]),  # w=3 > C dropped
        ("icepop", PROX, [0, 1, 0], [0, 1, 0]),  # [0.6, 2.5]: w=.5 below, w=3 above, masked both
        ("behaviour", BEHAV, [1, 1, 1], [1, 1, 1]),
    ],
)
def test_corrections(name, anchor, weight, keep):
    c = CORRECTIONS[name](BEHAV, PROX, torch.ones_like(PROX), Bounds(cap=2.0, low=0.6, high=2.5))
    torch.testing.assert_close(c.old_logp, anchor)
    assert c.weight[0].tolist() == pytest.approx(weight, abs=1e-12)
    assert c.keep[0].tolist() == keep


def test_icepop_keeps_the_band_and_weights_by_the_ratio():
    c = CORRECTIONS["icepop"](BEHAV, PROX, torch.ones_like(PROX), Bounds(cap=2.0, low=0.49, high=3.01))
    assert c.weight[0].tolist() == pytest.approx([0.5, 1, 3], abs=1e-12) and c.keep[0].tolist() == [1, 1, 1]


def test_geo_mask_masks_whole_sequences_by_their_geometric_mean_ratio():
    # seq 0: w = .5, 1, 3 over its 3 live tokens -> geo mean (1.5)^(1/3) = 1.145: kept
    # seq 1: w = 4, 4 over 2 live tokens (the 3rd, w = 1e6, is padding and must not count) -> 4: masked
    behav = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -2.0, -20.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, 1.0, 3.0], [4.0, 4.0, 1e6]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    c = CORRECTIONS["geo_mask"](behav, behav + w.log(), mask, Bounds(cap=2.0, low=0.5, high=2.0))
    assert c.keep.tolist() == [[1, 1, 1], [0, 0, 0]] and c.weight.tolist() == c.keep.tolist()
    torch.testing.assert_close(c.old_logp, behav + w.log())
    # a sequence below the band is masked too: geo mean of (0.2, 0.4) = 0.283 < 0.5
    low = torch.tensor([[0.2, 0.4, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    c = CORRECTIONS["geo_mask"](BEHAV, BEHAV + low.log(), m, Bounds(cap=2.0, low=0.5, high=2.0))
    assert c.keep.tolist() == [[0, 0, 0]]


def test_staleness_mask():
    v = torch.tensor([[3, 3, 4, 5], [5, 5, -1, -1]])
    assert fresh_mask(v, 5, 1).tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]
    assert fresh_mask(v, 5, 0).tolist() == [[0, 0, 0, 1], [1, 1, 0, 0]]
    assert fresh_mask(v, 5, None).tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_loss_config_leaves_defaults_to_the_registry():
    """None in the config means the variant's own clip range, which lives in its LOSSES entry."""
    assert (LossConfig("dapo").eps_low, LossConfig("dapo").eps_high) == (None, None)
    assert (LOSSES["dapo"].eps_low, LOSSES["dapo"].eps_high) == (0.2, 0.28)
    assert (LOSSES["gspo"].eps_low, LOSSES["gspo"].eps_high) == (3e-4, 4e-4)  # the GSPO paper's
    assert (LOSSES["cispo"].eps_low, LOSSES["cispo"].eps_high) == (1.0, 0.28)  # no lower bound
    assert LossConfig("cispo", eps_low=1.0).eps_low == 1.0
    assert LossConfig("dapo", eps_high=0.3).eps_high == 0.3
    torch.manual_seed(0)
    logp, old, adv = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask, weight = torch.ones(2, 5), torch.ones(2, 5)
    default, _ = LOSSES["dapo"](logp, old, adv, mask, weight, eps_low=None, eps_high=None)
    explicit, _ = LOSSES["dapo"](logp, old, adv, mask, weight, eps_low=0.2, eps_high=0.28)
    assert default == explicit
    grpo_clip, _ = LOSSES["dapo"](logp, old, adv, mask, weight, eps_low=0.2, eps_high=0.2)
    assert default != grpo_clip


def test_loss_config_messages():
    with pytest.raises(ConfigError, match="train.loss.max_new_tokens"):
        LossConfig("drgrpo")
    with pytest.raises(ConfigError, match="train.loss.eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ConfigError, match="train.loss.tis_cap"):
        LossConfig(tis_cap=0.5)
    with pytest.raises(ConfigError, match=r"train.loss.clip_c=1.0: must be > 1.*e.g. 3"):
        LossConfig(clip_c=1.0)
    with pytest.raises(ConfigError, match="train.loss.clip_c=3.0 does not apply to cispo"):
        LossConfig("cispo", clip_c=3.0)
