"""How many tokens a training micro-batch may hold: an activation-memory budget over what autograd keeps
per token.

A fixed `train.micro_batch_tokens` that suits one model is wrong for the next: 8,192 tokens took ~10 GB
of activations on SmolLM2-135M in fp32 and would take ~48 GB on a 1.7B model. By default the budget is
`ACTIVATION_FRACTION` of the memory available when the trainer starts, less the gradient and AdamW's
two moments it has yet to allocate (12 bytes a parameter), or `train.memory_gb` GiB when given; the
micro-batch holds as many tokens as the budget pays for at `activation_bytes_per_token`, between
`MIN_TOKENS` and `MAX_TOKENS` (a row longer than the micro-batch still goes alone).

The per-token cost is a fit to peak resident memory of whole `GRPOTrainer.step` calls on CPU (64 rows
of 72 tokens, micro-batches of ~1,000 and ~4,000 tokens, the slope between them), on SmolLM2-135M
(hidden 576, MLP 1536, 30 layers, vocab 49152) and a random Llama (1024, 2816, 4 layers, vocab 32000):
per layer, the elements of 8 hidden-wide, 4 KV-wide and 4 MLP-wide activations at `_LAYER_BYTES`
bytes each, plus `_VOCAB_BYTES` a vocabulary entry (the logits: the log-softmax keeps no copy of its
own, see `logprobs`), times `MARGIN`. Measured: SmolLM2 fp32 1.90 MiB a token, bf16 1.26; the random
model fp32 0.47, bf16 0.30. Two of the hidden-wide ones are the queries' and the attention output's
width, heads x head_dim, which Qwen3 makes twice the hidden size; its q/k norms keep
`_QK_NORM_BYTES` per element of q and k more. Measured on a 4-layer model of Qwen3-0.6B's attention
(hidden 512, 8 heads of 128, 4 kv heads, MLP 1536, vocab 4096; 2026-12-05): 292 KiB a token fp32 and
306 bf16 as Llama, 338 and 322 as Qwen3; a later run of the same script (Xeon VM) 242 / 256 as Llama,
359 / 398 as Qwen3 and 371 / 318 as OLMo2 (post-norms, q/k normed over all heads), which this estimate
(430 / 347 for both) covers.

A bf16 step on CPU attends eagerly up to `EAGER_MAX_T` tokens (`tailrace.model.attention`), and
autograd keeps its probabilities: `eager_attention_bytes` adds, per layer, 6 bytes (the fp32 softmax
output and its bf16 copy) x heads x `EAGER_MAX_T` plus the fp32 copies of q and k (4 bytes x (heads +
kv heads) x head_dim), the longest such sequence's cost. Measured on SmolLM2's shape (bf16, slope
of peak resident memory between 1,024- and 4,096-token micro-batches, 2026-12-02): over SDPA's 1.43 MiB
a token, eager adds 0.22 MiB at T = 192 and 0.15 at T = 72; the estimate adds 0.38 (x `MARGIN`).
Gemma's layer (four norms, each scaling by 1 + w in fp32 whatever the dtype, and GeGLU) keeps
`_GEMMA_NORM_BYTES` a hidden element more, fp32 or bf16: on that shape as Gemma 3 (with its q/k norms)
it measured 389 KiB a token fp32 and 367 bf16 against Llama's 290 and 272 in the same runs (2026-12-06,
`bench/model_memory.py trainer`, Xeon VM), which the estimate (490 / 407) covers.
A mixture of experts (Qwen3-MoE) keeps, a sparse layer, each of a token's k experts' four activations and
its input and output (`mlp_elements`): on that shape as Qwen3-MoE with Qwen3-30B-A3B's proportions (16
experts of width 384, 4 a token: the dense MLP's active width) it measured 369 KiB a token fp32 against
Llama's 285 in the same runs (2026-12-06, `bench/model_memory.py trainer`, Xeon VM), which the estimate
(543, its q/k norms included) covers; bf16's slope measured 233 (its fixed cost larger), the estimate 424.
Gemma 2 caps its attention scores (tanh), which SDPA cannot, so it attends eagerly at every length, in
fp32 and bf16: its budget pays for sequences of up to `SOFTCAP_T` tokens (or its context, if shorter);
a micro-batch of longer rows keeps more than it pays for (not measured).

Gradient checkpointing (train.gradient_checkpointing, `decoder.recomputed`) keeps each layer's input
(hidden fp32 elements) and, in the backward, one layer's activations at a time. Measured (fp32, `bench/
model_memory.py trainer llama --layers N --recompute`, Llama layers of the shape above, 2026-12-07, Xeon
VM): 139, 187 and 281 KiB a token at 4, 8 and 16 layers against 266, 518 and 948 without: 11.8 KiB a
layer, 23.6 bytes a hidden element, where the inputs are 4. The rest is glibc's: run with a fixed mmap
threshold (MALLOC_MMAP_THRESHOLD_=262144) the 16-layer model measured 62 KiB a token (779 without), the
tensors alive; by default a freed buffer of a layer's recompute stays in the heap, which the resident
peak counts. So a layer costs `_RESIDUAL_BYTES` (24) a hidden element, plus one layer's activations and
the logits' (157, 217 and 337 KiB a token at 4, 8 and 16 layers, with `MARGIN`). bf16 (16 layers only):
310 KiB a token against 851 without; at 28 bytes the estimate is 363.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailrace.model.attention import EAGER_MAX_T
from tailrace.model.config import ModelConfig

ACTIVATION_FRACTION = 0.3  # of the memory available at start (the engines' KV takes up to 0.4 of it)
MIN_TOKENS, MAX_TOKENS = 256, 8192  # at most the fixed size of before: the built-in model is unchanged
MARGIN = 1.25
UNSIZED_TOKENS = MAX_TOKENS  # for a model without a ModelConfig
_LAYER_BYTES = {False: 5.6, True: 3.8}  # by train.bf16 (autocast keeps bf16 copies of GEMM inputs)
_VOCAB_BYTES = {False: 1.2, True: 0.5}
_QK_NORM_BYTES = {False: 8, True: 3}  # measured 7.6 and 2.6 (the module's docstring)
_GEMMA_NORM_BYTES = 24  # a hidden element a layer, fp32 or bf16 (the module's docstring)
_RESIDUAL_BYTES = {False: 24, True: 28}  # a hidden element a layer, gradient checkpointing (docstring)
GIB = 1 << 30
SOFTCAP_T = 4096  # the longest sequence a softcapped model's (Gemma 2's) budget pays eager attention for


def activation_bytes_per_token(
    cfg: ModelConfig, bf16: bool, cpu: bool = False, recompute: bool = False
) -> int:
    """What one more token in a micro-batch adds to the step's peak memory (with `MARGIN`); `cpu`: the
    step runs on CPU (where bf16 attends eagerly); `recompute`: gradient checkpointing, each layer's
    input kept (`_RESIDUAL_BYTES` a hidden element) and one layer's activations at a time, rebuilt in
    the backward."""
    L = cfg.num_hidden_layers
    layers = (
        L * cfg.hidden_size * _RESIDUAL_BYTES[bf16] + max(_layer_bytes(cfg, i, bf16, cpu) for i in range(L))
        if recompute
        else sum(_layer_bytes(cfg, i, bf16, cpu) for i in range(L))
    )
    return int(MARGIN * (layers + cfg.vocab_size * _VOCAB_BYTES[bf16]))


def _layer_bytes(cfg: ModelConfig, layer: int, bf16: bool, cpu: bool) -> float:
    """What layer `layer` keeps a token, unscaled (`activation_bytes_per_token`)."""
    kv = cfg.num_key_value_heads * cfg.head_dim  # ModelConfig fills both when a checkpoint omits them
    q = cfg.num_attention_heads * cfg.head_dim  # the hidden size, but for Qwen3-style wide heads
    raw = (6 * cfg.hidden_size + 2 * q + 4 * kv + mlp_elements(cfg, layer)) * _LAYER_BYTES[bf16]
    if cfg.qk_norm or cfg.qk_norm_wide:  # Qwen3's per-head q/k norms; OLMo2's over all heads keep as much
        raw += (q + kv) * _QK_NORM_BYTES[bf16]
    if cfg.gemma:  # four norms a layer, each scaling in fp32 whatever the dtype (the module docstring)
        raw += cfg.hidden_size * _GEMMA_NORM_BYTES
    if cfg.attn_logit_softcapping is not None:  # Gemma 2's: SDPA cannot cap, every length attends eagerly
        raw += eager_attention_bytes(cfg, min(cfg.context_limit, SOFTCAP_T)) / cfg.num_hidden_layers
    elif bf16 and cpu:
        raw += eager_attention_bytes(cfg) / cfg.num_hidden_layers
    return raw


def mlp_elements(cfg: ModelConfig, layer: int) -> int:
    """The MLP activations of layer `layer` a token keeps, in elements: a dense MLP's 4 of its width; a
    mixture of experts' (Qwen3-MoE's sparse layers) 4 of an expert's width for each of the token's k
    experts, the k copies of its input gathered and of its output before the routing weight (2 hidden-wide
    each), and the router's logits and probabilities (measured: the module's docstring); Qwen2-MoE's shared
    expert a dense MLP's 4 of its width, and its output before and after its gate (2 hidden-wide)."""
    if not cfg.moe_at(layer):
        return 4 * cfg.intermediate_size
    k, s = cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size
    shared = 4 * s + 2 * cfg.hidden_size if s else 0
    return k * (4 * cfg.moe_intermediate_size + 2 * cfg.hidden_size) + 2 * cfg.num_experts + shared


