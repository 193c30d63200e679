from dataclasses import replace

import pytest
import torch

from tailrace.trainer.advantages import ADVANTAGES
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.losses import seq_mean_scale, token_mean_scale
from tailrace.types import Finish, GenResult, Group, Trajectory


def traj(pid, prompt, resp, lps, vers, reward=0.0, rid="r"):
    res = GenResult(rid, tuple(resp), tuple(lps), tuple(vers), Finish.STOP)
    return Trajectory(
        group=pid,
        sample_index=0,
        prompt_id=pid,
        prompt_ids=tuple(prompt),
        result=res,
        reward=reward,
        correct=reward > 0,
    )


def close(t, expect):
    torch.testing.assert_close(t, torch.tensor(expect, dtype=t.dtype), atol=1e-7, rtol=0)


def groups():
    a = traj(0, [1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], [3, 3, 3], reward=1.0, rid="a")
    b = traj(0, [1, 2], [8], [-0.4], [3], reward=0.0, rid="b")
    c = traj(1, [9], [4, 4], [-0.5, -0.6], [2, 3], rid="c")  # a partial rollout: two versions
    return [
        Group(id=0, prompt_id=0, trajectories=(a, b)),
        Group(id=1, prompt_id=1, trajectories=(c,), advantages=(0.5,)),
    ]


def test_flatten_layout():
    tb = TrainBatch.from_groups(
        groups(), trainer_version=3, token_scale=seq_mean_scale, advantage=ADVANTAGES["grpo"]
    )
    assert tb.input_ids.tolist() == [[1, 2, 5, 6], [1, 2, 0, 0], [9, 4, 0, 0]]
    assert tb.targets.tolist() == [[2, 5, 6, 7], [2, 8, 0, 0], [4, 4, 0, 0]]
    assert tb.mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 0]]
    assert tb.versions.tolist() == [[-1, 3, 3, 3], [-1, 3, -1, -1], [2, 3, -1, -1]]
    close(tb.behav_logp, [[0, -0.1, -0.2, -0.3], [0, -0.4, 0, 0], [-0.5, -0.6, 0, 0]])
    assert tb.lengths.tolist() == [4, 2, 2]
    s = 0.5 / (0.5 + 1e-6)  # grpo on rewards [1, 0]; group 1 keeps its given 0.5
    assert tb.seq_adv.tolist() == pytest.approx([s, -s, 0.5])
    close(tb.adv, [[0, s, s, s], [0, -s, 0, 0], [0.5, 0.5, 0, 0]])
    # mean over each sequence, then over 3 sequences
    close(tb.scale, [[0, 1 / 9, 1 / 9, 1 / 9], [0, 1 / 3, 0, 0], [1 / 6, 1 / 6, 0, 0]])


def test_staleness_masks_old_segment_and_renormalises():
    tb = TrainBatch.from_groups(
        groups(),
        trainer_version=3,
        token_scale=token_mean_scale,
        advantage=ADVANTAGES["grpo"],
        max_staleness=0,
    )
    assert tb.mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 0, 0]]
    assert tb.scale.sum().item() == pytest.approx(1.0)
    close(tb.scale[2], [0, 1 / 5, 0, 0])


def test_a_truncated_response_is_masked_out_of_the_loss_but_keeps_its_groups_advantages():
    """DAPO's overlong filtering: `a` hit the length cap. With mask_truncated its tokens leave the loss
    and the normaliser (2 sequences left), while `b`'s advantage is still grpo over both rewards."""
    gs = groups()
    a = gs[0].trajectories[0]
    cut = replace(a, result=replace(a.result, finish=Finish.LENGTH))
    gs[0] = replace(gs[0], trajectories=(cut, gs[0].trajectories[1]))
    kept = TrainBatch.from_groups(
        gs, trainer_version=3, token_scale=seq_mean_scale, advantage=ADVANTAGES["grpo"]
    )
    assert kept.mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 0]]  # off: trained as any
    tb = TrainBatch.from_groups(
        gs, trainer_version=3, token_scale=seq_mean_scale, advantage=ADVANTAGES["grpo"], mask_truncated=True
    )
    assert tb.mask.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]]
    s = 0.5 / (0.5 + 1e-6)
    assert tb.seq_adv.tolist() == pytest.approx([s, -s, 0.5])
    close(tb.adv, [[0, 0, 0, 0], [0, -s, 0, 0], [0.5, 0.5, 0, 0]])
    close(tb.scale, [[0, 0, 0, 0], [0, 1 / 2, 0, 0], [1 / 4, 1 / 4, 0, 0]])


def test_micro_batches_respect_budget_and_keep_global_scale():
    tb = TrainBatch.from_groups(
        groups(), trainer_version=3, token_scale=seq_mean_scale, advantage=ADVANTAGES["grpo"]
    )
    mbs = tb.micro_batches(4)
    assert [tuple(m.input_ids.shape) for m in mbs] == [(1, 4), (2, 2)]
    assert mbs[1].input_ids.tolist() == [[1, 2], [9, 4]]
    assert sum(m.scale.sum().item() for m in mbs) == pytest.approx(1.0)
    close(mbs[1].scale, [[0, 1 / 3], [1 / 6, 1 / 6]])
    assert len(tb.micro_batches(10_000)) == 1
    assert len(tb.micro_batches(1)) == 3  # a row longer than the budget still trains, alone


def test_errors_name_the_problem():
    bad = traj(0, [1], [5, 6], [-0.1], [0, 0])
    with pytest.raises(ValueError, match="1 logprobs"):
        TrainBatch.from_groups(
            [Group(id=0, prompt_id=0, trajectories=(bad,))],
            trainer_version=0,
            token_scale=seq_mean_scale,
            advantage=ADVANTAGES["grpo"],
        )
    with pytest.raises(ValueError, match="no advantages"):
        TrainBatch.from_groups(groups(), trainer_version=0, token_scale=seq_mean_scale)
    with pytest.raises(ValueError, match="one per trajectory"):
        one_adv = Group(id=0, prompt_id=0, trajectories=groups()[0].trajectories, advantages=(1.0,))
        TrainBatch.from_groups([one_adv], trainer_version=0, token_scale=seq_mean_scale)


def test_to_keeps_values():
    tb = TrainBatch.from_groups(
        groups(), trainer_version=3, token_scale=seq_mean_scale, advantage=ADVANTAGES["grpo"]
    )
    moved = tb.to("cpu")
    assert torch.equal(moved.scale, tb.scale) and moved.trainer_version == 3
