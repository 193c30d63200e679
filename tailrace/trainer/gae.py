"""PPO's critic, its pure parts: generalized advantage estimation, the advantages' whitening and the
clipped value loss (`train.advantage=gae`; the model and its updates are `trainer/critic.py`).

Tensors are (N, T) and aligned with a TrainBatch's targets: position t is the state before targets[t]
is drawn, its value V_t. A row's reward is an outcome: it arrives with its last sampled token, so the
per-token rewards are 0 but there. `steps` marks the positions the policy sampled (not the prompt, not a
tool's observation, not padding); the recursion runs over them alone, each to the next sampled one,
and the episode ends after the last (its next value 0, a truncated one's too, as verl treats it).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
WHITEN_EPS = 1e-8  # verl's masked_whiten


def gae(rewards: Tensor, values: Tensor, steps: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns), 0 off `steps`: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma
    lam A_next over each row's sampled positions (Schulman et al. 2016), returns = A + V. `rewards` (N,)
    is each row's outcome."""
    n, t_len = values.shape
    adv = torch.zeros_like(values)
    nxt_v = torch.zeros(n, dtype=values.dtype, device=values.device)
    nxt_a = torch.zeros_like(nxt_v)
    last = torch.ones(n, dtype=torch.bool, device=values.device)  # no sampled step seen after this yet
    for t in range(t_len - 1, -1, -1):
        on = steps[:, t]
        r = torch.where(on & last, rewards.to(values.dtype), 0.0)
        a = r + gamma * nxt_v - values[:, t] + gamma * lam * nxt_a
        adv[:, t] = torch.where(on, a, 0.0)
        nxt_v = torch.where(on, values[:, t], nxt_v)
        nxt_a = torch.where(on, a, nxt_a)
        last = last & ~on
    return adv, torch.where(steps, adv + values, 0.0)


def moments(x: Tensor, mask: Tensor) -> Tensor:
    """[count, sum, sum of squares] of `x` over `mask`: what shards and data-parallel ranks add up
    before `whitened`."""
    live = mask > 0
    x = torch.where(live, x, 0.0)
    return torch.stack([live.sum().to(x.dtype), x.sum(), (x * x).sum()])


def whitened(x: Tensor, mask: Tensor, m: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) on `mask`, 0 off it; mean and the unbiased variance from the summed
    `moments` m (the whole step's), as verl's masked_whiten."""
    n, s, ss = m.unbind()
    mean = s / n.clamp(min=1)
    var = (ss - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1)
    return torch.where(mask > 0, (x - mean) / torch.sqrt(var + WHITEN_EPS), 0.0)


def value_loss(
    v: Tensor, old_v: Tensor, returns: Tensor, mask: Tensor, scale: Tensor, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum(scale * 0.5 max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2)) (PPO's clipped value loss;
    `clip` None: the plain squared error). Stats: vf_clip_frac, the live tokens whose clipped term won."""
    live = mask > 0
    err = (v - returns) ** 2
    if clip is None:
        per_tok, hit = err, torch.zeros_like(live)
    else:
        held = (old_v + (v - old_v).clamp(-clip, clip) - returns) ** 2
        per_tok, hit = torch.maximum(err, held), (held > err) & live
    loss = torch.where(live, 0.5 * per_tok * scale, 0.0).sum()
    return loss, {"vf_clip_frac": hit.sum() / live.sum().clamp(min=1)}


def explained_variance(err: Tensor, returns: Tensor) -> float:
    """1 - Var(R - v) / Var(R) from the `moments` of R - v and of R over the same tokens (1: the values
    predict the returns; 0: no better than their mean); nan without variance in the returns."""

    def var(m: Tensor) -> float:
        n, s, ss = (float(x) for x in m)
        return ss / n - (s / n) ** 2 if n > 1 else 0.0

    return 1.0 - var(err) / var(returns) if var(returns) > 0 else float("nan")
