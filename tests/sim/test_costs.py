"""The cost model against roofline numbers computed by hand from datasheets and config.json shapes."""

import dataclasses
import math

import pytest

from tailrace.sim.costs import CostModel
from tailrace.sim.hardware import GPUS
from tailrace.sim.models import MODELS

H100 = GPUS["h100"]  # 989e12 FLOP/s, 3.35e12 B/s, bw_eff 0.75, flops_eff 0.5, 3 ms per step
Q7 = MODELS["qwen2.5-7b"]
# Qwen2.5-7B by hand: attention 3584*3584*2 + 3584*512*2 + bias 4608 = 29,364,736; MLP 3*3584*18944 =
# 203,685,888; 28 layers + LM head 152064*3584 -> 7,070,414,848 parameters read per token.
Q7_MATMUL = 7_070_414_848
Q7_KV = 2 * 28 * 4 * 128 * 2  # bytes of K and V per token (bf16) = 57,344
Q7_ATTN = 4 * 28 * 28 * 128  # attention FLOPs per (query, context) token pair = 401,408


def test_shape_counts_match_hand_computation():
    assert Q7.matmul_params == Q7_MATMUL
    assert Q7.kv_bytes_per_token(2) == Q7_KV
    assert Q7.attn_flops_per_context_token == Q7_ATTN
    assert Q7.params == pytest.approx(7.6156e9, rel=1e-4)  # published: 7.61B
    assert MODELS["qwen2.5-32b"].params == pytest.approx(
        32.76e9, rel=1e-3
    )  # published: 32.5B (non-tied head)
    moe = MODELS["qwen3-235b-a22b"]
    assert moe.params == pytest.approx(235.1e9, rel=1e-3) and moe.active_params == pytest.approx(
        22.19e9, rel=1e-3
    )
    shared = MODELS["qwen1.5-moe-a2.7b"]  # its shared expert counted in both: published 14.3B and 2.7B
    assert shared.params == pytest.approx(14.316e9, rel=1e-3)
    assert shared.active_params == pytest.approx(2.689e9, rel=1e-3)
    # a decode step at batch 1 reads the router, the shared expert and 4 of 60 experts a layer, and more
    # experts as the batch grows, the shared one always
    one, every = shared.weight_bytes_read(1, 2), shared.weight_bytes_read(10**6, 2)
    skipped = 151936 * 2048 + 24 * 2 * 2048 + 2048  # the input embeddings (looked up) and the norms
    assert one == pytest.approx((shared.active_params - skipped) * 2, rel=1e-9)
    assert every == pytest.approx((shared.params - skipped) * 2, rel=1e-9)


def test_decode_step_memory_bound_at_batch_one():
    cost = CostModel(H100, Q7)
    mem = (Q7_MATMUL * 2 + Q7_KV * 1000) / (3.35e12 * 0.75)  # 5.651 ms
    flops = (2 * Q7_MATMUL + Q7_ATTN * 1000) / (989e12 * 0.5)  # 0.029 ms
    assert mem > flops
    assert cost.decode_step_time(1, 1000) == pytest.approx(mem + 3e-3, rel=1e-12)
    assert cost.decode_step_time(1, 1000) == pytest.approx(8.651e-3, rel=1e-3)


def test_decode_step_compute_bound_at_large_batch():
    cost = CostModel(H100, Q7)
    B, ctx = 4096, 4096 * 500
    mem = (Q7_MATMUL * 2 + Q7_KV * ctx) / (3.35e12 * 0.75)
    flops = (2 * Q7_MATMUL * B + Q7_ATTN * ctx) / (989e12 * 0.5)
    assert flops > mem
    assert cost.decode_step_time(B, ctx) == pytest.approx(flops + 3e-3, rel=1e-12)


def test_tensor_parallel_scales_bandwidth_and_adds_allreduces():
    one, four = CostModel(H100, Q7, engine_gpus=1), CostModel(H100, Q7, engine_gpus=4)
    mem1 = one.decode_step_time(1, 0) - 3e-3
    assert four.decode_step_time(1, 0) == pytest.approx(mem1 / 4 + 3e-3 + 2 * 28 * 10e-6, rel=1e-12)


def test_multi_version_batch_runs_one_forward_per_version():
    cost = CostModel(H100, Q7)
    seg = cost.decode_segment({0: (8, 8000), 1: (8, 8000)})
    assert seg.step_time(0) == pytest.approx(2 * cost.decode_step_time(8, 8000), rel=1e-12)


