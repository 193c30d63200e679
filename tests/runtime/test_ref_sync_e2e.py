"""A KL reference reset every step (train.loss.ref_sync_steps) through a real run, checkpointed and
taken back by a resume."""

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN
from tests.runtime.test_critic_e2e import SHAPED, steps_of


def test_a_reset_reference_is_checkpointed_and_a_resume_takes_it_back(tiny_model, tmp_path):
    """train.loss.ref_sync_steps=1 with alpha 1: after each step the KL reference is the policy, so the
    next step's KL (one update: its forward at the reference's weights) is 0; a resume from the step-2
    checkpoint takes the reset reference back (a start-model reference would give step 3 a KL > 0)."""
    run = tmp_path / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.mode=sync",
            "--flow.steps=2", "--flow.checkpoint_every=1", SHAPED, "--flow.zero_signal=train",
            "--train.loss.kl_coef=0.1", "--train.loss.ref_sync_steps=1"]  # fmt: skip
    assert main(argv) == 0
    assert (run / "checkpoints" / "step_000002" / "reference.safetensors").is_file()
    first = steps_of(run)
    assert first[1]["kl"] == 0.0 and first[1]["tokens"] > 0
    assert main(["train", "--resume", str(run), "--flow.steps=3"]) == 0
    assert steps_of(run)[-1]["step"] == 3 and steps_of(run)[-1]["kl"] == 0.0
