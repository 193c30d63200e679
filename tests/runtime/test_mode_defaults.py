"""train.loss.correction null trains each mode with its own correction, the one it was measured with."""

from __future__ import annotations

from tailrace.config import LossConfig, TrainerConfig
from tailrace.flow.policies import POLICIES
from tailrace.runtime.driver import with_correction
from tailrace.trainer.losses import CORRECTIONS


def test_a_null_correction_is_the_modes_own_and_a_named_one_is_kept():
    own = {m: with_correction(TrainerConfig(), p.correction).loss.correction for m, p in POLICIES.items()}
    assert own == {
        "sync": "none",
        "pipe": "none",
        "async": "tis",
        "partial": "tis",
        "multiversion": "behaviour",
    }
    assert set(own.values()) <= set(CORRECTIONS)
    named = TrainerConfig(loss=LossConfig(correction="icepop"))
    assert with_correction(named, "behaviour").loss.correction == "icepop"