def test_moe_reads_more_experts_as_the_batch_grows():
    moe = MODELS["qwen3-235b-a22b"]
    assert moe.expert_fraction(1) == pytest.approx(8 / 128)
    assert moe.expert_fraction(256) > 0.99
    assert moe.weight_bytes_read(1, 2) < moe.weight_bytes_read(256, 2) <= moe.params * 2


def test_train_time_is_6N_plus_attention_at_the_stated_mfu():
    cost = CostModel(H100, Q7, trainer_gpus=8, recompute_logprobs=False)
    flops = 6 * Q7_MATMUL * 1000 + 3 * Q7_ATTN * 1000**2 / 2
    assert cost.train_time([1000]) == pytest.approx(flops / (8 * 989e12 * 0.35) + 1.0, rel=1e-12)
    with_recompute = CostModel(H100, Q7, trainer_gpus=8, recompute_logprobs=True)
    assert with_recompute.train_flops([1000]) == pytest.approx(flops * 8 / 6, rel=1e-12)
    # PPO's step: 2 mini-batches x 3 epochs, the kept logprobs' forward once
    ppo = CostModel(H100, Q7, trainer_gpus=8, recompute_logprobs=True, train_updates=6, train_epochs=3)
    assert ppo.train_time([1000]) == pytest.approx(flops * 20 / 6 / (8 * 989e12 * 0.35) + 6.0, rel=1e-12)
    # and with a critic: its values' forward (2) and its own 6 a pass; its optimizer's overhead each update
    gae = CostModel(
        H100, Q7, trainer_gpus=8, recompute_logprobs=True, train_updates=6, train_epochs=3, critic=True
    )
    assert gae.train_time([1000]) == pytest.approx(flops * 40 / 6 / (8 * 989e12 * 0.35) + 12.0, rel=1e-12)
    # gradient checkpointing: each pass's forward again, the policy's and the critic's (2 each, x 3 passes)
    ckpt = dataclasses.replace(gae, gradient_checkpointing=True)
    assert ckpt.train_flops([1000]) == pytest.approx(flops * 52 / 6, rel=1e-12)
    # a KL penalty: the reference's forward each pass (2 x 3)
    kl = dataclasses.replace(gae, reference=True)
    assert kl.train_flops([1000]) == pytest.approx(flops * 46 / 6, rel=1e-12)
    with pytest.raises(ValueError, match="train_epochs"):
        CostModel(H100, Q7, train_updates=2, train_epochs=3)


def test_weight_sync_from_model_bytes_and_link_bandwidth():
    cost = CostModel(GPUS["h800"], MODELS["qwen2.5-32b"], engine_gpus=4, trainer_gpus=32)
    bytes_ = MODELS["qwen2.5-32b"].params * 2
    assert cost.load_time() == pytest.approx(2.0 + bytes_ / (4 * 50e9), rel=1e-12)  # 400 Gb/s NIC per GPU
    assert cost.publish_time() == pytest.approx(bytes_ / (8 * 200e9), rel=1e-12)  # H800 NVLink 400 GB/s total


def test_a_broadcast_tree_costs_a_chunk_per_level_and_a_flat_send_shares_the_trainers_nics():
    """256 engines of 4 GPUs (1,024 with the trainer's): the tree's bytes cross each link once, plus 8
    levels of a 4 MiB chunk and a hop's latency; flat, the trainer's 32 NICs split over 256 copies."""
    import dataclasses

    from tailrace.sim.costs import BROADCAST_CHUNK

    one = CostModel(GPUS["h800"], MODELS["qwen2.5-32b"], engine_gpus=4, trainer_gpus=32)
    tree = dataclasses.replace(one, engines=256)
    flat = dataclasses.replace(one, engines=256, broadcast="flat")
    bytes_, link = MODELS["qwen2.5-32b"].params * 2, 4 * 50e9
    assert tree.load_time() == pytest.approx(
        one.load_time() + 8 * (BROADCAST_CHUNK / link + 20e-6), rel=1e-12
    )
    assert flat.load_time() == pytest.approx(2.0 + bytes_ / (32 * 50e9 / 256), rel=1e-12)
    assert flat.load_time() - 2.0 > 30 * (tree.load_time() - 2.0)  # the transfer, past the fixed 2 s
    assert (
        dataclasses.replace(one, engines=2, broadcast="flat").load_time() == one.load_time()
    )  # NICs to spare


