"""The trainer's micro-batches sized by an activation budget (trainer/memory.py), hand-checked."""

from __future__ import annotations

import pytest
import torch

from tailrace.config import TrainerConfig
from tailrace.model import CausalLM
from tailrace.model.config import ModelConfig
from tailrace.trainer.grpo import GRPOTrainer
from tailrace.trainer.memory import GIB, MAX_TOKENS, MIN_TOKENS, activation_bytes_per_token, size_micro_batch

SMOLLM2 = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
)  # fmt: skip
MIB, KIB = 1 << 20, 1 << 10


def test_per_token_bytes_follow_the_shape_and_cover_the_measured_cost():
    # 30 layers x (8 x 576 + 4 x 3 x 64 + 4 x 1536) = 345,600 elements; x 5.6 B + 49,152 x 1.2 B, x 1.25
    assert activation_bytes_per_token(SMOLLM2, bf16=False) == int(1.25 * (345_600 * 5.6 + 49_152 * 1.2))
    assert activation_bytes_per_token(SMOLLM2, bf16=True) == int(1.25 * (345_600 * 3.8 + 49_152 * 0.5))
    # measured peaks (the module's docstring): 1.90 MiB a token in fp32, 1.26 in bf16; the margin covers them
    assert 1.90 * MIB < activation_bytes_per_token(SMOLLM2, False) < 1.3 * 1.90 * MIB
    assert 1.26 * MIB < activation_bytes_per_token(SMOLLM2, True) < 1.3 * 1.26 * MIB


def test_wide_heads_and_qwen3s_qk_norms_are_counted_and_cover_the_measured_cost():
    # 4 layers of Qwen3-0.6B's attention (8 heads of 128: q twice the hidden 512); trainer/memory.py's
    # docstring: measured 292 / 338 KiB a token fp32 (Llama / Qwen3), 306 / 322 bf16 on CPU
    shape = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)  # fmt: skip
    llama, qwen3 = ModelConfig(**shape), ModelConfig(model_type="qwen3", **shape)
    # per layer 6 x 512 + 2 x 1024 + 4 x 512 + 4 x 1536 elements; Qwen3: + (1024 + 512) x 8 B
    assert activation_bytes_per_token(llama, False) == int(1.25 * (4 * 13_312 * 5.6 + 4096 * 1.2))
    assert activation_bytes_per_token(qwen3, False) == int(
        1.25 * (4 * 13_312 * 5.6 + 4096 * 1.2 + 4 * 1536 * 8)
    )
    for cfg, fp32, bf16 in ((llama, 292, 306), (qwen3, 338, 322)):
        assert fp32 * 1024 < activation_bytes_per_token(cfg, False) < 1.4 * fp32 * 1024
        assert bf16 * 1024 < activation_bytes_per_token(cfg, True, cpu=True) < 1.4 * bf16 * 1024


def test_bf16_on_cpu_adds_what_eager_attention_keeps():
    # 30 layers x (6 B x 9 heads x 192 tokens + 4 B x (9 + 3) heads x 64); measured over SDPA's 1.43 MiB a
    # token: 1.65 MiB at T = 192 (trainer/memory.py's docstring), which the estimate covers
    eager = 30 * (6 * 9 * 192 + 4 * 12 * 64)
    assert activation_bytes_per_token(SMOLLM2, bf16=True, cpu=True) == int(
        1.25 * (345_600 * 3.8 + 49_152 * 0.5 + eager)
    )
    assert activation_bytes_per_token(SMOLLM2, bf16=False, cpu=True) == activation_bytes_per_token(
        SMOLLM2, False
    )
    assert 1.65 * MIB < activation_bytes_per_token(SMOLLM2, True, cpu=True) < 1.3 * 1.65 * MIB


