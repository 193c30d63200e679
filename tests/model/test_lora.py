"""LoRA adapters on the decoder: the update PEFT computes, a frozen base, PEFT-format files both ways.

The `peft` tests run where peft is installed (the dev extra pins it); elsewhere they skip."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from model_helpers import make_config, max_diff, random_model

from tailrace.common import InputError
from tailrace.config.train import LORA_TARGETS, LoraConfig
from tailrace.model import lora, save_pretrained

HAS_PEFT = importlib.util.find_spec("peft") is not None
IDS = torch.randint(0, 53, (2, 12), generator=torch.Generator().manual_seed(3))


def adapted(seed: int = 0, rank: int = 4, alpha: float = 8.0, targets=LORA_TARGETS, **cfg):
    """(base, the same base with an adapter whose B is random: an update that shows)."""
    base = random_model(make_config(**cfg), seed)
    torch.manual_seed(seed)
    model = lora.attach(copy.deepcopy(base), LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets)))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.weight.normal_(0.0, 0.2)
    return base, model


def test_attach_freezes_the_base_and_starts_as_it():
    base = random_model(make_config(), 0)
    model = lora.attach(copy.deepcopy(base), LoraConfig(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert set(base.state_dict()) <= set(model.state_dict())  # the base keeps its keys
    with torch.no_grad():
        assert max_diff(model(IDS), base(IDS)) == 0.0  # B = 0


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj"), ("down_proj",)])
def test_the_update_equals_merging_it_into_the_weights(targets):
    base, model = adapted(targets=targets, attention_bias=True, model_type="qwen2")
    ad = lora.adapter_of(model)
    assert ad.targets == tuple(t for t in LORA_TARGETS if t in targets)
    ref = lora.merged(copy.deepcopy(base), ad)
    with torch.no_grad():
        out, want, plain = model(IDS), ref(IDS), base(IDS)
    assert max_diff(out, want) < 1e-4
    assert max_diff(out, plain) > 1e-2


def test_peft_files_round_trip(tmp_path):
    _, model = adapted()
    ad = lora.adapter_of(model)
    lora.save_peft(ad, tmp_path / "a", base_model="base")
    cfg = json.loads((tmp_path / "a" / lora.ADAPTER_CONFIG).read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 8.0)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / lora.ADAPTER_WEIGHTS), framework="pt") as fh:
        keys = set(fh.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    back = lora.load_peft(tmp_path / "a")
    assert (back.rank, back.alpha) == (ad.rank, ad.alpha)
    assert back.weights.keys() == ad.weights.keys()
    for site, (a, b) in ad.weights.items():
        assert torch.equal(back.weights[site][0], a) and torch.equal(back.weights[site][1], b)


def test_an_adapter_loads_into_a_fresh_attach(tmp_path):
    base, model = adapted()
    lora.save_peft(lora.adapter_of(model), tmp_path)
    other = lora.attach(copy.deepcopy(base), LoraConfig(rank=4, alpha=8.0))
    lora.load_adapter_into(other, lora.load_peft(tmp_path))
    with torch.no_grad():
        assert max_diff(other(IDS), model(IDS)) == 0.0


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install -e '.[dev]' has it)")
def test_peft_loads_our_adapter_onto_transformers_model(tmp_path):
    """transformers' model of our base + peft's loader of our adapter = our adapted model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, model = adapted(num_key_value_heads=2)
    save_pretrained(base, tmp_path / "base")
    lora.save_peft(lora.adapter_of(model), tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert max_diff(peft_model(IDS).logits, model(IDS)) < 1e-4


def peft_trained(tmp_path, targets: list[str], **cfg):
    """(our random base, saved in tmp_path/base; PEFT's rank-2 adapter on transformers' model of it,
    B random, saved in tmp_path/adapter; our base with that adapter loaded, as `load_peft` reads it)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = random_model(make_config(**cfg), 1)
    save_pretrained(base, tmp_path / "base")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    pm = get_peft_model(hf, PeftLoraConfig(r=2, lora_alpha=6, target_modules=targets))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)
    pm.save_pretrained(tmp_path / "adapter")
    ad = lora.load_peft(tmp_path / "adapter", base.config)
    assert (ad.rank, ad.alpha) == (2, 6.0)
    ours = lora.attach(copy.deepcopy(base), LoraConfig(rank=2, alpha=6.0, targets=ad.targets))
    lora.load_adapter_into(ours, ad)
    with torch.no_grad():
        assert max_diff(pm.eval()(IDS).logits, ours(IDS)) < 1e-4
    return base, ours


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install -e '.[dev]' has it)")
def test_an_adapter_peft_trained_and_saved_loads_here(tmp_path):
    _, ours = peft_trained(tmp_path, ["q_proj", "up_proj"], num_key_value_heads=2)
    assert lora.adapter_of(ours).targets == ("q_proj", "up_proj")


PHI3 = dict(model_type="phi3", num_key_value_heads=2)


@pytest.mark.parametrize("targets", [LORA_TARGETS, ("q_proj", "v_proj", "up_proj")])
def test_a_phi3_adapter_is_written_for_its_fused_modules_and_read_back_as_it_was(tmp_path, targets):
    """On Phi-3 the files adapt qkv_proj and gate_up_proj, block-diagonally at 3r and 2r (alpha 3a and 2a: the
    same scale); read back with the base's config, each projection gets its own adapter again, bit for bit,
    and a projection without one (k_proj, gate_proj here) gets none."""
    base, model = adapted(targets=targets, **PHI3)
    ad = lora.adapter_of(model)
    lora.save_peft(ad, tmp_path, cfg=base.config)
    cfg = json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())
    assert set(cfg["target_modules"]) <= {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert (
        cfg["rank_pattern"] == {"qkv_proj": 12, "gate_up_proj": 8}
        and cfg["alpha_pattern"]["qkv_proj"] == 24.0
    )
    back = lora.load_peft(tmp_path, base.config)
    assert (back.rank, back.alpha, back.weights.keys()) == (ad.rank, ad.alpha, ad.weights.keys())
    for site, (a, b) in ad.weights.items():
        assert torch.equal(back.weights[site][0], a) and torch.equal(back.weights[site][1], b)
    with pytest.raises(InputError, match="load it onto a Phi-3 base"):
        lora.load_peft(tmp_path)


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install -e '.[dev]' has it)")
def test_peft_loads_our_phi3_adapter_onto_transformers_phi3(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, model = adapted(targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), **PHI3)
    save_pretrained(base, tmp_path / "base")
    lora.save_peft(lora.adapter_of(model), tmp_path / "adapter", str(tmp_path / "base"), base.config)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert type(hf).__name__ == "Phi3ForCausalLM"
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert max_diff(peft_model(IDS).logits, model(IDS)) < 1e-4


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install -e '.[dev]' has it)")
def test_a_phi3_adapter_peft_trained_loads_here_split_by_projection(tmp_path):
    """PEFT's own Phi-3 adapter has one A per fused module: each projection keeps it, with its rows of B."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, ours = peft_trained(tmp_path, ["qkv_proj", "down_proj"], **PHI3)
    assert lora.adapter_of(ours).targets == ("q_proj", "k_proj", "v_proj", "down_proj")
    # its parts still share one A: written back in PEFT's own form (rank 2, no pattern), which peft reloads
    lora.save_peft(lora.adapter_of(ours), tmp_path / "back", cfg=base.config)
    files = json.loads((tmp_path / "back" / lora.ADAPTER_CONFIG).read_text())
    assert (files["r"], files["rank_pattern"], sorted(files["target_modules"])) == (
        2,
        {},
        ["down_proj", "qkv_proj"],
    )
    again = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "back"
    )
    with torch.no_grad():
        assert max_diff(again.eval()(IDS).logits, ours(IDS)) < 1e-4


