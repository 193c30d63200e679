"""The clipped policy-gradient objective: variants, KL penalty, off-policy corrections, staleness mask.

All tensors are (B, T) and aligned with the batch's targets; `mask` is float (1 = a live response
token). Every function here is pure. Variants are data picked once by name:

- `LOSSES`: how the clipped per-token terms are aggregated, whether the ratio is each token's or its
  sequence's (GSPO), and the default clip range;
- `CORRECTIONS`: how the ratio anchor `old_logp` and the per-token weight come from the engine's
  behaviour logprobs `behav` and the trainer's pre-update logprobs `prox`.

Aggregation is a per-token coefficient `scale` with loss = sum(scale * per_token_loss). Computing it
once on the whole step's batch and slicing it per micro-batch is what makes gradient accumulation
exactly equal to one big batch in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

Tensor = torch.Tensor
TokenScale = Callable[..., Tensor]  # (mask, max_new_tokens) -> scale


# -- aggregation: mask (B, T) -> scale (B, T), zero off the mask -----------------------------


def _live_seqs(mask: Tensor) -> Tensor:
    return (
        (mask.sum(-1) > 0).sum().clamp(min=1)
    )  # sequences with a live token; a fully masked one adds nothing


def seq_mean_scale(mask: Tensor, max_new_tokens: int | None = None) -> Tensor:
    """Mean over each sequence's tokens, then mean over sequences (GRPO)."""
    n = mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return mask / (n * _live_seqs(mask))


def token_mean_scale(mask: Tensor, max_new_tokens: int | None = None) -> Tensor:
    """Mean over all tokens of the batch (DAPO): long responses weigh in proportion to their length."""
    return mask / mask.sum().clamp(min=1)


def const_scale(mask: Tensor, max_new_tokens: int | None = None) -> Tensor:
    """Sum over tokens / (max_new_tokens * sequences) (Dr. GRPO): a normaliser free of response lengths."""
    if not max_new_tokens:
        raise ValueError(
            "the drgrpo aggregation needs max_new_tokens (the rollout's); set loss.max_new_tokens"
        )
    return mask / (max_new_tokens * _live_seqs(mask))


# -- the clipped surrogate -------------------------------------------------------------------


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log r per token, r = pi / pi_old (PPO, GRPO, DAPO); 0 off the mask, so padding never reaches exp()."""
    return torch.where(mask > 0, logp - old_logp, 0.0)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO(-token): every live token of sequence i takes log s_i, the mean of its live tokens' log r
    (s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)), as its value, and its own log-probability's gradient
    (sg[log s_i] + logp - sg[logp]), so a token's gradient is A_i * s_i * d logp: one ratio and one
    clipping decision a sequence. With every token of a sequence at the same advantage this is GSPO's
    gradient exactly (Zheng et al. 2025, eqs. 11 and 18)."""
    live = mask > 0
    per_token = torch.where(live, logp - old_logp, 0.0)
    seq = per_token.sum(-1, keepdim=True) / live.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(live, seq.detach() + logp - logp.detach(), 0.0)


