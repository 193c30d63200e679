"""Llama/Mistral/Qwen2/Qwen3/OLMo2/OLMo3/SmolLM3/Phi-3/Granite-compatible decoder (whole-sequence forward) and HF
checkpoint I/O."""

from tailrace.model.checkpoint import CheckpointError, load_pretrained, read_config, save_pretrained
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ModelConfig",
    "load_pretrained",
    "read_config",
    "save_pretrained",
]
