"""Data-parallel training (train.world_size): two gloo processes on CPU, each taking its token-balanced
share of the rows, give the gradients, weights and metrics of one process on the whole batch."""

import copy

import pytest
import torch
import torch.multiprocessing as mp

from tailrace.config import LossConfig, TrainerConfig
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.trainer.packing import split_by_tokens
from tests.trainer.test_grpo import TinyLM, grads, make_groups

LOSS = dict(name="grpo", correction="tis", kl_coef=0.1, max_new_tokens=8, tis_cap=1.3)
KEYS = (
    "loss",
    "pg_loss",
    "kl",
    "clip_frac",
    "ratio_mean",
    "tokens",
    "entropy",
    "ratio_max",
    "updates",
)
CRITIC = ("value_loss", "vf_clip_frac", "values_mean", "vf_explained_var", "critic_grad_norm")
EXTRA = ("entropy_kept", *CRITIC)  # where a run reports it  # not micro_batches:
# each rank cuts its own rows into micro-batches, so their count need not add up to one process's


def test_rows_split_by_tokens_not_rows():
    # one long row and many short ones: the long row's rank takes few others
    assert split_by_tokens([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2) == [[0], list(range(1, 11))]
    assert split_by_tokens([5, 4, 3, 3], 2) == [[0, 3], [1, 2]]
    assert split_by_tokens([7], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="world=0"):
        split_by_tokens([1], 0)


def _policy(steps: dict):
    """PPO's critic copies a tailrace decoder; the other cases train the toy."""
    if steps.get("train", {}).get("advantage") == "gae":
        from tests.trainer.test_critic import policy

        return policy()
    return TinyLM()


def _critic(tr: GRPOTrainer) -> torch.Tensor:
    if tr.critic is None:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1) for p in tr.critic.model.parameters()])


def _rank(rank: int, world: int, init: str, out, steps: dict) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = _policy(steps)
        groups = make_groups(TinyLM(), noise=0.3, n_groups=4)
        cfg = TrainerConfig(
            micro_batch_tokens=12,
            grad_clip=1.0,
            loss=LossConfig(**LOSS, **steps.get("loss", {})),
            **steps.get("train", {}),
        )
        tr = GRPOTrainer(model, cfg, ref_model=TinyLM(seed=1))
        m = tr.step(groups, trainer_version=0)
        g = {n: t.numpy().copy() for n, t in grads(model).items()}  # plain arrays: no shared-memory handles
        out.put(
            (
                rank,
                {k: m[k] for k in KEYS + EXTRA if k in m},
                g,
                tr.flat.buffer.numpy().copy(),
                _critic(tr).numpy(),
            )
        )
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "steps",
    [
        {},  # one update
        {"train": {"mini_batches": 2, "epochs": 2}},  # PPO's four
        {"loss": {"top_entropy": 0.3}},  # one threshold over both ranks' tokens
        {"train": {"advantage": "gae", "mini_batches": 2, "epochs": 2}},  # whitened over both ranks
    ],
)
def test_two_ranks_step_like_one_process(tmp_path, steps):
    base = _policy(steps)
    groups = make_groups(TinyLM(), noise=0.3, n_groups=4)
    cfg = TrainerConfig(
        micro_batch_tokens=12,
        grad_clip=1.0,
        loss=LossConfig(**LOSS, **steps.get("loss", {})),
        **steps.get("train", {}),
    )
    model = copy.deepcopy(base)
    tr = GRPOTrainer(model, cfg, ref_model=TinyLM(seed=1))
    single = tr.step(groups, trainer_version=0)
    g1, w1, c1 = grads(model), tr.flat.buffer.clone(), _critic(tr)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, 2, init, out, steps)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        metrics, g, w, c = got[rank]
        for n in g1:
            torch.testing.assert_close(torch.from_numpy(g[n]), g1[n], atol=1e-6, rtol=0)
        torch.testing.assert_close(
            torch.from_numpy(w), w1, atol=1e-6, rtol=0
        )  # every rank stepped to the same weights
        torch.testing.assert_close(torch.from_numpy(c), c1, atol=1e-6, rtol=0)  # and the same critic
        for k in KEYS + (CRITIC if "critic_lr" in single else ()):
            assert metrics[k] == pytest.approx(single[k], rel=1e-5, abs=1e-7), k
    assert single["micro_batches"] > 2 and single["updates"] == (4 if "train" in steps else 1)
    if "loss" in steps:
        assert 0.25 < single["entropy_kept"] < 0.35
        for rank in (0, 1):
            assert got[rank][0]["entropy_kept"] == single["entropy_kept"]
