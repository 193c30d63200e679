"""Config sections: every key documented, YAML and overrides mapped onto them, bad input in one line."""

import dataclasses
import importlib.util
import typing

import pytest

from tailrace.config import ConfigError, RunConfig, dump_config, load_config
from tailrace.config.fields import doc


def fields_of(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from fields_of(hints[f.name], f"{prefix}{f.name}.")


def types_of(cls, prefix=""):
    for name, tp in typing.get_type_hints(cls).items():
        yield from types_of(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [(prefix + name, tp)]


def test_every_field_has_a_one_line_meaning():
    for key, f in fields_of(RunConfig):
        assert doc(f) and "\n" not in doc(f), f"{key}: declare it with setting(default, meaning) or section()"


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("flow: {mode: pipe, steps: 7}\ntrain: {lr: 1e-4, betas: [0.9, 0.95]}\n")
    cfg = load_config(path, ["--flow.steps=9", "--model.dtype", "bfloat16", "--flow.frontier=null"])
    assert (cfg.flow.mode, cfg.flow.steps, cfg.flow.frontier) == ("pipe", 9, None)
    assert (cfg.train.lr, cfg.train.betas, cfg.model.dtype) == (1e-4, (0.9, 0.95), "bfloat16")
    assert load_config(None, []) == RunConfig()
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.dtype=fp16", "model.dtype='fp16': choose one of auto, float32, bfloat16"),
        ("--rollout.attention=flash", "rollout.attention='flash': choose one of auto, kernel, bmm, sdpa"),
        ("--flow.steps=abc", "flow.steps='abc': expected an integer"),
        ("--flow.stepz=3", "unknown config key flow.stepz; did you mean flow.steps?"),
        ("--sft.hidden_size=64", "unknown config key sft.hidden_size; did you mean arch.hidden_size?"),
        ("--flow.lr=1e-4", "unknown config key flow.lr; did you mean sft.lr, train.lr or train.critic.lr?"),
        (
            "--task.overlong_buffer=600",
            "task.overlong_buffer=600 is more than rollout.max_new_tokens=384: the penalty would start before "
            "the response does; lower it (DAPO: a fifth of the cap) or raise rollout.max_new_tokens",
        ),
        (
            "--eval.samples=4 --eval.temperature=0",
            "eval.samples=4 with eval.temperature=0: greedy samples of a prompt are all the same; set "
            "eval.samples=1 or a temperature above 0",
        ),
        ("--train.lr_schedule=step", "train.lr_schedule='step': use one of constant, linear, cosine"),
        (
            "--train.lr_min_ratio=0.1",
            "train.lr_min_ratio=0.1 with train.lr_schedule=constant: nothing decays; set train.lr_schedule to "
            "linear or cosine, or drop train.lr_min_ratio",
        ),
        (
            "--train.lr_warmup_steps=500",
            "train.lr_warmup_steps=500 is more than flow.steps=120: the learning rate would never reach "
            "train.lr; lower the warmup (a tenth of the steps or less is usual) or raise flow.steps",
        ),
        (
            "--rollout.max_versions=2",
            "rollout.max_versions=2: use null (as many as the mode needs) or 1 (one copy of the weights "
            "per engine)",
        ),
    ],
)
def test_bad_values_are_one_line_with_the_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, override.split())
    assert str(e.value) == message


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", ".inf", ".nan"])
def test_every_float_key_rejects_a_non_finite_value(value):
    floats = [k for k, tp in types_of(RunConfig) if tp in (float, float | None)]
    assert len(floats) > 10 and "train.lr" in floats and "train.loss.eps_high" in floats
    for key in floats:
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"--{key}={value}"])
        assert str(e.value).startswith(f"{key}=") and "finite" in str(e.value), key


