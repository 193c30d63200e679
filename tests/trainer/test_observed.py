"""Observation tokens (a tool's answers in a multi-turn trajectory) are context, never trained on."""

from __future__ import annotations

from tailrace.config import TrainerConfig
from tailrace.trainer.batch import TrainBatch
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.trainer.logprobs import token_logprobs
from tailrace.trainer.losses import LOSSES, seq_mean_scale
from tailrace.types import Finish, GenResult, Group, Trajectory
from tests.trainer.test_grpo import TinyLM, model_logprobs

PROMPT, RESP = (1, 2), (5, 6, 9, 9, 7, 8)  # response positions 2..3 are a tool's observation
OBSERVED = ((2, 4),)


def group(model, obs_logprob=0.0, obs_tokens=(9, 9)):
    trajs = []
    for i, reward in enumerate((1.0, 0.0)):
        resp = RESP[:2] + obs_tokens + RESP[4:] if i == 0 else (5, 7, 9, 9, 8, 8)
        lps = list(model_logprobs(model, PROMPT, resp))
        lps[2:4] = [obs_logprob] * 2  # what the engine records for tokens it did not sample
        res = GenResult(f"r{i}", resp, tuple(lps), (0,) * 6, Finish.STOP)
        trajs.append(Trajectory(0, i, 0, PROMPT, res, reward, reward > 0, observed=OBSERVED))
    return Group(0, 0, tuple(trajs))


def test_masked_tool_tokens_get_zero_gradient():
    model = TinyLM()
    batch = TrainBatch.from_groups(
        [group(model)],
        trainer_version=0,
        token_scale=seq_mean_scale,
        advantage=lambda step: [[1.0, -1.0] for _ in step],
    )
    p = len(PROMPT) - 1
    obs = [p + 2, p + 3]  # the target positions of the observation tokens
    assert batch.mask[:, obs].abs().sum() == 0 and (batch.versions[:, obs] == -1).all()
    assert batch.mask[0].sum() == 4  # the four sampled tokens
    logits = model(batch.input_ids).detach().requires_grad_(True)
    logp = token_logprobs(logits, batch.targets)
    loss, _ = LOSSES["grpo"](logp, batch.behav_logp, batch.adv, batch.mask, batch.scale)
    loss.backward()
    assert logits.grad[:, obs].abs().max() == 0  # no gradient reaches an observation token's prediction
    sampled = [p + 0, p + 1, p + 4, p + 5]
    assert (logits.grad[:, sampled].abs().amax(-1) > 0).all()


def test_observation_logprobs_and_tokens_never_reach_the_loss_or_the_gap():
    model = TinyLM()
    tr = GRPOTrainer(model, TrainerConfig())
    a = tr.evaluate([group(model, obs_logprob=0.0)], trainer_version=0)
    b = tr.evaluate([group(model, obs_logprob=-50.0)], trainer_version=0)
    assert a["loss"] == b["loss"] and a["tokens"] == b["tokens"] == 8
    assert a["gap_tokens"] == 8 and a["logprob_gap_max"] < 1e-5  # the tool's tokens are not compared
