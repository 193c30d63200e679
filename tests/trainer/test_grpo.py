"""GRPOTrainer on a tiny causal stand-in model: accumulation, one step, metrics, checkpoints, weight sync."""

import copy
import dataclasses
import math
import random

import pytest
import torch
from torch import nn

from tailrace.config import ConfigError, LossConfig, TrainerConfig, load_config
from tailrace.trainer.advantages import ADVANTAGES
from tailrace.trainer.grpo import GRPOTrainer, NonFiniteError
from tailrace.trainer.logprobs import token_logprobs
from tailrace.types import Finish, GenResult, Group, Trajectory

V = 16


class TinyLM(nn.Module):
    """Causal by construction: position t sees the mean embedding of tokens 0..t."""

    def __init__(self, tie: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, 8)
        self.mix = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.lm_head = nn.Linear(8, V, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, 8)
        h = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, device=ids.device)[:, None]
        return self.lm_head(torch.tanh(self.mix(h)) * self.gain)  # (B, T, V)


@torch.no_grad()
def model_logprobs(model, prompt, resp):
    seq = torch.tensor([list(prompt) + list(resp)])
    lp = token_logprobs(model(seq[:, :-1]), seq[:, 1:])[0]
    return lp[len(prompt) - 1 :].tolist()


def make_groups(model, tv=0, n_groups=3, k=4, seed=0, noise=0.0, old_version_prefix=0):
    """Random trajectories; behaviour logprobs are the model's own (+ noise), all at version tv
    except the first `old_version_prefix` tokens of each response, which carry tv - 2."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for i in range(k):
            prompt = [rng.randrange(1, V) for _ in range(rng.randint(1, 4))]
            resp = [rng.randrange(1, V) for _ in range(rng.randint(1, 7))]
            lps = [x + noise * rng.gauss(0, 1) for x in model_logprobs(model, prompt, resp)]
            vers = [tv - 2 if j < old_version_prefix else tv for j in range(len(resp))]
            res = GenResult(f"{g}-{i}", tuple(resp), tuple(lps), tuple(vers), Finish.STOP)
            trajs.append(
                Trajectory(
                    group=g,
                    sample_index=i,
                    prompt_id=g,
                    prompt_ids=tuple(prompt),
                    result=res,
                    reward=float(i % 2 == 0),
                    correct=i % 2 == 0,
                )
            )
        groups.append(Group(id=g, prompt_id=g, trajectories=tuple(trajs)))
    return groups


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss", ["grpo", "dapo", "drgrpo", "gspo", "cispo"])
@pytest.mark.parametrize("correction", ["none", "behaviour", "decoupled", "tis", "icepop", "geo_mask"])
def test_micro_batch_accumulation_equals_full_batch(loss, correction):
    base = TinyLM()
    groups = make_groups(base, noise=0.3)  # behaviour != current: ratios move, some tokens clip or cap
    lc = dict(
        name=loss,
        correction=correction,
        kl_coef=0.1,
        max_new_tokens=8,
        tis_cap=1.3,
        ratio_low=0.8,
        ratio_high=1.25,
    )
    out = {}
    for mbt in (10_000, 9):
        model = copy.deepcopy(base)
        cfg = TrainerConfig(micro_batch_tokens=mbt, grad_clip=None, loss=LossConfig(**lc))
        tr = GRPOTrainer(model, cfg, ref_model=TinyLM(seed=1))
        m = tr.step(groups, trainer_version=0)
        out[mbt] = (m, grads(model))
    (m_full, g_full), (m_acc, g_acc) = out[10_000], out[9]
    assert m_full["micro_batches"] == 1 and m_acc["micro_batches"] > 4
    for n in g_full:
        torch.testing.assert_close(g_acc[n], g_full[n], atol=1e-6, rtol=0)
    for k in (
        "loss",
        "pg_loss",
        "kl",
        "clip_frac",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "entropy",
        "grad_norm",
        "dropped_frac",
        "is_ratio_mean",
        "is_ratio_max",
        "tokens",
    ):
        assert m_acc[k] == pytest.approx(m_full[k], abs=1e-6), k
    if correction == "behaviour":
        assert m_full["clip_frac"] > 0  # the case exercises clipping
    if correction in ("decoupled", "icepop", "geo_mask"):
        assert m_full["dropped_frac"] > 0  # the case exercises masking
    assert m_full["is_ratio_max"] > 1.25 > m_full["is_ratio_mean"] > 0.8


def test_step_changes_every_parameter_and_lowers_its_own_loss():
    model = TinyLM()
    groups = make_groups(model, tv=5)
    # anchor = behaviour = the pre-step policy, so evaluate() after the step measures the same surrogate
    cfg = TrainerConfig(lr=1e-3, loss=LossConfig(correction="behaviour"))
    tr = GRPOTrainer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    e0 = tr.evaluate(groups, trainer_version=5)
    m = tr.step(groups, trainer_version=5)
    e1 = tr.evaluate(groups, trainer_version=5)
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change"
    assert m["loss"] == pytest.approx(e0["loss"], abs=1e-7)
    assert e1["loss"] < e0["loss"] - 1e-4
    assert m["step"] == 1 and tr.steps == 1


def test_default_config_step_lowers_surrogate_against_pre_step_policy():
    model = TinyLM()
    groups = make_groups(model)
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-3))  # grpo loss, no correction: anchor = prox
    batch = tr.make_batch(groups, 0)
    with torch.no_grad():
        prox = token_logprobs(model(batch.input_ids), batch.targets)
    ones = torch.ones_like(prox)
    l0, _ = tr.loss_fn(prox, prox, batch.adv, batch.mask, ones, scale=batch.scale)
    tr.step(groups, trainer_version=0)
    with torch.no_grad():
        l1, _ = tr.loss_fn(
            token_logprobs(model(batch.input_ids), batch.targets),
            prox,
            batch.adv,
            batch.mask,
            ones,
            scale=batch.scale,
        )
    assert l1.item() < l0.item() - 1e-4


def test_metrics_count_tokens_gap_and_staleness():
    model = TinyLM()
    groups = make_groups(model, tv=4, old_version_prefix=1)
    n_resp = sum(t.length for g in groups for t in g.trajectories)
    n_seq = sum(len(g.trajectories) for g in groups)
    tr = GRPOTrainer(model, TrainerConfig(max_staleness=1))
    m = tr.evaluate(groups, trainer_version=4)
    assert m["sequences"] == n_seq
    assert m["stale_tokens"] == n_seq  # the first token of each response is 2 versions old
    assert m["tokens"] == n_resp - n_seq
    assert m["gap_tokens"] == n_resp - n_seq
    assert m["logprob_gap_max"] < 1e-5  # behaviour logprobs are this model's own
    assert m["adv_mean"] == pytest.approx(0.0, abs=1e-6)  # grpo advantages centre each group
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    h = m["entropy"]
    assert 0.0 < h <= math.log(V)

    noisy = make_groups(model, tv=4, noise=0.1)
    m = tr.evaluate(noisy, trainer_version=4)
    assert 0.05 < m["logprob_gap_mean"] < 0.12 and m["logprob_gap_max"] > m["logprob_gap_mean"]
    assert math.isnan(tr.evaluate(noisy, trainer_version=9)["logprob_gap_mean"])  # no token at version 9


def test_the_flat_buffer_is_the_models_parameters():
    """What the trainer publishes (one memcpy of `flat.buffer`) is exactly the model's weights, tied
    names sharing one slice, before and after a step."""
    model = TinyLM(tie=True)
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-2))
    w0 = tr.flat.buffer.clone()
    layout = dict((n, o) for n, _, o in tr.flat.layout)
    assert layout["lm_head.weight"] == layout["embed.weight"]
    assert tr.flat.buffer.numel() == sum(p.numel() for p in model.parameters())
    views = tr.flat.views()
    assert set(views) == set(model.state_dict())  # tied names both present, sharing one slice
    tr.step(make_groups(model), trainer_version=0)
    assert not torch.equal(tr.flat.buffer, w0)
    for k, v in model.state_dict().items():
        assert torch.equal(views[k], v)  # the views follow the parameters: they are the same memory


def test_checkpoint_resume_continues_identically():
    groups = make_groups(TinyLM())
    a = GRPOTrainer(TinyLM(), TrainerConfig(lr=1e-2))
    a.step(groups, 0)
    state = copy.deepcopy(a.state_dict())
    b = GRPOTrainer(TinyLM(seed=7), TrainerConfig(lr=1e-2))
    b.load_state_dict(state)
    assert b.steps == 1
    a.step(groups, 1)
    b.step(groups, 1)
    assert torch.equal(a.flat.buffer, b.flat.buffer)


def test_the_learning_rate_follows_its_schedule_and_a_resume_takes_it_up():
    """Warmup 2 then linear to half at step 6: steps 0-5 take 0.5, 1, 1, 0.875, 0.75, 0.625 x lr, and a
    trainer loaded from a checkpoint after 3 steps takes step 3's rate and the same weights."""
    groups = make_groups(TinyLM())
    cfg = TrainerConfig(lr=1e-2, lr_warmup_steps=2, lr_schedule="linear", lr_min_ratio=0.5)
    a = GRPOTrainer(TinyLM(), cfg, total_steps=6)
    assert [a.step(groups, i)["lr"] for i in range(3)] == pytest.approx([5e-3, 1e-2, 1e-2])
    b = GRPOTrainer(TinyLM(seed=7), cfg, total_steps=6)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for i in range(3, 6):
        la, lb = a.step(groups, i)["lr"], b.step(groups, i)["lr"]
        assert la == lb == pytest.approx(1e-2 * (1 - 0.5 * (i - 2) / 4))
    assert torch.equal(a.flat.buffer, b.flat.buffer)
    with pytest.raises(ValueError, match="needs the run's steps"):
        GRPOTrainer(TinyLM(), cfg)  # a decay with nowhere to end


