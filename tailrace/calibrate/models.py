"""The models and trainers calibration measures: the default model's shape with random weights
(they cost what trained ones do), in the dtype of the preset."""

from __future__ import annotations

import torch

from tailrace.config import ArchConfig, TrainerConfig
from tailrace.model.decoder import CausalLM
from tailrace.runtime.warmstart import model_config
from tailrace.tokenizer import char_tokenizer
from tailrace.trainer.grpo import GRPOTrainer

DTYPES = {"float32": (torch.float32, "cpu", 4), "bfloat16": (torch.bfloat16, "cpu-bf16", 2)}


def random_model(cfg: ArchConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    tok = char_tokenizer()
    return CausalLM.from_config(model_config(cfg, tok.vocab_size, tok), seed=0).to(dtype)


def random_trainer(cfg: ArchConfig, dtype: torch.dtype) -> GRPOTrainer:
    """The runtime's trainer: fp32 weights, the forward autocast to bf16 for a bf16 run."""
    return GRPOTrainer(random_model(cfg), TrainerConfig(bf16=dtype == torch.bfloat16))
