"""Config values that name a registry entry, checked against that registry before anything starts.

Each vocabulary has one home, its registry: overlap modes are `flow.policies.POLICIES`, shapings
`flow.shaping.SHAPINGS`, policy-gradient losses (with each one's default clip range and paired
advantage estimator) and off-policy corrections `trainer.losses.LOSSES` and `CORRECTIONS`, advantage
estimators `trainer.advantages.ADVANTAGES`, drafters `engine.spec.DRAFTERS` (and none). The config
fields that name them are plain strings, so the config stays torch-free; the CLI calls `check` right
after loading a config, and its help lists each field's choices from the same table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Collection

from tailrace.common import ConfigError
from tailrace.config import FlowConfig, LossConfig, RunConfig, ShapingConfig, SpecConfig, TrainerConfig

Registries = dict[tuple[type, str], Collection[str]]  # (section, field) -> the names it may take


def registries() -> Registries:
    """(section, field) -> the registry whose names the field takes (imports the trainer's, and torch)."""
    from tailrace.engine.spec import DRAFTERS
    from tailrace.flow.policies import POLICIES
    from tailrace.flow.shaping import SHAPINGS
    from tailrace.trainer.advantages import ADVANTAGES
    from tailrace.trainer.losses import CORRECTIONS, KL_ESTIMATORS, LOSSES

    return {
        (FlowConfig, "mode"): POLICIES,
        (ShapingConfig, "name"): SHAPINGS,
        (LossConfig, "name"): LOSSES,
        (LossConfig, "correction"): CORRECTIONS,
        (LossConfig, "kl_type"): KL_ESTIMATORS,
        (TrainerConfig, "advantage"): ADVANTAGES,
        (SpecConfig, "drafter"): ("none", *DRAFTERS),
    }


def check_names(cfg: Any) -> None:
    """Reject a field whose value its registry lacks, naming the valid choices (None = the default)."""
    _walk(cfg, "", registries())


def _walk(cfg: Any, prefix: str, table: Registries) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _walk(value, f"{prefix}{f.name}.", table)
        names = table.get((type(cfg), f.name))
        if names is not None and value is not None and value not in names:
            raise ConfigError(f"{prefix}{f.name}={value!r}: choose one of {', '.join(names)}")


def check_multi_turn(cfg: RunConfig) -> None:
    """A multi-turn (tool) task runs in every mode (its parked samples continue under the weights the
    mode allows), without shaping."""
    from tailrace.tasks.registry import multi_turn

    if not multi_turn(cfg.task.name):
        return
    if cfg.task.reward:
        raise ConfigError(
            f"task.reward={cfg.task.reward} with task.name={cfg.task.name}: a multi-turn task's reward is its "
            "own; drop task.reward"
        )
    if cfg.shaping.name != "none":
        raise ConfigError(
            f"task.name={cfg.task.name} is multi-turn (tool calls); shaping.name={cfg.shaping.name} "
            "cannot stop a sample parked at a tool yet: set --shaping.name=none"
        )


def check_backend(cfg: RunConfig, training: bool = True) -> None:
    """The rollout backend is installed in this Python: asked only by what builds engines (train, its
    supervisor, serve), so a vLLM run's directory still loads where vLLM is not (eval, sim, report,
    checks). `training`: the engines will load new weights, which vLLM's CPU build cannot do for a
    mixture of experts (`engine.vllm_engine`): such a run is refused before it starts, not at its first
    weight load. So are the settings only a mixture of experts uses (`TrainerConfig.moe_only`) on a model
    without experts."""
    from tailrace.model.checkpoint import read_config

    wanted = cfg.train.moe_only()
    model = read_config(cfg.model.path) if wanted and cfg.model.path else None
    if model is not None and not model.moe:
        raise ConfigError(
            f"train.{wanted[0]} with model.path={cfg.model.path}: a {model.model_type} model has no mixture of "
            f"experts; drop train.{wanted[0]}"
        )
    if cfg.rollout.backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.backend=vllm: vLLM is not installed in this Python; pip install 'tailrace[vllm]' "
            "(or `make vllm` for its CPU build in .venv-vllm), or set rollout.backend=tailrace"
        )
    from tailrace.runtime.procs import resolve_device

    if (
        training
        and cfg.model.path
        and resolve_device(cfg.device) == "cpu"
        and read_config(cfg.model.path).moe
    ):
        raise ConfigError(
            f"rollout.backend=vllm with model.path={cfg.model.path}, a mixture of experts, on CPU: vLLM's CPU "
            "build neither reloads its experts' weights correctly nor serves LoRA adapters on them, and "
            "training needs one of the two; set rollout.backend=tailrace"
        )