def test_bf16_autocast_step_runs_close_to_fp32():
    groups = make_groups(TinyLM())
    m32 = GRPOTrainer(TinyLM(), TrainerConfig()).evaluate(groups, 0)
    tr = GRPOTrainer(TinyLM(), TrainerConfig(bf16=True))
    m16 = tr.step(groups, 0)
    assert m16["entropy"] == pytest.approx(m32["entropy"], rel=2e-2)
    assert math.isfinite(m16["grad_norm"]) and m16["grad_norm"] > 0
    assert tr.flat.buffer.dtype == torch.float32  # master weights stay fp32


def test_temperature_enters_logprobs():
    model = TinyLM()
    groups = make_groups(model)  # behaviour logprobs at T = 1
    m1 = GRPOTrainer(copy.deepcopy(model), TrainerConfig()).evaluate(groups, 0)
    m2 = GRPOTrainer(copy.deepcopy(model), TrainerConfig(temperature=0.5)).evaluate(groups, 0)
    assert m1["logprob_gap_max"] < 1e-5 < m2["logprob_gap_mean"]


def test_advantage_defaults_to_the_losss_own():
    assert GRPOTrainer(TinyLM(), TrainerConfig()).advantage is ADVANTAGES["grpo"]
    drgrpo = TrainerConfig(loss=LossConfig("drgrpo", max_new_tokens=64))
    assert GRPOTrainer(TinyLM(), drgrpo).advantage is ADVANTAGES["drgrpo"]
    rloo = TrainerConfig(loss=LossConfig("drgrpo", max_new_tokens=64), advantage="rloo")
    assert GRPOTrainer(TinyLM(), rloo).advantage is ADVANTAGES["rloo"]


