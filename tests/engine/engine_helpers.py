"""Tiny random models and request builders for the engine tests."""

from __future__ import annotations

import torch

from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM
from tailrace.types import GenRequest, SamplingParams

VOCAB = 97


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **kw) -> CausalLM:
    return CausalLM.from_config(tiny_config(**kw), seed=seed).eval()


def prompt(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())


def req(
    rid: str,
    n_prompt: int,
    max_new: int,
    seed: int | None = None,
    version: int = 0,
    pseed: int | None = None,
    **params,
) -> GenRequest:
    """A request whose prompt (and seed, unless given) derive from its id, or from `pseed`."""
    h = sum(map(ord, rid)) if pseed is None else pseed
    return GenRequest(
        rid,
        prompt(h, n_prompt),
        SamplingParams(max_new_tokens=max_new, seed=h if seed is None else seed, **params),
        version=version,
    )


@torch.no_grad()
def full_logprobs(model: CausalLM, prompt_ids, token_ids, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of a full-sequence forward at each generated token."""
    ids = torch.tensor([tuple(prompt_ids) + tuple(token_ids)])
    logits = model(ids)[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1).tolist()