def slow_settings(cfg: RunConfig) -> list[str]:
    """Lines naming settings this machine runs far slower than their alternative (nothing is refused):
    bf16 on a CPU without bf16 GEMMs (AVX2 only), ~12x slower than fp32 there."""
    import torch

    from tailrace.model.device import bf16_fast
    from tailrace.runtime.procs import resolve_device

    device = torch.device(resolve_device(cfg.device))
    if bf16_fast(device):
        return []
    out = []
    if cfg.train.bf16 or any((p.get("train") or {}).get("bf16") for p in cfg.policies):
        out.append(
            "train.bf16: this CPU has no bf16 GEMMs (AVX2 only), where bf16 autocast runs ~12x slower "
            "than fp32; set train.bf16=false here"
        )
    return out


def check(cfg: RunConfig) -> None:
    """Every name in its registry, the shaping one the mode supports, the flow settings ones the
    chosen policy accepts, and the policy one the rollout engines' capabilities can serve."""
    from tailrace.flow.filters import load_keep
    from tailrace.flow.policies import make_policy
    from tailrace.flow.shaping import check_mode
    from tailrace.runtime.run_modes import run_capabilities, with_mode
    from tailrace.user_code import load_function

    if cfg.policies:
        check_policies(cfg)
        return
    cfg, _ = with_mode(cfg)  # flow.mode null: the mode the run will get
    check_names(cfg)
    check_multi_turn(cfg)
    try:
        check_mode(cfg.shaping.name, cfg.flow.mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    options = {k: v for k, v in dataclasses.asdict(cfg.flow).items() if k != "mode"}
    keep = load_keep(cfg.store.filter) if cfg.store.filter else None  # (its one-line ConfigError)
    rewards = [cfg.task.reward] if isinstance(cfg.task.reward, str) else cfg.task.reward or []
    for spec in rewards:
        if spec != "task":  # (a list's name for the task's own reward)
            load_function(spec, "task.reward")  # found and loadable before any process starts
    try:
        policy = make_policy(cfg.flow.mode, keep=keep, keep_name=cfg.store.filter or "", **options)
    except ValueError as e:
        raise ConfigError(f"flow.mode={cfg.flow.mode}: {e}") from None
    why = policy.refusal(run_capabilities(cfg))
    if why:
        raise ConfigError(why)


def check_policies(cfg: RunConfig) -> None:
    """A run of several policies: each policy's config checked as a run's, and what such a run does
    not do yet refused, in one line naming the key."""
    from tailrace.config.load import policy_configs
    from tailrace.runtime.run_modes import run_capabilities

    r = cfg.rollout
    n = len(cfg.policies)
    if run_capabilities(cfg).versions_at_once == 1 and r.engines < n:
        why = "rollout.backend=vllm" if r.backend == "vllm" else "rollout.max_versions=1"
        raise ConfigError(
            f"policies: {n} policies on engines that hold one weight version at a time ({why}) need an "
            f"engine each at least, and rollout.engines={r.engines}; raise rollout.engines to {n} or more"
        )
    for name, pc in policy_configs(cfg):
        try:
            check(pc)
        except ConfigError as e:
            raise ConfigError(f"policies ({name}): {e}") from None
        if pc.train.lora != cfg.train.lora:  # the engines hold every policy's weights in one layout
            raise ConfigError(
                f"policies ({name}): train.lora {dataclasses.asdict(pc.train.lora)} differs from the run's "
                f"{dataclasses.asdict(cfg.train.lora)}; the policies share the engines' model, so give "
                "train.lora at the top of the config, not per policy"
            )
