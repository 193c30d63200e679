"""Configuration: one small dataclass per component, composed into `RunConfig`. No torch here.

Each section validates itself in `__post_init__` with a message that names the key and the fix;
`load_config` maps YAML files and `--section.key=value` overrides onto the sections mechanically.
"""

from tailrace.common import ConfigError
from tailrace.config.load import dump_config, load_config
from tailrace.config.model import ArchConfig, ModelSpec, SFTConfig
from tailrace.config.run import EvalConfig, FlowConfig, RolloutConfig, RunConfig, SpecConfig, TaskConfig
from tailrace.config.runtime import RuntimeConfig
from tailrace.config.shaping import ShapingConfig
from tailrace.config.store import StoreConfig
from tailrace.config.train import LossConfig, TrainerConfig

__all__ = [
    "ArchConfig",
    "ConfigError",
    "EvalConfig",
    "FlowConfig",
    "LossConfig",
    "ModelSpec",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "SFTConfig",
    "ShapingConfig",
    "SpecConfig",
    "StoreConfig",
    "TaskConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
]