def test_config_validation_and_yaml_mapping():
    cfg = load_config(
        overrides=["--loss.name=dapo", "--lr=0.0001", "--betas=[0.9, 0.95]", "--max_staleness=2"],
        cls=TrainerConfig,
    )
    assert (cfg.loss.name, cfg.lr, cfg.betas, cfg.max_staleness) == ("dapo", 1e-4, (0.9, 0.95), 2)
    for bad, field in [
        (dict(lr=0.0), "train.lr"),
        (dict(micro_batch_tokens=0), "train.micro_batch_tokens"),
        (dict(grad_clip=-1.0), "train.grad_clip"),
        (dict(temperature=0.0), "train.temperature"),
        (dict(max_staleness=-1), "train.max_staleness"),
        (dict(betas=(0.9, 1.0)), "train.betas"),
    ]:
        with pytest.raises(ConfigError, match=field):
            TrainerConfig(**bad)
    with pytest.raises(ValueError, match="ref_model"):
        GRPOTrainer(TinyLM(), TrainerConfig(loss=LossConfig(kl_coef=0.1)))


@pytest.mark.parametrize("poison", ["logprobs", "weights"])
def test_a_non_finite_step_raises_and_leaves_the_weights_untouched(poison):
    model = TinyLM()
    groups = make_groups(model)
    tr = GRPOTrainer(model, TrainerConfig(temperature=1e-45 if poison == "logprobs" else 1.0))
    if poison == "weights":
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = math.inf
    before = tr.flat.buffer.clone()
    with pytest.raises(NonFiniteError, match="not finite.*train.lr"):
        tr.step(groups, 0)
    assert torch.equal(tr.flat.buffer, before) and tr.steps == 0
    assert not tr.opt.state, "the optimizer must not have moved"


