"""The defaults follow the measurements: flow.mode null runs the recommended mode (sync where the run
needs sync's rounds), and train.loss.correction null trains each mode with its own correction, the one
it was measured with."""

from __future__ import annotations

import pytest

from tailrace.config import LossConfig, TrainerConfig, load_config
from tailrace.flow.policies import POLICIES, RECOMMENDED, recommended_mode
from tailrace.runtime.run_modes import with_correction, with_mode
from tailrace.sim.scenario import Scenario
from tailrace.trainer.losses import CORRECTIONS


def test_the_recommended_mode_is_multiversion_unless_the_run_needs_syncs_rounds():
    assert RECOMMENDED == "multiversion"
    assert recommended_mode()[0] == "multiversion"
    assert recommended_mode("darts")[0] == "multiversion"  # darts works with every mode
    for shaping in ("tailbatch", "april", "sorted"):  # they cut sync's rounds (tailbatch: also pipe's)
        assert recommended_mode(shaping)[0] == "sync"
    assert recommended_mode(pregen=True)[0] == "sync"
    assert recommended_mode(versions_at_once=1)[0] == "sync"
    assert recommended_mode(versions_at_once=None)[0] == "multiversion"


@pytest.mark.parametrize(
    "overrides, mode",
    [
        ([], "multiversion"),
        (["--flow.mode=pipe"], "pipe"),  # a named mode is kept
        (["--flow.mode=multiversion", "--shaping.name=tailbatch"], "multiversion"),  # and refused later
        (["--task.name=chaincalc"], "multiversion"),  # tool turns run in every mode
        (["--shaping.name=sorted"], "sync"),
        (["--rollout.spec.pregen_below=0.5", "--rollout.spec.drafter=history"], "sync"),
    ],
)
def test_a_null_mode_is_settled_once_from_the_config(overrides, mode):
    cfg, why = with_mode(load_config(None, overrides))
    assert cfg.flow.mode == mode
    assert (why is None) == any(o.startswith("--flow.mode=") for o in overrides)
    assert with_mode(cfg) == (cfg, None)  # settled: idempotent


def test_the_simulator_settles_a_null_mode_as_a_real_run_would():
    assert Scenario().flow.mode == "multiversion"
    assert load_config(None, ["--shaping.name=tailbatch"], cls=Scenario).flow.mode == "sync"


def test_a_null_correction_is_the_modes_own_and_a_named_one_is_kept():
    own = {
        m: with_correction(TrainerConfig(), p.own_correction(1)).loss.correction for m, p in POLICIES.items()
    }
    assert own == {
        "sync": "none",
        "pipe": "none",
        "async": "tis",
        "partial": "behaviour",
        "multiversion": "behaviour",
        "external": "tis",
    }
    assert set(own.values()) <= set(CORRECTIONS)
    named = TrainerConfig(loss=LossConfig(correction="icepop"))
    assert with_correction(named, "behaviour").loss.correction == "icepop"


def test_rounds_of_several_steps_clip_their_later_steps_against_the_behaviour_policy():
    """sync and pipe publish once a round: a round of R / U > 1 steps trains its later steps after the
    weights moved, so its own correction anchors the ratio at the behaviour logprobs (a one-step
    round is exactly on-policy: the trainer's own)."""
    assert [POLICIES[m].own_correction(n) for m in ("sync", "pipe") for n in (1, 4)] == [
        "none",
        "behaviour",
        "none",
        "behaviour",
    ]
    assert [POLICIES[m].own_correction(4) for m in ("async", "partial", "multiversion")] == [
        "tis",
        "behaviour",
        "behaviour",
    ]
    assert (
        load_config(None, ["--flow.prompts_per_round=32", "--flow.train_batch=64"]).flow.steps_per_round == 4
    )
