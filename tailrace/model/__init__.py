"""Llama/Qwen2-compatible decoder (training and cached decode) and HF checkpoint I/O."""

from tailrace.model.checkpoint import CheckpointError, load_pretrained, read_config, save_pretrained
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM
from tailrace.model.kv_cache import KVCache

__all__ = [
    "CausalLM",
    "CheckpointError",
    "KVCache",
    "ModelConfig",
    "load_pretrained",
    "read_config",
    "save_pretrained",
]
