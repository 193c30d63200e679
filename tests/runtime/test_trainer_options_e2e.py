"""The trainer's and the reward's options of a verl or TRL user, through a real run: PPO's loop
(train.mini_batches, train.epochs), the step-scaled advantages, a k2 KL penalty, an entropy bonus, dual
clip, and a list of reward functions whose means are logged by name."""

import json
from pathlib import Path

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_run_of_every_option_trains_and_logs_each_reward(tiny_model, tmp_path):
    argv = [
        "train",
        f"--run-dir={tmp_path / 'run'}",
        f"--model.path={tiny_model}",
        *TINY_RUN,
        "--flow.mode=sync",
        "--train.mini_batches=2",
        "--train.epochs=2",
        "--train.advantage=batch_std",
        "--train.loss.kl_coef=0.01",
        "--train.loss.kl_type=k2",
        "--train.loss.entropy_coef=0.01",
        "--train.loss.clip_c=3",
        f"--task.reward=[task, {EXAMPLES / 'rewards.py'}:sum_then_stop]",
        "--task.reward_weights=[1, 0.5]",
    ]
    assert main(argv) == 0
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 4
    for r in steps:
        assert set(r["rewards"]) == {"task", "sum_then_stop"}
        assert 0 <= r["rewards"]["task"] <= 1 and 0 <= r["rewards"]["sum_then_stop"] <= 1.1
        # the tiny model earns little reward; the KL and entropy terms train every step, 2 x 2 updates
        assert r["train"]["updates"] == 4 and r["train"]["entropy_bonus"] > 0 and r["train"]["kl"] >= 0
        assert 0 <= r["train"]["dual_clip_frac"] <= 1
    # the report draws each reward function's curve beside the reward's
    assert main(["report", str(tmp_path / "run")]) == 0 and (tmp_path / "run" / "report.html").stat().st_size