def equal_rewards(groups, reward=0.1):
    return [
        Group(g.id, g.prompt_id, tuple(dataclasses.replace(t, reward=reward) for t in g.trajectories))
        for g in groups
    ]


def test_a_batch_without_reward_signal_runs_no_forward_or_backward():
    """Every group's rewards equal (three 0.1s: their float mean is not 0.1, so the estimator's
    advantages are ~1e-11, not 0): the step is counted and reported skipped, the weights untouched."""
    model = TinyLM()
    groups = make_groups(model, k=3)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = tr.step(equal_rewards(groups), trainer_version=0)
    assert calls == [] and m["skipped"] == 1 and m["micro_batches"] == 0 and m["tokens"] == 0
    assert m["step"] == tr.steps == 1 and not tr.opt.state
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    # one group with signal among equal ones: a normal step
    m = tr.step(equal_rewards(groups[:2]) + groups[2:], trainer_version=0)
    assert calls and m["skipped"] == 0 and m["grad_norm"] > 0


def test_a_kl_term_keeps_a_batch_without_reward_signal_training():
    model = TinyLM()
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)), ref_model=TinyLM(seed=1))
    m = tr.step(equal_rewards(make_groups(model)), trainer_version=0)
    assert m["skipped"] == 0 and m["grad_norm"] > 0


def test_learning_rate_by_policy_size_when_unset():
    from tailrace.config.train import auto_lr

    assert auto_lr(800_000) == auto_lr(2_000_000) == 2e-4  # the built-in policy keeps its measured rate
    assert auto_lr(134_515_008) == pytest.approx(1.30e-5, rel=0.01)  # SmolLM2-135M
    assert auto_lr(7_000_000_000) == pytest.approx(1e-6, rel=0.01)  # verl's and TRL's rate for 7B
    tr = GRPOTrainer(TinyLM(), TrainerConfig())
    assert tr.lr == 2e-4 and tr.opt.param_groups[0]["lr"] == 2e-4
    assert GRPOTrainer(TinyLM(), TrainerConfig(lr=3e-5)).lr == 3e-5