def eager_attention_bytes(cfg: ModelConfig, longest: int = EAGER_MAX_T) -> int:
    """What eager attention keeps a token, over all layers, at its longest sequence (`EAGER_MAX_T`, or
    `longest`: its probabilities grow with the length, 6 bytes x heads a position)."""
    heads = cfg.num_attention_heads
    per_layer = 6 * heads * longest + 4 * (heads + cfg.num_key_value_heads) * cfg.head_dim
    return cfg.num_hidden_layers * per_layer


@dataclass(frozen=True)
class MicroBatch:
    tokens: int  # rows x padded length per forward
    per_token: int  # bytes, estimated
    budget: int | None  # bytes; None when train.micro_batch_tokens was given
    source: str  # where the size came from, for the start-up line
    short: str | None = None  # the optimizer state alone outgrows the memory available: a warning
    recompute: str | None = None  # gradient checkpointing is on: why (the start-up line); None: off

    def describe(self) -> str:
        est = f"~{self.per_token / (1 << 20):.2f} MiB of activations a token"
        ckpt = f"; gradient checkpointing ({self.recompute})" if self.recompute else ""
        if not self.per_token:
            return f"micro-batches of up to {self.tokens:,} tokens ({self.source}){ckpt}"
        if self.budget is None:
            return f"micro-batches of up to {self.tokens:,} tokens ({self.source}; {est}){ckpt}"
        return (
            f"micro-batches of up to {self.tokens:,} tokens: {self.budget / GIB:.2f} GiB of activations "
            f"({self.source}) at {est}{ckpt}"
        )