def clipped_pg(
    log_ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    weight: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
    clip_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum(scale * weight * -min(r A, clip(r, 1-eps_low, 1+eps_high) A)), r = exp(log_ratio), which is 0
    off the mask. With `clip_c` (dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c, its default 3) a
    token whose A < 0 loses at most -A clip_c: where the policy has made a bad token far likelier than
    the sampler did (r > clip_c, off policy) it pushes it down no further, its gradient zero.

    Returns (loss, stats); stats are detached 0-d tensors over live tokens: clip_frac (the clipped
    term was chosen, so the token's gradient is zero), dual_clip_frac (the cap at -A clip_c was),
    approx_kl (k3 estimate of KL(old || new), of the ratio the loss clips: a sequence's under GSPO),
    ratio_mean, ratio_max, tokens.
    """
    live = mask > 0
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_tok = -torch.minimum(unclipped, clipped)
    if clip_c is not None:
        per_tok = torch.where(adv < 0, torch.minimum(per_tok, -clip_c * adv), per_tok)
    loss = torch.where(live, per_tok * weight * scale, 0.0).sum()
    with torch.no_grad():
        hit = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
        dual = (adv < 0) & (ratio > clip_c) & live if clip_c is not None else torch.zeros_like(live)
        stats = _stats(log_ratio.detach(), live, hit)
        return loss, {**stats, "dual_clip_frac": dual.sum() / live.sum().clamp(min=1)}


def _stats(log_ratio: Tensor, live: Tensor, hit: Tensor) -> dict[str, Tensor]:
    """The objectives' stats over live tokens: clip_frac (the `hit` share), approx_kl, ratio_mean,
    ratio_max, tokens."""
    ratio = log_ratio.exp()
    n = live.sum()
    denom = n.clamp(min=1)
    return {
        "clip_frac": (hit & live).sum() / denom,
        "approx_kl": torch.where(live, ratio - 1.0 - log_ratio, 0.0).sum() / denom,
        "ratio_mean": torch.where(live, ratio, 0.0).sum() / denom,
        "ratio_max": torch.where(live, ratio, 0.0).max(),
        "tokens": n.to(ratio.dtype),
    }


def cispo_pg(
    log_ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    weight: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): sum(scale * weight * -sg(clip(r, 1-eps_low, 1+eps_high)) * A * r / sg(r)). The
    importance weight is capped, not the update: every token keeps a gradient, -clip(r) A d logp, where
    PPO's min zeroes a clipped one (the rare tokens a policy most needs to raise, its paper argues).
    Stats as `clipped_pg`'s; clip_frac counts the tokens whose weight was capped."""
    live = mask > 0
    r = log_ratio.detach().exp()
    capped = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_tok = -(capped * adv) * (log_ratio - log_ratio.detach()).exp() * weight
    loss = torch.where(live, per_tok * scale, 0.0).sum()
    with torch.no_grad():
        return loss, _stats(log_ratio.detach(), live, (r > 1.0 + eps_high) | (r < 1.0 - eps_low))


@dataclass(frozen=True)
class PGLoss:
    """A clipped policy-gradient variant: its aggregation, default clip range, paired advantage and the
    level of its importance ratio."""

    token_scale: TokenScale
    eps_low: float
    eps_high: float
    advantage: str  # the estimator the variant was published with
    log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor] = token_log_ratio  # (logp, old_logp, mask)
    objective: Callable[..., tuple[Tensor, dict[str, Tensor]]] = (
        clipped_pg  # PPO's min, or CISPO's capped weight
    )

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        weight: Tensor,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        max_new_tokens: int | None = None,
        scale: Tensor | None = None,
        clip_c: float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`scale` = this micro-batch's slice of the whole batch's coefficients; None = this batch is all.
        `clip_c`: dual clip's cap (PPO's min objective only; None = none)."""
        if scale is None:
            scale = self.token_scale(mask, max_new_tokens)
        return self.objective(
            self.log_ratio(logp, old_logp, mask),
            adv,
            mask,
            weight,
            scale,
            self.eps_low if eps_low is None else eps_low,
            self.eps_high if eps_high is None else eps_high,
            **({} if clip_c is None else {"clip_c": clip_c}),
        )


LOSSES: dict[str, PGLoss] = {
    "grpo": PGLoss(seq_mean_scale, 0.2, 0.2, "grpo"),
    "dapo": PGLoss(token_mean_scale, 0.2, 0.28, "grpo"),  # clip-higher keeps low-probability tokens rising
    "drgrpo": PGLoss(const_scale, 0.2, 0.2, "drgrpo"),
    # GSPO (Qwen3's recipe): one ratio a sequence, clipped in a narrow band (its paper's 3e-4 / 4e-4: a
    # geometric mean moves far less than a token's ratio). It differs from grpo only off the current
    # weights, i.e. under a correction that anchors at the rollout's logprobs (`behaviour`, the streaming
    # modes' own) or a round of several steps
    "gspo": PGLoss(seq_mean_scale, 3e-4, 4e-4, "grpo", sequence_log_ratio),
    # CISPO (MiniMax-M1): the importance weight capped above (no lower bound: eps_low 1), never the
    # gradient; token mean. Like gspo it differs from dapo only where the ratio is off 1
    "cispo": PGLoss(token_mean_scale, 1.0, 0.28, "grpo", objective=cispo_pg),
}


# -- KL penalty to a reference policy --------------------------------------------------------


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token: unbiased for KL(new || ref), never negative."""
    d = ref_logp - logp
    return d.exp() - d - 1.0


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp - ref per token (verl's kl): unbiased for KL(new || ref) but often negative; as a loss its
    gradient is logp's own, whatever the reference."""
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """(logp - ref)^2 / 2 per token (verl's mse): biased, never negative; as a loss on the policy's own
    samples its gradient is the reverse KL's."""
    return 0.5 * (logp - ref_logp) ** 2


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}


def aggregated(per_token: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
    """A per-token term over the live tokens, aggregated like the policy loss (the same `scale`): the
    KL penalty, and the entropy bonus (train.loss.entropy_coef, verl's entropy_coeff)."""
    return torch.where(mask > 0, per_token * scale, 0.0).sum()


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, scale: Tensor, kind: str = "k3") -> Tensor:
    """The `kind` estimator (train.loss.kl_type) aggregated like the policy loss."""
    return aggregated(KL_ESTIMATORS[kind](logp, ref_logp), mask, scale)


# -- off-policy corrections: (behav, prox, mask, bounds) -> anchor, weight, keep -------------
#
# behav: the engine's logprobs of the sampled tokens (the behaviour policy, as sampled); prox: the
# trainer's own logprobs before this step's update (the proximal policy, recomputed, as AReaL does);
# w = pi_prox / pi_behav per token, the importance ratio between the two.


@dataclass(frozen=True)
class Bounds:
    cap: float  # C: tis truncates w at C; decoupled drops tokens with w > C
    low: float  # icepop keeps tokens, geo_mask sequences, whose ratio lies in [low, high]
    high: float


class Corrected(NamedTuple):
    old_logp: Tensor  # (B, T) the ratio anchor
    weight: Tensor  # (B, T) per-token weight, detached, already 0 where keep is 0
    keep: Tensor  # (B, T) float 0/1; 0 = the correction drops the token (it still counts in the normaliser)


def no_correction(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    ones = torch.ones_like(prox)
    return Corrected(prox, ones, ones)


def tis(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    """Token-level truncated importance sampling: weight min(w, C)."""
    w = (prox - behav).exp().clamp(max=b.cap)
    return Corrected(prox, w.detach(), torch.ones_like(prox))


def decoupled(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    """AReaL's decoupled PPO: w * clip(pi / pi_prox), pi_prox recomputed by the trainer; tokens with
    w > C dropped."""
    w = (prox - behav).exp()
    keep = w <= b.cap
    return Corrected(prox, torch.where(keep, w, 0.0).detach(), keep.to(prox.dtype))


def icepop(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    """IcePop: tokens whose ratio w lies outside [low, high] are masked (both tails: an engine that
    under- or over-rates a token against the trainer), the rest weighted by w."""
    w = (prox - behav).exp()
    keep = (w >= b.low) & (w <= b.high)
    return Corrected(prox, torch.where(keep, w, 0.0).detach(), keep.to(prox.dtype))


def geo_mask(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    """Sequence-level masking by the geometric mean of the ratio, exp(mean over the sequence's live
    tokens of log w): a sequence outside [low, high] is masked whole, the rest kept with weight 1
    (a length-normalised sequence ratio, so long responses are not masked for their length alone)."""
    live = mask > 0
    log_w = torch.where(live, prox - behav, 0.0)
    geo = (log_w.sum(-1) / live.sum(-1).clamp(min=1)).exp()  # (B,)
    keep = ((geo >= b.low) & (geo <= b.high))[:, None].expand_as(prox)
    k = keep.to(prox.dtype)
    return Corrected(prox, k, k)


def behaviour(behav: Tensor, prox: Tensor, mask: Tensor, b: Bounds) -> Corrected:
    """Clip against the behaviour policy itself (DORA / plain off-policy PPO)."""
    ones = torch.ones_like(prox)
    return Corrected(behav, ones, ones)


CORRECTIONS: dict[str, Callable[[Tensor, Tensor, Tensor, Bounds], Corrected]] = {
    "none": no_correction,
    "tis": tis,
    "decoupled": decoupled,
    "icepop": icepop,
    "geo_mask": geo_mask,
    "behaviour": behaviour,
}


# -- staleness -------------------------------------------------------------------------------


def fresh_mask(versions: Tensor, trainer_version: int, max_staleness: int | None) -> Tensor:
    """Float (B, T): 1 on response tokens (version >= 0) at most K versions behind the trainer.

    Partial rollouts give one trajectory tokens of several versions; the older segment is masked.
    max_staleness None = keep every response token.
    """
    resp = versions >= 0
    if max_staleness is None:
        return resp.float()
    return (resp & (trainer_version - versions <= max_staleness)).float()