def test_lora_trains_the_adapter_alone():
    """train.lora: the base stays bit for bit, the adapter moves, AdamW's state is the adapter's."""
    from tailrace.config.train import LoraConfig
    from tailrace.model import CausalLM, ModelConfig
    from tailrace.model.lora import LoRALinear

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = CausalLM.from_config(cfg, seed=0)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = GRPOTrainer(
        model, TrainerConfig(lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "up_proj")))
    )
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
    before = tr.adapter()
    m = tr.step(make_groups(model), trainer_version=0)
    assert m["skipped"] == 0 and m["grad_norm"] > 0
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    after = tr.adapter()
    assert any(not torch.equal(after.weights[s][1], before.weights[s][1]) for s in before.weights)
    held = [p for st in tr.opt.state.values() for p in st.values() if torch.is_tensor(p) and p.ndim]
    adapter_numel = sum(a.numel() + b.numel() for a, b in after.weights.values())
    assert sum(p.numel() for p in held) == 2 * adapter_numel  # exp_avg and exp_avg_sq of A and B only


def test_lora_config_keys():
    from tailrace.config.train import LoraConfig

    cfg = load_config(
        overrides=["--lora.rank=8", "--lora.alpha=32", "--lora.targets=[q_proj, v_proj]"], cls=TrainerConfig
    )
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (8, 32.0, ("q_proj", "v_proj"))
    for bad, match in [
        (dict(rank=-1), "train.lora.rank"),
        (dict(alpha=0.0), "train.lora.alpha"),
        (dict(targets=("qkv",)), "train.lora.targets"),
        (dict(targets=()), "train.lora.targets"),
    ]:
        with pytest.raises(ConfigError, match=match):
            LoraConfig(**bad)
    assert load_config(overrides=["--train.lora.rank=4"]).train.lora.rank == 4  # tailrace train takes it