def rank_share(available: int, world: int, shared: bool, trainers: int = 1) -> int:
    """The memory one of `world` data-parallel ranks of one of `trainers` trainers (a run of several
    policies: one each, on one machine) may plan with: each trainer its 1/trainers part, and of that, on
    a host whose memory the ranks all share (CPU: train.world_size starts every rank on this machine)
    each rank its 1/world part, else (a GPU each) all of it. Each rank keeps its own weights, gradient
    and AdamW moments besides."""
    return available // trainers // (world if shared else 1)


def size_micro_batch(
    cfg: ModelConfig | None,
    bf16: bool,
    num_params: int,
    available: int,
    memory_gb: float | None = None,
    tokens: int | None = None,
    cpu: bool = False,
    recompute: bool | None = False,
    longest: int = 0,
) -> MicroBatch:
    """The micro-batch size: `tokens` when given (train.micro_batch_tokens), else what the budget
    (`memory_gb` GiB, or `ACTIVATION_FRACTION` of `available` bytes less 12 bytes a parameter) pays for.
    `recompute`: gradient checkpointing (train.gradient_checkpointing); None: on where the budget would
    not pay for one row of `longest` tokens (the run's longest: prompt and response) without it."""
    why = "train.gradient_checkpointing" if recompute else None
    if not isinstance(cfg, ModelConfig):  # not a tailrace CausalLM (a test's toy): nothing to size by
        source = "train.micro_batch_tokens" if tokens else "fixed"
        return MicroBatch(tokens or UNSIZED_TOKENS, 0, None, source, recompute=why)
    per_token = activation_bytes_per_token(cfg, bf16, cpu, bool(recompute))
    if tokens is not None:
        return MicroBatch(tokens, per_token, None, "train.micro_batch_tokens", recompute=why)
    short = None
    if memory_gb is not None:
        budget, source = int(memory_gb * GIB), "train.memory_gb"
    else:
        free = max(0, available - 12 * num_params)
        budget = int(ACTIVATION_FRACTION * free)
        source = f"{ACTIVATION_FRACTION:.0%} of {free / GIB:.2f} GiB available after the optimizer state"
        if available < 12 * num_params:
            short = (
                f"the trainer's gradients and AdamW moments need {12 * num_params / GIB:.1f} GiB and "
                f"{available / GIB:.1f} GiB are available: it will likely be killed for memory at its "
                "first step; train a LoRA adapter (--train.lora.rank=8) or free memory"
            )
    if recompute is None and budget < longest * per_token:  # one longest row would outgrow the budget
        why = f"the budget holds {budget // per_token:,} tokens without it, a row may hold {longest:,}"
        per_token = activation_bytes_per_token(cfg, bf16, cpu, recompute=True)
    tokens = MIN_TOKENS if short else min(MAX_TOKENS, max(MIN_TOKENS, budget // per_token))
    return MicroBatch(tokens, per_token, budget, source, short, why)
