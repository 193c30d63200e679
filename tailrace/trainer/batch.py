"""TrainBatch: groups of trajectories flattened into right-padded token tensors, and its micro-batches.

Row b is one trajectory: seq = prompt_ids + response ids, input_ids = seq[:-1], targets = seq[1:]; a
position is live when its target is a response token the policy sampled (not an observation a tool
wrote: `Trajectory.observed`, in the context but never trained on nor compared with an engine
logprob) that passes the staleness mask. `scale` holds
each live token's share of the whole batch's loss normaliser, so micro-batches (row subsets) sum to
exactly the full-batch loss and gradient whatever the aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Sequence

import torch

from tailrace.model.config import ModelConfig
from tailrace.model.moe import routes_of, sparse_layers
from tailrace.trainer.advantages import StepAdvantage
from tailrace.trainer.losses import TokenScale, fresh_mask
from tailrace.trainer.packing import micro_batches
from tailrace.types import Finish, Group, Trajectory

Tensor = torch.Tensor


def with_advantages(groups: Sequence[Group], advantage: StepAdvantage | None) -> list[Group]:
    """`groups`, each with one advantage a trajectory: its own where it has them, else `advantage` of
    the rewards of all the groups that lack them, taken together (a step's, however it is cut into
    mini-batches afterwards: an estimator may scale by the whole step's rewards)."""
    for g in groups:
        if not g.trajectories:
            raise ValueError(f"group {g.id} (prompt {g.prompt_id}) is empty; drop it before training")
        if g.advantages and len(g.advantages) != len(g.trajectories):
            raise ValueError(
                f"group {g.id} has {len(g.advantages)} advantages for "
                f"{len(g.trajectories)} trajectories; give one per trajectory"
            )
    bare = [g for g in groups if not g.advantages]
    if bare and advantage is None:
        raise ValueError(f"group {bare[0].id} has no advantages; pass an advantage estimator")
    got = iter(advantage([[t.reward for t in g.trajectories] for g in bare]) if bare else ())
    return [g if g.advantages else replace(g, advantages=tuple(next(got))) for g in groups]


@dataclass(frozen=True)
class TrainBatch:
    input_ids: Tensor  # (N, T) long, right-padded with pad_id
    targets: Tensor  # (N, T) long, targets[b, t] = seq_b[t + 1]
    mask: Tensor  # (N, T) float, 1 on live response-token predictions; 0 on prompt, padding, stale tokens
    adv: Tensor  # (N, T) float, the trajectory's advantage on its response positions, else 0
    behav_logp: Tensor  # (N, T) float, engine logprob of targets[b, t] on sampled positions, else 0
    versions: Tensor  # (N, T) long, policy version of targets[b, t] on sampled positions, else -1
    # (prompt, padding and observation positions: -1 excludes them from the loss and the logprob gap)
    scale: Tensor  # (N, T) float, loss = sum(scale * per-token loss) over the whole batch
    lengths: Tensor  # (N,) long, valid positions per row = len(prompt) + len(response) - 1
    seq_adv: Tensor  # (N,) float, one advantage per trajectory
    trainer_version: int
    # routing replay: (N, T, sparse layers, k) int16, the experts the engine chose at each position
    # (model/moe.py), -1 where it recorded none; None: no replay
    routes: Tensor | None = None
    # (N, T) float: the step's pre-update policy's logprob of targets[b, t], where a step takes several
    # optimizer updates (train.mini_batches, train.epochs) or picks its tokens by entropy
    # (train.loss.top_entropy): a pass before the updates (GRPOTrainer.step); None: the forward's own
    prox_logp: Tensor | None = None
    # PPO's critic (train.advantage=gae; trainer/critic.py), each (N, T) float: its values before the
    # step's updates, GAE's returns, and each live token's share of the value loss's token mean over the
    # whole mini-batch; None without a critic
    values: Tensor | None = None
    returns: Tensor | None = None
    vscale: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def from_groups(
        groups: Sequence[Group],
        *,
        trainer_version: int,
        token_scale: TokenScale,
        advantage: StepAdvantage | None = None,
        max_new_tokens: int | None = None,
        max_staleness: int | None = None,
        pad_id: int = 0,
        moe: ModelConfig | None = None,
        mask_truncated: bool = False,
    ) -> "TrainBatch":
        """Flatten `groups`; the groups without `advantages` get them from `advantage` of their rewards,
        together (`with_advantages`). `moe`: the
        mixture of experts whose routes the trajectories carry, replayed (None: none). `mask_truncated`:
        a response the length cap cut (finish `length`) is context only, out of the loss and its
        normaliser (DAPO's overlong filtering); its advantage was computed with its group's all the same."""
        trajs: list[Trajectory] = []
        advs: list[float] = []
        for g in with_advantages(groups, advantage):
            trajs.extend(g.trajectories)
            advs.extend(g.advantages)
        if not trajs:
            raise ValueError("no trajectories to train on; pass at least one non-empty group")

        N = len(trajs)
        T = max(1, max(len(t.prompt_ids) + t.length for t in trajs) - 1)
        input_ids = torch.full((N, T), pad_id, dtype=torch.long)
        targets = torch.full((N, T), pad_id, dtype=torch.long)
        behav = torch.zeros((N, T), dtype=torch.float32)
        versions = torch.full((N, T), -1, dtype=torch.long)
        adv = torch.zeros((N, T), dtype=torch.float32)
        lengths = torch.zeros(N, dtype=torch.long)
        routes = (
            None
            if moe is None
            else torch.full((N, T, sparse_layers(moe), moe.num_experts_per_tok), -1, dtype=torch.int16)
        )
        for b, t in enumerate(trajs):
            r = t.result
            if not t.prompt_ids:
                raise ValueError(
                    f"trajectory {r.request_id} has an empty prompt; its first token has no context"
                )
            if not len(r.logprobs) == len(r.versions) == len(r.token_ids):
                raise ValueError(
                    f"trajectory {r.request_id}: {len(r.token_ids)} tokens, {len(r.logprobs)} logprobs, "
                    f"{len(r.versions)} versions; the engine must record one of each per token"
                )
            seq = list(t.prompt_ids) + list(r.token_ids)
            n, p = len(seq) - 1, len(t.prompt_ids) - 1  # positions; first response prediction
            lengths[b] = n
            if n > 0:
                input_ids[b, :n] = torch.tensor(seq[:-1])
                targets[b, :n] = torch.tensor(seq[1:])
            if routes is not None and r.routes:
                got = routes_of(r.routes, moe)
                if got.shape[0] != n:
                    raise ValueError(
                        f"trajectory {r.request_id}: routes of {got.shape[0]} positions for {n}; the engine "
                        "records one per position but the last"
                    )
                routes[b, :n] = got
            if r.token_ids:
                behav[b, p:n] = torch.tensor(r.logprobs, dtype=torch.float32)
                versions[b, p:n] = torch.tensor(r.versions, dtype=torch.long)
                adv[b, p:n] = float(advs[b])
                for a, e in t.observed:  # a tool's tokens: context only
                    behav[b, p + a : p + e] = 0.0
                    versions[b, p + a : p + e] = -1
                if mask_truncated and r.finish == Finish.LENGTH:
                    versions[b, p:n] = -1
        mask = fresh_mask(versions, trainer_version, max_staleness)
        adv = adv * mask
        return TrainBatch(
            input_ids=input_ids,
            targets=targets,
            mask=mask,
            adv=adv,
            behav_logp=behav,
            versions=versions,
            scale=token_scale(mask, max_new_tokens),
            lengths=lengths,
            seq_adv=torch.tensor(advs, dtype=torch.float32),
            trainer_version=trainer_version,
            routes=routes,
        )

    def rows(self, idx: Sequence[int]) -> "TrainBatch":
        """The rows `idx`, cut to their longest; `scale` keeps the full batch's normaliser."""
        i = torch.as_tensor(list(idx), dtype=torch.long)
        t = max(1, int(self.lengths[i].max()))
        return self._map(lambda x: x[i, :t] if x.dim() >= 2 else x[i])

    def micro_batches(self, max_tokens: int) -> list["TrainBatch"]:
        """Row subsets with rows x padded length <= max_tokens (a longer single row goes alone).

        Rows are taken longest first so each micro-batch pads little.
        """
        return [mb for _, mb in self.indexed_micro_batches(max_tokens)]

    def indexed_micro_batches(self, max_tokens: int) -> Iterator[tuple[Tensor, "TrainBatch"]]:
        """`micro_batches`, each with its rows' indices in this batch: where a pass over them writes back."""
        for idx in micro_batches(self.lengths.tolist(), max_tokens):
            yield torch.tensor(idx), self.rows(idx)

    def to(self, device: torch.device | str) -> "TrainBatch":
        return self._map(lambda x: x.to(device, non_blocking=True))

    def _map(self, fn: Callable[[Tensor], Tensor]) -> "TrainBatch":
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )
