"""`CausalLM`: a Llama/Mistral/Mixtral/Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE/OLMo2/OLMo3/OLMoE/SmolLM3/Phi-3/Granite/
Granite MoE/Gemma 2/Gemma 3-family decoder in plain PyTorch.

Parameter names equal transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3(Moe)ForCausalLM /
Olmo2ForCausalLM / Olmo3ForCausalLM / OlmoeForCausalLM / SmolLM3ForCausalLM / GraniteForCausalLM /
Gemma2/3ForCausalLM checkpoints', so state_dicts map 1:1 (Phi3ForCausalLM's fused projections split and
join: `fused.py`; an MoE's experts one matrix each, as on disk, where transformers 5 stacks them in
memory, and Mixtral's and Granite's on-disk names, as ours: `moe.as_ours`, `moe.to_disk`).

The forward runs whole sequences with causal attention. Callers right-pad batches, so no padding mask
is needed (a real token never attends to a later pad). Autograd and bf16 autocast work; with
`gradient_checkpointing` set, a forward under autograd keeps each layer's input alone and the backward
runs the layer again (`recomputed`): a token's activations cost about a layer's worth, not all of them
(`trainer/memory.py`), for one more forward of the layers. There is no
cached path here: incremental decoding over a KV cache is the engine's (`tailrace.engine.backends`),
and tests pin it to this forward's logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.model.attention import Attention, CausalStep, RMSNorm
from tailrace.model.config import ModelConfig
from tailrace.model.moe import SparseMoE
from tailrace.model.rope import Rotary


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Gemma's GeGLU: gelu (tanh approximation) for silu."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        """`width`: the gate's and up's outputs (default intermediate_size; an MoE expert's is its own)."""
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.act = act_fn(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def act_fn(cfg: ModelConfig):
    """The MLP's activation of its gate: SiLU, or Gemma's GELU (tanh approximation, transformers'
    gelu_pytorch_tanh)."""
    return F.silu if cfg.hidden_act == "silu" else functools.partial(F.gelu, approximate="tanh")


class DecoderLayer(nn.Module):
    """Pre-norm (Llama's): x + attn(norm(x)), then x + mlp(norm(x)). Post-norm (OLMo2's, HF's names:
    `post_attention_layernorm` normalizes the attention's output, `post_feedforward_layernorm` the
    MLP's; no `input_layernorm`): x + norm(attn(x)), then x + norm(mlp(x)). Gemma's, both:
    x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (the MLP's first norm `pre_feedforward_layernorm`)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        """Layer `index` of the model (SmolLM3's RoPE is per layer; a windowed layer attends to its window;
        OLMo3's and Gemma 3's sliding layers rotate by a table of their own: `local`)."""
        super().__init__()
        self.self_attn = Attention(cfg, cfg.rope_at(index), cfg.window_at(index))
        self.local = cfg.local_at(index)
        self.residual = cfg.residual_multiplier  # Granite's: each output's weight into the residual
        # a mixture of experts' sparse layers: a router and experts, a shared one too in Qwen2-MoE (model/moe.py)
        self.mlp = SparseMoE(cfg, functools.partial(MLP, cfg)) if cfg.moe_at(index) else MLP(cfg)
        self.post_norms, self.sandwich = post, sandwich = cfg.post_norms, cfg.gemma

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale_fp32=post, offset=cfg.norm_offset)

        if post or sandwich:
            self.post_feedforward_layernorm = norm()
        if not post:
            self.input_layernorm = norm()
        if sandwich:
            self.pre_feedforward_layernorm = norm()
        self.post_attention_layernorm = norm()

    def forward(self, x: torch.Tensor, step: CausalStep) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, step))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.residual != 1.0:
            x = x + self.self_attn(self.input_layernorm(x), step) * self.residual
            return x + self.mlp(self.post_attention_layernorm(x)) * self.residual
        x = x + self.self_attn(self.input_layernorm(x), step)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # no init of its own (callers load weights or init them, from_config): nn.Embedding's normal_ on
        # the meta device (load_pretrained) imports torch._dynamo, 2 s of every process's start-up
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, scale_fp32=cfg.post_norms, offset=cfg.norm_offset
        )


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)  # buffers only, none persistent: not part of the state_dict
        self.local_rotary = local_rotary(cfg)  # OLMo3's sliding layers' (None: they use `rotary`)
        self.gradient_checkpointing = False  # the trainer's train.gradient_checkpointing (`recomputed`)
        self.tie_weights()

    @classmethod
    def from_config(cls, cfg: ModelConfig, seed: int | None = None) -> "CausalLM":
        """Initialized as HF does: linear and embedding weights ~ N(0, initializer_range), biases 0,
        norms 1 (Gemma's weights 0: it scales by 1 + them), and the embedding's pad row 0."""
        model = cls(cfg)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = cfg.initializer_range
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and not (
                    cfg.tie_word_embeddings and module is model.lm_head
                ):
                    module.weight.normal_(0.0, std, generator=gen)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, std, generator=gen)
                    if cfg.pad_token_id is not None:
                        module.weight[cfg.pad_token_id].zero_()
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0 - module.offset)
        return model

    def tie_weights(self) -> None:
        """Share one Parameter between lm_head and the embedding when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied weight counts once

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V); positions (B, T) default arange(T) per row."""
        x = embed(self.model.embed_tokens(input_ids), self.config)  # (B, T, hidden)
        x = run_layers(
            self.model.layers, x, self.rotary, self.local_rotary, input_ids.shape[1], positions,
            recompute=self.gradient_checkpointing and torch.is_grad_enabled(),
        )  # fmt: skip
        return logits(self.lm_head(self.model.norm(x)), self.config)


def embed(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The embeddings as the layers take them: times Granite's embedding_multiplier (in their dtype), or
    Gemma's sqrt(hidden_size) rounded to their dtype first, as transformers' scaled embedding."""
    if cfg.gemma:
        return x * torch.tensor(cfg.hidden_size**0.5).to(x.dtype)
    return x if cfg.embedding_multiplier == 1.0 else x * cfg.embedding_multiplier


def logits(y: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The LM head's output as the model's logits: divided by Granite's logits_scaling; capped by Gemma 2's
    final_logit_softcapping c (c tanh(y / c))."""
    if (c := cfg.final_logit_softcapping) is not None:
        return torch.tanh(y / c) * c
    return y if cfg.logits_scaling == 1.0 else y / cfg.logits_scaling


def local_rotary(cfg: ModelConfig) -> Rotary | None:
    """The RoPE table of OLMo3's sliding layers, where theirs is not the full layers' (None)."""
    return Rotary(cfg.local()) if cfg.local_rope is not None else None


def run_layers(
    layers,
    x: torch.Tensor,
    rotary: Rotary,
    local: Rotary | None,
    T: int,
    positions: torch.Tensor | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """x (B, T, hidden) through `layers`, each attending causally with RoPE by `rotary` (a `local` layer's
    by `local`, where given), at positions arange(T), or `positions` (B, T); `recompute`: each layer
    `recomputed` in the backward (gradient checkpointing)."""

    def step(r: Rotary) -> CausalStep:
        if positions is None:
            return CausalStep(*r.prefix(T))
        return CausalStep(*r.lookup(positions, int(positions.max()) + 1))

    full = step(rotary)
    near = step(local) if local is not None else full
    for layer in layers:
        step_ = near if layer.local else full
        x = recomputed(layer, x, step_) if recompute else layer(x, step_)
    return x


def recomputed(layer: DecoderLayer, x: torch.Tensor, step: CausalStep) -> torch.Tensor:
    """layer(x, step), autograd keeping only x (and the step's tables): the backward runs the layer again
    to get what it needs (torch's non-reentrant checkpoint, which also restores the autocast state). A
    mixture of experts takes the same experts in the second run as in the first (routing replay's or its
    own: a near-tie cannot flip between the two) and counts nothing twice (`SparseMoE.kept`)."""
    from torch.utils.checkpoint import checkpoint  # not at import: a process that never trains skips it

    moe = layer.mlp if isinstance(layer.mlp, SparseMoE) else None
    if moe is None:
        return checkpoint(layer, x, step, use_reentrant=False)
    kept: list[torch.Tensor] = []

    def run(x: torch.Tensor) -> torch.Tensor:
        if kept:  # the backward's run: the first run's experts
            moe.again = kept[0]
        else:
            moe.kept = kept
        try:
            return layer(x, step)
        finally:
            moe.kept = moe.again = None

    return checkpoint(run, x, use_reentrant=False)
