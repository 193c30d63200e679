"""A run's overlap mode and what its engines can do, decided before anything starts (the driver, the
command line's checks and `tailrace policy join` ask the same functions)."""

from __future__ import annotations

from dataclasses import replace

from tailrace.config import RunConfig, TrainerConfig
from tailrace.engine import capabilities
from tailrace.flow.policies import recommended_mode
from tailrace.types import Capabilities


def run_capabilities(cfg: RunConfig) -> Capabilities:
    """What the run's engines can do. A LoRA run's versions are adapters over one base
    (`engine.adapter_versions`): as many as the mode needs, whatever `rollout.max_versions`."""
    r = cfg.rollout
    caps = capabilities(r.backend, speculative=r.spec.drafter != "none", max_versions=r.max_versions)
    return replace(caps, versions_at_once=None, adapters=True) if cfg.train.lora.rank else caps


def with_mode(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """`cfg` with the recommended overlap mode where flow.mode is null, and why it is that one (None
    where the config names its mode)."""
    if cfg.flow.mode is not None:
        return cfg, None
    r = cfg.rollout
    mode, why = recommended_mode(
        cfg.shaping.name,
        run_capabilities(cfg).versions_at_once,
        r.spec.pregen_below is not None,
    )
    return replace(cfg, flow=replace(cfg.flow, mode=mode)), why


def with_correction(train: TrainerConfig, own: str) -> TrainerConfig:
    """`train` with the mode's own off-policy correction where train.loss.correction is null."""
    if train.loss.correction is not None:
        return train
    return replace(train, loss=replace(train.loss, correction=own))