def test_lora_flat_is_the_adapter_and_its_learning_rate_is_ten_times():
    """A LoRA trainer's flat buffer (what it publishes) holds the adapter's parameters alone, in the
    layout the engines' `adapter_from_state` reads; the default learning rate is 10x the base's."""
    from tailrace.config.train import LoraConfig, auto_lr
    from tailrace.engine.adapter_versions import adapter_from_state
    from tailrace.model import CausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    model = CausalLM.from_config(cfg, seed=0)
    n = model.num_parameters()
    tr = GRPOTrainer(
        model, TrainerConfig(lora=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj")))
    )
    names = [name for name, _, _ in tr.flat.layout]
    assert len(names) == 2 * 2 * 2 and all(".lora_" in name for name in names)
    assert tr.flat.buffer.numel() == sum(a.numel() + b.numel() for a, b in tr.adapter().weights.values())
    assert tr.lr == pytest.approx(10 * auto_lr(n))
    rebuilt = adapter_from_state(tr.flat.views(), alpha=8.0)
    assert rebuilt.rank == 4 and rebuilt.scale == 2.0
    for site, (a, b) in tr.adapter().weights.items():
        assert torch.equal(rebuilt.weights[site][0], a) and torch.equal(rebuilt.weights[site][1], b)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
def test_a_bf16_lora_trainer_keeps_its_frozen_base_in_bf16_and_computes_the_same(monkeypatch, family):
    """The autocast GEMMs cast every frozen projection to bf16 on each forward anyway: storing them in
    bf16 changes no loss, gradient or adapter value, and halves the projections' memory; a mixture of
    experts' experts (frozen, never adapted) too, Qwen2-MoE's shared one with them, its router and dense
    layer left as they are. Only a base bf16 holds exactly (a bf16 checkpoint's, as here) is kept so: an
    fp32 one stays fp32, and the merged policy a checkpoint holds is its base plus the adapter, exactly."""
    from tailrace.config.train import LoraConfig
    from tailrace.model import CausalLM, ModelConfig, lora

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(1,))
    if family == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = 40
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, model_type=family, **(moe if family != "llama" else {}))  # fmt: skip
    targets = ("q_proj", "up_proj") if family == "llama" else ("q_proj",)
    tc = TrainerConfig(lr=1e-2, bf16=True, lora=LoraConfig(rank=4, alpha=8.0, targets=targets))
    runs = []
    for store in (True, False):
        if not store:
            monkeypatch.setattr(lora, "store_frozen_projections", lambda *a: 0)
        torch.manual_seed(0)
        model = CausalLM.from_config(cfg, seed=0).to(torch.bfloat16).float()  # a bf16 checkpoint, read
        tr = GRPOTrainer(model, tc)
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        ms = [tr.step(make_groups(model, seed=s), trainer_version=s) for s in range(2)]
        steps = [(m["loss"], m["grad_norm"], m.get("moe_load_max")) for m in ms]
        runs.append((dtypes, steps, tr.flat.buffer.clone(), model))
    (stored, a, flat_a, low), (plain, b, flat_b, _) = runs
    assert stored["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16  # adapted
    if family != "llama":
        assert 1.0 <= a[0][2] <= 4.0  # the step's routing: the busiest expert's share over an even one's
        assert stored["model.layers.0.mlp.experts.3.down_proj.weight"] == torch.bfloat16  # an expert
        assert stored["model.layers.0.mlp.gate.weight"] == torch.float32  # the router
        if family == "qwen2_moe":  # its shared expert frozen as the others, its gate as the router
            assert stored["model.layers.0.mlp.shared_expert.up_proj.weight"] == torch.bfloat16
            assert stored["model.layers.0.mlp.shared_expert_gate.weight"] == torch.float32
        with torch.no_grad():  # outside autocast too: the experts take their input in their dtype
            assert low(torch.tensor([[1, 2, 3]])).dtype == torch.float32
    assert stored["model.layers.1.mlp.down_proj.weight"] == torch.float32  # frozen, not adapted
    assert stored["model.embed_tokens.weight"] == torch.float32  # and the tied head with it
    assert stored["model.layers.0.input_layernorm.weight"] == torch.float32
    assert stored["model.layers.0.self_attn.q_proj.lora_A.weight"] == torch.float32
    assert set(plain.values()) == {torch.float32}
    assert a == b and torch.equal(flat_a, flat_b)
    monkeypatch.undo()
    fp32 = CausalLM.from_config(cfg, seed=0)  # an fp32 checkpoint's base: bf16 would round it
    base = {n: t.clone() for n, t in fp32.state_dict().items()}
    tr = GRPOTrainer(fp32, tc)
    assert tr.base_saved == 0 and all(p.dtype == torch.float32 for p in fp32.parameters())
    tr.step(make_groups(fp32, seed=0), trainer_version=0)
    merged = lora.merged_state(fp32)
    frozen = [n for n in base if ".mlp." in n and "lora" not in n and not lora.adapted_weight(n, targets)]
    assert frozen and all(torch.equal(merged[n], base[n]) for n in frozen)  # the base as it was, to the bit


def test_a_lora_trainers_kl_reference_is_its_base_with_the_adapter_off():
    """kl_coef > 0 with LoRA and no ref_model: the reference is the trainer's own base (the adapter
    switched off while it runs), exactly as a separate copy of the base would give."""
    import copy

    from tailrace.config.train import LoraConfig
    from tailrace.model import CausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    tc = TrainerConfig(lr=5e-2, loss=LossConfig(kl_coef=0.1), lora=LoraConfig(rank=4, alpha=8.0))
    runs = []
    for given in (True, False):
        torch.manual_seed(0)
        model = CausalLM.from_config(cfg, seed=0)
        ref = copy.deepcopy(model).requires_grad_(False) if given else None
        tr = GRPOTrainer(model, tc, ref_model=ref)
        runs.append([tr.step(make_groups(model, seed=s), trainer_version=s) for s in range(3)])
    (a, b) = runs
    assert [m["kl"] for m in a] == [m["kl"] for m in b] and [m["loss"] for m in a] == [m["loss"] for m in b]
    assert a[-1]["kl"] > 0  # the adapter moved away from the base: the penalty is live


def test_a_lora_trainer_started_from_an_adapter_keeps_it_as_its_kl_reference():
    """train.lora.init with a KL penalty: the reference is the trainer's own base with the start adapter
    swapped in (`lora.set_reference`), exactly as a merged copy of base + start adapter would give."""
    import copy

    from tailrace.config.train import LoraConfig
    from tailrace.model import CausalLM, ModelConfig, lora

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    lc = LoraConfig(rank=4, alpha=8.0)
    tc = TrainerConfig(lr=5e-2, loss=LossConfig(kl_coef=0.1), lora=lc)
    torch.manual_seed(1)
    start = lora.attach(CausalLM.from_config(cfg, seed=0), lc)
    with torch.no_grad():
        for m in start.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.weight.normal_(0.0, 0.3)
    init = lora.adapter_of(start)
    runs = []
    for merged_copy in (True, False):
        torch.manual_seed(0)
        model = CausalLM.from_config(cfg, seed=0)
        ref = lora.merged(copy.deepcopy(model), init).requires_grad_(False) if merged_copy else None
        tr = GRPOTrainer(model, tc, ref_model=ref)
        lora.load_adapter_into(tr.model, init)
        if not merged_copy:
            lora.set_reference(tr.model, init)
        runs.append([tr.step(make_groups(model, seed=s), trainer_version=s) for s in range(3)])
    (a, b) = runs
    assert a[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 starts at the reference
    assert [m["kl"] for m in a] == pytest.approx([m["kl"] for m in b], rel=1e-4, abs=1e-7)
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-4, abs=1e-7)
    assert a[-1]["kl"] > 1e-5


def moe_config(shared: int = 0):
    """Qwen3-MoE's layout, three layers: sparse, dense, sparse (4 experts, 2 a token); with `shared`,
    Qwen2-MoE's: biased q/k/v and a shared expert that wide beside the routed ones."""
    from tailrace.model import ModelConfig

    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      max_position_embeddings=64, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, mlp_only_layers=(1,))  # fmt: skip
    if shared:
        cfg = cfg.replace(model_type="qwen2_moe", attention_bias=True, shared_expert_intermediate_size=shared)
    return cfg


