"""A name a registry lacks is rejected right after loading, in one line listing the registry's names."""

import pytest

from tailrace.cli.choices import check, registries
from tailrace.config import (
    ConfigError,
    FlowConfig,
    LossConfig,
    ShapingConfig,
    SpecConfig,
    TrainerConfig,
    load_config,
)
from tailrace.engine.spec import DRAFTERS
from tailrace.flow.policies import POLICIES
from tailrace.flow.shaping import SHAPINGS
from tailrace.trainer.advantages import ADVANTAGES
from tailrace.trainer.losses import CORRECTIONS, KL_ESTIMATORS, LOSSES


@pytest.mark.parametrize(
    "override,registry",
    [
        ("--flow.mode=pip", POLICIES),
        ("--shaping.name=dart", SHAPINGS),
        ("--train.loss.name=ppo", LOSSES),
        ("--train.loss.correction=is", CORRECTIONS),
        ("--train.loss.kl_type=k4", KL_ESTIMATORS),
        ("--train.advantage=vtrace", ADVANTAGES),
        ("--rollout.spec.drafter=eagle", ("none", *DRAFTERS)),
    ],
)
def test_unknown_name_lists_the_registry(override, registry):
    key, value = override[2:].split("=")
    with pytest.raises(ConfigError) as e:
        check(load_config(overrides=[override]))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value!r}") and msg.endswith(", ".join(registry)) and "\n" not in msg


def test_every_registered_name_passes():
    prefix = {
        FlowConfig: "flow",
        ShapingConfig: "shaping",
        LossConfig: "train.loss",
        TrainerConfig: "train",
        SpecConfig: "rollout.spec",
    }
    for (section, field), names in registries().items():
        for name in names:  # drgrpo needs its normaliser, and async & co. staleness >= 1 (the default)
            check(
                load_config(
                    overrides=[f"--{prefix[section]}.{field}={name}", "--train.loss.max_new_tokens=64"]
                )
            )


def test_a_mode_that_needs_several_versions_is_refused_on_one_version_engines():
    one = "--rollout.max_versions=1"
    with pytest.raises(ConfigError, match="flow.mode=partial .*rollout.max_versions=1"):
        check(load_config(overrides=["--flow.mode=partial", one]))
    check(load_config(overrides=[one]))  # flow.mode null: the recommended mode is then sync
    assert load_config(overrides=[one]).rollout.max_versions == 1


def test_the_chosen_policy_judges_its_options():
    with pytest.raises(ConfigError, match="flow.mode=async: .*max_staleness"):
        check(load_config(overrides=["--flow.mode=async", "--flow.max_staleness=0"]))
    check(load_config(overrides=["--flow.mode=pipe", "--flow.max_staleness=0"]))


@pytest.mark.parametrize("fast", [True, False])
def test_train_bf16_on_a_cpu_without_bf16_gemms_says_so(monkeypatch, fast):
    """Nothing refused: a line naming the setting and what to do, only where bf16 is slow."""
    from tailrace.cli import choices
    from tailrace.model import device

    monkeypatch.setattr(device, "bf16_fast", lambda d: fast)
    lines = choices.slow_settings(load_config(None, ["--train.bf16=true", "--device=cpu"]))
    assert lines == ([] if fast else [lines[0]]) and all("train.bf16=false" in x for x in lines)
    assert choices.slow_settings(load_config(None, ["--device=cpu"])) == []