def test_the_vllm_backend_is_refused_where_vllm_is_missing_or_with_what_it_cannot_do():
    """A config naming vLLM loads anywhere (a vLLM run's directory is read where vLLM is not); what
    builds engines refuses it there (`choices.check_backend`)."""
    from tailrace.cli.choices import check_backend

    cfg = load_config(None, ["--rollout.backend=vllm"])
    assert cfg.rollout.backend == "vllm"
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(
            ConfigError, match=r"^rollout.backend=vllm: vLLM is not installed .*tailrace\[vllm\]"
        ):
            check_backend(cfg)
    else:
        check_backend(cfg)
    with pytest.raises(ConfigError, match="no speculative decoding"):
        load_config(None, ["--rollout.backend=vllm", "--rollout.spec.drafter=history"])


def test_a_retired_key_in_an_older_run_s_config_loads_and_on_the_command_line_is_refused(tmp_path):
    """shaping.extra_time was removed (darts' budget comes from its benefit model): a run directory
    written before still resumes, and an override naming it says why it is gone."""
    from tailrace.config.load import RETIRED

    old = tmp_path / "config.yaml"
    old.write_text("shaping:\n  name: darts\n  extra_time: 0.1\nflow:\n  steps: 7\n")
    cfg = load_config(old)
    assert cfg.shaping.name == "darts" and cfg.flow.steps == 7
    with pytest.raises(ConfigError, match="--shaping.extra_time was removed: darts' budget"):
        load_config(None, ["--shaping.extra_time=0.2"])
    with pytest.raises(ConfigError, match="unknown config key shaping.extra_tim"):
        load_config(None, ["--shaping.extra_tim=0.2"])
    assert "shaping.extra_time" in RETIRED


def test_training_an_moe_on_vllms_cpu_build_is_refused_before_it_starts(tmp_path, monkeypatch):
    """vLLM's CPU build reloads an MoE's experts wrongly and serves no LoRA on them (engine.vllm_engine):
    a training run of one is refused when it starts, naming the fix; serving one is not."""
    from tailrace.cli.choices import check_backend
    from tailrace.model import CausalLM, ModelConfig, save_pretrained

    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, **moe
    )
    save_pretrained(CausalLM.from_config(cfg, seed=0), tmp_path / "moe")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    run = load_config(None, ["--rollout.backend=vllm", f"--model.path={tmp_path / 'moe'}", "--device=cpu"])
    with pytest.raises(ConfigError, match=r"a mixture of experts, on CPU: .*set rollout.backend=tailrace"):
        check_backend(run)
    check_backend(run, training=False)  # serving its fixed weights is fine


def test_routing_replay_and_the_balancing_loss_are_refused_without_experts_or_on_vllm(tmp_path):
    """train.routing_replay needs a mixture of experts and tailrace's engine (which records routes)."""
    from tailrace.cli.choices import check_backend
    from tailrace.model import CausalLM, ModelConfig, save_pretrained

    with pytest.raises(ConfigError, match="built-in model has no mixture of experts"):
        load_config(None, ["--train.routing_replay=true"])
    with pytest.raises(ConfigError, match="train.moe_aux_loss: the built-in model has no mixture of experts"):
        load_config(None, ["--train.moe_aux_loss=0.001"])
    with pytest.raises(
        ConfigError, match="routing_replay with rollout.backend=vllm: .*rollout.backend=tailrace"
    ):
        load_config(None, ["--train.routing_replay=true", "--rollout.backend=vllm", "--model.path=x"])
    cfg = ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    save_pretrained(CausalLM.from_config(cfg, seed=0), tmp_path / "dense")
    run = load_config(None, ["--train.routing_replay=true", f"--model.path={tmp_path / 'dense'}"])
    with pytest.raises(
        ConfigError, match="a llama model has no mixture of experts.*drop train.routing_replay"
    ):
        check_backend(run)
    run = load_config(None, ["--train.moe_aux_loss=0.01", f"--model.path={tmp_path / 'dense'}"])
    with pytest.raises(ConfigError, match="a llama model has no mixture of experts; drop train.moe_aux_loss"):
        check_backend(run)