def with_routes(groups, model, shift=0, drop=()):
    """`groups` with each trajectory's routes as an engine records them: the model's own (one forward
    over the sequence, every position but the last; uint8), each expert moved by `shift` (mod 4), none
    for the request ids in `drop`."""
    from tests.engine.test_engine_routes import own_routes

    out = []
    for g in groups:
        trajs = []
        for t in g.trajectories:
            seq = t.prompt_ids + t.result.token_ids
            r = (own_routes(model, seq[:-1]) + shift) % 4
            routes = b"" if t.result.request_id in drop else r.to(torch.uint8).numpy().tobytes()
            trajs.append(dataclasses.replace(t, result=dataclasses.replace(t.result, routes=routes)))
        out.append(dataclasses.replace(g, trajectories=tuple(trajs)))
    return out


@pytest.mark.parametrize("shared", [0, 40])
def test_routing_replay_trains_through_the_engines_experts(shared):
    """train.routing_replay: each trajectory's routes (as an engine records them: every position but the
    last, uint8) fill the batch's (N, T, sparse layers, k), -1 past them; routes that are the model's
    own train exactly as no replay does; other routes are taken (counted as flips) and move the step; a
    trajectory without routes (read back from the journal) is routed afresh and counted as such.
    Qwen2-MoE's shared expert (`shared` wide) beside the replayed ones changes none of it."""
    from tailrace.model import CausalLM

    cfg = moe_config(shared)
    runs = {}
    for name, shift, replay in (("plain", 0, False), ("own", 0, True), ("other", 1, True)):
        model = CausalLM.from_config(cfg, seed=0)
        tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, routing_replay=replay))
        groups = with_routes(make_groups(model), model, shift)
        if name == "own":
            batch = tr.make_batch(groups, 0)
            t0 = groups[0].trajectories[0]
            n = len(t0.prompt_ids) + t0.length - 1
            assert (
                batch.routes.shape == (12, batch.input_ids.shape[1], 2, 2)
                and batch.routes.dtype == torch.int16
            )
            assert (batch.routes[0, :n] >= 0).all() and (batch.routes[0, n:] == -1).all()
            assert all(mb.routes.shape[:2] == mb.input_ids.shape for mb in batch.micro_batches(16))
        runs[name] = (tr.step(groups, trainer_version=0), tr.flat.buffer.clone())
    (plain, w_plain), (own, w_own), (other, w_other) = runs["plain"], runs["own"], runs["other"]
    assert "routes_replayed" not in plain and "moe_route_flips" not in plain
    assert own["routes_replayed"] == 1.0 and own["moe_route_flips"] == 0.0
    assert own["loss"] == plain["loss"] and torch.equal(w_own, w_plain)
    assert other["moe_route_flips"] == 1.0 and not torch.equal(w_other, w_plain)
    model = CausalLM.from_config(cfg, seed=0)
    tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, routing_replay=True))
    part = tr.step(with_routes(make_groups(model), model, drop={"0-0", "1-1"}), trainer_version=0)
    assert 0.5 < part["routes_replayed"] < 1.0 and part["moe_route_flips"] == 0.0


