"""A KL penalty through the real processes: the trainer worker builds its reference policy."""

import json

import pytest

from tailrace.cli import main
from tests.runtime.conftest import TINY_RUN


@pytest.mark.slow
def test_a_run_with_a_kl_penalty_trains(tiny_model, tmp_path):
    run = tmp_path / "run"
    argv = ["train", f"--run-dir={run}", f"--model.path={tiny_model}", *TINY_RUN, "--flow.steps=2"]
    assert main([*argv, "--train.loss.kl_coef=0.05"]) == 0  # was: the trainer died (no ref_model)
    steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"kind":"step"' in l]
    assert len(steps) == 2 and all(s["train"]["kl"] >= 0 for s in steps)  # k3 is >= 0, and finite