def test_the_budget_sets_the_tokens_within_bounds():
    per = activation_bytes_per_token(SMOLLM2, bf16=True)
    m = size_micro_batch(SMOLLM2, True, 135_000_000, available=0, memory_gb=4.0)
    assert (m.tokens, m.budget) == (4 * GIB // per, 4 * GIB)  # 2,568 tokens
    assert "2,568 tokens: 4.00 GiB of activations (train.memory_gb)" in m.describe()
    # by default 30% of what is available once the gradient and AdamW's moments (12 B a parameter) are in
    m = size_micro_batch(SMOLLM2, True, 135_000_000, available=20 * GIB)
    assert m.budget == int(0.3 * (20 * GIB - 12 * 135_000_000))
    short = size_micro_batch(SMOLLM2, True, 135_000_000, available=GIB)
    assert short.tokens == MIN_TOKENS and m.short is None
    assert short.short == (
        "the trainer's gradients and AdamW moments need 1.5 GiB and 1.0 GiB are available: it will likely "
        "be killed for memory at its first step; train a LoRA adapter (--train.lora.rank=8) or free memory"
    )
    assert size_micro_batch(SMOLLM2, True, 135_000_000, available=1 << 50).tokens == MAX_TOKENS
    given = size_micro_batch(SMOLLM2, True, 135_000_000, available=0, memory_gb=4.0, tokens=1000)
    assert (given.tokens, given.budget) == (1000, None)


def test_the_trainer_splits_its_batch_by_the_budget():
    from tests.trainer.test_grpo import make_groups

    cfg = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    per = activation_bytes_per_token(cfg, bf16=False)
    small = GRPOTrainer(CausalLM.from_config(cfg, seed=0), TrainerConfig(memory_gb=MIN_TOKENS * per / GIB))
    big = GRPOTrainer(CausalLM.from_config(cfg, seed=0), TrainerConfig(memory_gb=1.0))
    assert (small.micro.tokens, big.micro.tokens) == (MIN_TOKENS, MAX_TOKENS)
    groups = make_groups(small.model, n_groups=40)
    n_small = small.step(groups, 0)["micro_batches"]
    n_big = big.step(groups, 0)["micro_batches"]
    assert n_small > n_big >= 1  # the cap, not padding alone, sets how many the small budget needs


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_budget_is_refused(bad):
    from tailrace.common import ConfigError

    with pytest.raises(ConfigError, match="train.memory_gb"):
        TrainerConfig(memory_gb=bad)


def test_data_parallel_ranks_on_one_host_split_its_memory():
    """N CPU ranks of train.world_size share the machine: each sizes its micro-batches from 1/N of the
    available memory (all of it sized as if alone over-committed the budget N times); a rank with a GPU
    of its own keeps all of it."""
    from tailrace.trainer.memory import rank_share

    assert rank_share(12 * GIB, 1, shared=True) == 12 * GIB
    assert rank_share(12 * GIB, 3, shared=True) == 4 * GIB
    assert rank_share(12 * GIB, 3, shared=False) == 12 * GIB
    # several policies' trainers on one machine: each its share first, then each of its ranks
    assert rank_share(12 * GIB, 1, shared=True, trainers=2) == 6 * GIB
    assert rank_share(12 * GIB, 3, shared=True, trainers=2) == 2 * GIB
    assert rank_share(12 * GIB, 3, shared=False, trainers=2) == 6 * GIB
    one = size_micro_batch(SMOLLM2, False, 135_000_000, available=rank_share(16 * GIB, 1, True))
    four = size_micro_batch(SMOLLM2, False, 135_000_000, available=rank_share(16 * GIB, 4, True))
    assert four.tokens < one.tokens and four.budget < one.budget / 4


def test_a_mixture_of_experts_counts_each_tokens_experts_and_covers_the_measured_cost():
    """Qwen3-MoE on bench/model_memory.py's shape (16 experts of 384, 4 a token; trainer/memory.py's
    docstring: measured 369 KiB a token fp32, 233 bf16 on CPU): a sparse layer keeps 4 x (4 x 384 + 2 x 512)
    + 2 x 16 MLP elements where the dense one (1536 wide) keeps 4 x 1536; a layer left dense
    (mlp_only_layers) is counted as dense."""
    shape = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)  # fmt: skip
    moe = dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384)
    qwen3, sparse = ModelConfig(model_type="qwen3", **shape), ModelConfig(**shape, **moe)
    extra = 4 * ((4 * (4 * 384 + 2 * 512) + 2 * 16) - 4 * 1536)
    dense = activation_bytes_per_token(qwen3, False)
    assert activation_bytes_per_token(sparse, False) == pytest.approx(dense + 1.25 * extra * 5.6, abs=2)
    assert 369 * KIB < activation_bytes_per_token(sparse, False, cpu=True) < 1.6 * 369 * KIB
    assert 233 * KIB < activation_bytes_per_token(sparse, True, cpu=True) < 2 * 233 * KIB
    half = ModelConfig(**shape, **moe, mlp_only_layers=(0, 1))
    assert activation_bytes_per_token(half, False) == pytest.approx(dense + 1.25 * extra / 2 * 5.6, abs=2)


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layers_activations():
    # 30 layers x 576 x 24 B (the inputs, and what glibc keeps) + one layer's 11,520 elements x 5.6 B +
    # 49,152 x 1.2 B, x 1.25; measured on 4, 8, 16 layers of another shape (trainer/memory.py's docstring)
    assert activation_bytes_per_token(SMOLLM2, False, recompute=True) == int(
        1.25 * (30 * 576 * 24 + 11_520 * 5.6 + 49_152 * 1.2)
    )
    assert (
        activation_bytes_per_token(SMOLLM2, False, recompute=True)
        < activation_bytes_per_token(SMOLLM2, False) / 3.5
    )
    # bench/model_memory.py's Llama shape at 4, 8 and 16 layers: measured 139, 187, 281 KiB a token
    for layers, measured in ((4, 139), (8, 187), (16, 281)):
        cfg = ModelConfig(
            vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True,
        )  # fmt: skip
        assert measured * KIB < activation_bytes_per_token(cfg, False, recompute=True) < 1.3 * measured * KIB
    # bf16 on CPU (eager attention), 16 layers: measured 310
    assert 310 * KIB < activation_bytes_per_token(cfg, True, cpu=True, recompute=True) < 1.3 * 310 * KIB