def test_the_load_balancing_loss_adds_to_the_loss_and_trains_the_router_alone():
    """train.moe_aux_loss: the step's loss grows by coefficient x the balancing loss (logged), whose
    gradient reaches the routers and what feeds them, not the last sparse layer's experts nor the final
    norm (no clipping: AdamW's update of a parameter is its own gradient's); a dense policy refuses it."""
    from tailrace.model import CausalLM

    cfg = moe_config()
    runs = []
    for coef in (0.0, 0.5):
        model = CausalLM.from_config(cfg, seed=0)
        tr = GRPOTrainer(model, TrainerConfig(lr=1e-2, moe_aux_loss=coef, grad_clip=None))
        runs.append((tr.step(make_groups(model), trainer_version=0), dict(model.named_parameters())))
    (plain, p0), (aux, p1) = runs
    assert "moe_aux_loss" not in plain and 2.0 <= aux["moe_aux_loss"] <= 8.0  # k even .. k E all to k
    assert aux["loss"] == pytest.approx(plain["loss"] + 0.5 * aux["moe_aux_loss"], rel=1e-5)
    moved = {n for n in p0 if not torch.equal(p0[n], p1[n])}
    assert {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"} <= moved
    assert not {"model.layers.2.mlp.experts.3.down_proj.weight", "model.norm.weight"} & moved
    with pytest.raises(ConfigError, match="no mixture of experts to balance"):
        GRPOTrainer(TinyLM(), TrainerConfig(moe_aux_loss=0.01))


def test_every_term_adds_to_the_loss():
    """pg + kl_coef x kl + moe_aux_loss x balancing - entropy_coef x entropy: none replaces another."""
    from tailrace.model import CausalLM

    cfg = moe_config()
    model = CausalLM.from_config(cfg, seed=0)
    lc = LossConfig(kl_coef=0.1, kl_type="k2", entropy_coef=0.01)
    tr = GRPOTrainer(
        model, TrainerConfig(moe_aux_loss=0.5, loss=lc), ref_model=CausalLM.from_config(cfg, seed=1)
    )
    m = tr.step(make_groups(model), trainer_version=0)
    assert min(m["kl"], m["moe_aux_loss"], m["entropy_bonus"]) > 0
    expect = m["pg_loss"] + 0.1 * m["kl"] + 0.5 * m["moe_aux_loss"] - 0.01 * m["entropy_bonus"]
    assert m["loss"] == pytest.approx(expect, rel=1e-6)
    # the entropy bonus is the entropy aggregated as the loss is (grpo: each sequence's token mean)
    assert m["entropy_bonus"] == pytest.approx(m["entropy"], rel=0.3)


def test_an_entropy_bonus_raises_the_entropy_and_keeps_a_batch_without_signal_training():
    base = TinyLM()
    groups = equal_rewards(make_groups(base))
    out = {}
    for coef in (0.0, 1.0):
        tr = GRPOTrainer(copy.deepcopy(base), TrainerConfig(lr=1e-1, loss=LossConfig(entropy_coef=coef)))
        tr.step(groups, 0)
        out[coef] = tr.evaluate(groups, 0)["entropy"]
    assert out[1.0] > out[0.0] + 1e-3  # the step moved toward more entropy; without it nothing moved