MOE = dict(
    model_type="qwen3_moe", num_hidden_layers=3, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=(1,),
)  # fmt: skip
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_an_moe_models_adapter_is_its_attentions_and_an_mlp_target_is_refused():
    """Qwen3-MoE: the default targets adapt every layer's attention projections, the MLPs (the sparse layers'
    experts and the dense layer's) frozen; the update equals merging it; naming an MLP target is refused."""
    base, model = adapted(**MOE)
    ad = lora.adapter_of(model)
    assert set(ad.weights) == {(i, t) for i in range(3) for t in ATTENTION}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".self_attn." in n for n in trainable)
    with torch.no_grad():
        assert max_diff(model(IDS), lora.merged(copy.deepcopy(base), ad)(IDS)) < 1e-4
    with pytest.raises(ValueError, match="adapt q_proj, k_proj, v_proj and o_proj only"):
        lora.attach(copy.deepcopy(base), LoraConfig(rank=4, targets=("q_proj", "down_proj")))


@pytest.mark.skipif(not HAS_PEFT, reason="peft is not installed (pip install -e '.[dev]' has it)")
def test_peft_loads_our_moe_adapter_onto_transformers_qwen3_moe(tmp_path):
    """Our adapter of Qwen3-MoE's attention on transformers' model through peft's loader: its logits are
    ours; an adapter of an MLP there (which PEFT would read as the experts') is refused here."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, model = adapted(**MOE)
    save_pretrained(base, tmp_path / "base")
    ad = lora.adapter_of(model)
    lora.save_peft(ad, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert max_diff(peft_model(IDS).logits, model(IDS)) < 1e-4
    _, dense = adapted(**{**MOE, "model_type": "qwen3", "num_experts": 0, "num_experts_per_tok": 0,
                          "moe_intermediate_size": 0, "norm_topk_prob": False, "mlp_only_layers": ()})  # fmt: skip
    wrong = {s: w for s, w in lora.adapter_of(dense).weights.items() if s[1] in ("q_proj", "down_proj")}
    lora.save_peft(lora.Adapter(ad.rank, ad.alpha, wrong), tmp_path / "wrong")
    with pytest.raises(InputError, match="an MLP of a mixture-of-experts model"):
        lora.load_peft(tmp_path / "wrong", base.config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exactly_in_keeps_a_weight_low_only_if_every_value_is_held(dtype):
    """Hand-made weights: held exactly (kept, the same values); not held at the first value (refused at
    the head alone); held through the head but not at one value far past it (refused by the whole check)."""
    held = torch.randn(64, 128).to(dtype).float()  # every value one of dtype's
    low = lora.exactly_in(held, dtype)
    assert low is not None and low.dtype == dtype and torch.equal(low.float(), held)
    first = held.clone()
    first[0, 0] = 1 + 2**-20  # between two of dtype's values
    assert lora.exactly_in(first, dtype) is None
    tail = held.clone()
    tail[-1, -1] = 1 + 2**-20
    assert lora.exactly_in(tail, dtype, head=16) is None and lora.exactly_in(tail, dtype) is None
    assert lora.exactly_in(held[:, :3], dtype, head=16) is not None  # a strided view: its own order
