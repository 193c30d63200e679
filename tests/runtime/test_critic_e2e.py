"""PPO's critic through a real run (train.advantage=gae): its figures logged each step, its weights and
AdamW state checkpointed beside the policy's and taken back by a resume, on two data-parallel ranks; and
a multi-turn task's episodes, their tool observations stepped over."""

import json
from pathlib import Path

import pytest

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN

# the tiny model earns no task reward: a reward it does earn, so the critic has returns to learn
SHAPED = f"--task.reward={Path(__file__).resolve().parents[2] / 'examples' / 'rewards.py'}:sum_then_stop"


def steps_of(run):
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train"] for r in records if r["kind"] == "step"]


@pytest.mark.parametrize(
    "how",
    [
        ["--train.world_size=2", "--train.micro_batch_tokens=256"],  # rank 0 saves it, both take it back
        ["--train.lora.rank=8"],  # its adapter and head on the policy's base: what it saves
    ],
)
def test_a_gae_run_checkpoints_its_critic_and_a_resume_takes_it_back(tiny_model, tmp_path, how):
    run = tmp_path / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync",
            "--train.advantage=gae", "--flow.steps=2", "--flow.checkpoint_every=1", SHAPED, *how]  # fmt: skip
    assert main(argv) == 0
    first = steps_of(run)
    assert len(first) == 2 and all(s["value_loss"] > 0 and s["critic_lr"] > 0 for s in first)
    assert first[0]["values_mean"] == 0.0 != first[1]["values_mean"]  # the head starts at zero, then learns
    critic = run / "checkpoints" / "step_000002" / "critic.safetensors"
    assert critic.stat().st_mode == (critic.parent / "optimizer.safetensors").stat().st_mode  # not 0600
    if "--train.lora.rank=8" in how:  # its adapter and head alone, not the base it shares
        from safetensors import safe_open

        with safe_open(str(critic), framework="pt") as fh:
            weights = [k for k in fh.keys() if k.startswith("model.")]
        assert weights and all(".lora_" in k or k.startswith("model.score.") for k in weights), weights
    assert main(["train", "--resume", str(run), "--flow.steps=3"]) == 0
    third = steps_of(run)[-1]
    assert third["step"] == 3 and third["values_mean"] != 0.0  # the checkpoint's critic, not a fresh one


def test_a_multi_turn_task_trains_with_a_critic(tool_model, tmp_path):
    from tailrace.records import Finished, read_journal

    run = tmp_path / "run"
    base = [a for a in TINY_RUN if not a.startswith(("--flow.steps", "--rollout.max_new_tokens", "--eval.n"))]
    argv = ["train", f"--run-dir={run}", f"--model.path={tool_model}", *base, "--flow.steps=2", "--eval.n=4",
            "--task.name=chaincalc", "--rollout.max_new_tokens=96", "--eval.max_new_tokens=96",
            "--flow.mode=multiversion", "--train.advantage=gae", "--flow.zero_signal=train"]  # fmt: skip
    assert main(argv) == 0
    assert all(s["value_loss"] >= 0 and s["tokens"] > 0 for s in steps_of(run))
    trajs = [e.trajectory for e in read_journal(run / "journal.jsonl") if isinstance(e, Finished)]
    assert any(t.observed for t in trajs), "the tool model should call the calculator"