def test_prefill_is_compute_bound_for_long_prompts():
    cost = CostModel(H100, Q7)
    flops = 2 * Q7_MATMUL * 8192 + Q7_ATTN * 8192**2 / 2
    assert cost.prefill_time([8192]) == pytest.approx(flops / (989e12 * 0.5) + 3e-3, rel=1e-12)


def test_kv_capacity():
    cost = CostModel(H100, Q7)
    free = 80e9 * 0.9 - Q7.params * 2
    assert cost.kv_capacity_tokens() == math.floor(free / Q7_KV)


def test_padded_micro_batches_match_tailraces_trainer():
    """The trainer cost of the cpu testbed pads rows like tailrace's trainer forms its micro-batches."""
    import random

    from tailrace.trainer.batch import TrainBatch
    from tailrace.types import Finish, GenResult, Group, Trajectory

    rng = random.Random(0)
    groups = []
    for g in range(16):
        trajs = []
        for i in range(8):
            n = max(1, int(rng.lognormvariate(4, 1)))
            res = GenResult(f"{g}.{i}.0", (5,) * n, (0.0,) * n, (0,) * n, Finish.STOP)
            trajs.append(Trajectory(g, i, g, (1,) * rng.randint(5, 30), res, 0.0, False))
        groups.append(Group(g, g, tuple(trajs), advantages=(1.0,) * 8))
    batch = TrainBatch.from_groups(groups, trainer_version=0, token_scale=lambda mask, m: mask.float())
    real = sorted(int(mb.lengths.max()) for mb in batch.micro_batches(2048) for _ in range(mb.num_seqs))
    cost = CostModel(GPUS["h100"], Q7, micro_batch_tokens=2048)
    assert sorted(cost.padded([int(x) for x in batch.lengths])) == real


def test_a_lora_run_moves_its_adapter_and_trains_without_the_base_weight_gradients():
    """cluster.lora_rank: a version is r x (in + out) per projection and layer (Qwen2.5-7B at r = 8, by
    hand: per layer (3584 + 3584) x 2 + (3584 + 512) x 2 + (3584 + 18944) x 3 = 90,112, x 8 x 28 layers
    x 2 bytes = 40.4 MB), so its sync and its resident cost shrink; the step's matmul FLOPs fall from
    8 to 6 a parameter and token (recomputed old policy included), 6 to 4 without."""
    import dataclasses

    full = CostModel(GPUS["h800"], Q7, trainer_gpus=8)
    lora = dataclasses.replace(full, lora_rank=8)
    assert lora.version_bytes == 90_112 * 8 * 28 * 2 and full.version_bytes == full.weight_bytes
    assert lora.weight_bytes == full.weight_bytes  # the base is still resident, once
    assert lora.load_time() - GPUS["h800"].sync_fixed_s < (full.load_time() - GPUS["h800"].sync_fixed_s) / 300
    assert lora.version_kv_tokens() == int(lora.version_bytes / Q7_KV)
    rows = [512, 1024, 2048]
    assert lora.train_flops(rows) == pytest.approx(full.train_flops(rows) * 6 / 8, rel=1e-12)
    no_re = dataclasses.replace(lora, recompute_logprobs=False)
    assert no_re.train_flops(rows) == pytest.approx(full.train_flops(rows) * 4 / 8, rel=1e-12)


def test_an_moe_config_json_as_tailrace_and_transformers_5_write_it_is_its_shape():
    """Qwen3-MoE's, Qwen2-MoE's, OLMoE's and Mixtral's config.json (the experts `num_experts`, or transformers 5's and
    Mixtral's `num_local_experts`; OLMoE's and Mixtral's experts intermediate_size wide): the shape counts
    the model's own parameters, every expert's and the router's (the q/k norms aside: under 0.3%)."""
    from tailrace.model import CausalLM, ModelConfig
    from tailrace.sim.scenario import shape_from_hf

    families = (
        ("qwen3_moe", dict(moe_intermediate_size=24)),
        (
            "qwen2_moe",
            dict(moe_intermediate_size=24, shared_expert_intermediate_size=40),
        ),  # its shared expert
        ("olmoe", {}),
        ("mixtral", {}),
        ("granitemoe", {}),
    )
    for family, extra in families:
        shape = dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
        )
        cfg = ModelConfig(
            model_type=family, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **shape, **extra
        )
        d = cfg.to_hf()
        ours = CausalLM(cfg).num_parameters()
        for spelled in (d, {**{k: v for k, v in d.items() if k != "num_experts"}, "num_local_experts": 4}):
            assert shape_from_hf(spelled, family).params == pytest.approx(ours, rel=3e-3), family