def test_null_turns_gradient_checkpointing_on_where_one_longest_row_outgrows_the_budget():
    plain = activation_bytes_per_token(SMOLLM2, bf16=False)
    budget_gb = 1000 * plain / GIB  # pays for 1,000 tokens without it
    off = size_micro_batch(
        SMOLLM2, False, 135_000_000, available=0, memory_gb=budget_gb, recompute=None, longest=900
    )
    assert off.recompute is None and off.tokens == 1000 and "gradient checkpointing" not in off.describe()
    on = size_micro_batch(
        SMOLLM2, False, 135_000_000, available=0, memory_gb=budget_gb, recompute=None, longest=3000
    )
    assert on.per_token == activation_bytes_per_token(SMOLLM2, False, recompute=True)
    assert on.tokens == int(budget_gb * GIB) // on.per_token > 3000  # 3,705: a longest row fits
    assert on.recompute == "the budget holds 1,000 tokens without it, a row may hold 3,000"
    assert "; gradient checkpointing (the budget holds 1,000 tokens" in on.describe()
    # false: off whatever the rows; true: on whatever the budget, and with micro_batch_tokens given
    forced_off = size_micro_batch(
        SMOLLM2, False, 1, available=0, memory_gb=budget_gb, recompute=False, longest=4096
    )
    assert forced_off.recompute is None and forced_off.tokens == 1000
    forced = size_micro_batch(SMOLLM2, False, 1, available=0, tokens=512, recompute=True)
    assert forced.recompute == "train.gradient_checkpointing" and forced.tokens == 512
    assert (
        size_micro_batch(SMOLLM2, False, 1, available=0, tokens=512, recompute=None, longest=10**6).recompute
        is None
    )


@pytest.mark.parametrize("advantage", [None, "gae"])
def test_a_step_with_gradient_checkpointing_moves_the_weights_as_one_without(advantage):
    """The trainer's step (and its critic's, under gae) with train.gradient_checkpointing gives the same
    weights and metrics, bit for bit, as the step without; the start-up line says it is on."""
    from tests.trainer.test_grpo import make_groups

    cfg = ModelConfig(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    trainers = [
        GRPOTrainer(
            CausalLM.from_config(cfg, seed=0),
            TrainerConfig(
                micro_batch_tokens=64, advantage=advantage, gradient_checkpointing=on, mini_batches=2
            ),
        )
        for on in (False, True)
    ]
    assert [t.model.gradient_checkpointing for t in trainers] == [False, True]
    assert "gradient checkpointing (train.gradient_checkpointing)" in trainers[1].micro.describe()
    if advantage:
        assert trainers[1].critic.model.gradient_checkpointing
    groups = make_groups(trainers[0].model, n_groups=4)
    got = [t.step(groups, 0) for t in trainers]
    assert got[0]["micro_batches"] > 2
    for k in ("loss", "grad_norm", "value_loss"):
        assert got[0].get(k) == got[1].get(k)
    a, b = (dict(t.model.named_parameters()) for t in trainers)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if advantage:
        a, b = (dict(t.critic.model.named_parameters()) for t in trainers)
        assert all(torch.equal(a[k], b[k]) for k in a)
