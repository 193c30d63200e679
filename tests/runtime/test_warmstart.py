"""The warm-start recipe names its cache entry: the default must keep naming the same one."""

from tailrace.config import ArchConfig, SFTConfig
from tailrace.runtime.warmstart import recipe, recipe_key
from tailrace.tasks.chainsum import ChainSumTask

# sft's fields before the model's shape moved to its own section, in their order then
FLAT_RECIPE = [
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_len",
    "examples",
    "slip",
    "batch_tokens",
    "epochs",
    "lr",
    "warmup",
    "seed",
    "threads",
    "bf16",
]


def test_default_recipe_key_is_pinned():
    """A changed key would orphan every cached default model and move make demo's figures."""
    assert list(recipe(ArchConfig(), SFTConfig())) == FLAT_RECIPE
    assert recipe_key(ArchConfig(), SFTConfig(), ChainSumTask()) == "0c3814506d09"


def test_recipe_key_follows_shape_and_training():
    task = ChainSumTask()
    keys = {
        recipe_key(ArchConfig(), SFTConfig(), task),
        recipe_key(ArchConfig(hidden_size=64), SFTConfig(), task),
        recipe_key(ArchConfig(), SFTConfig(lr=1e-3), task),
    }
    assert len(keys) == 3


def test_sft_attends_through_sdpa_as_its_recipes_always_did(monkeypatch):
    """bf16 on CPU would attend eagerly at these lengths; the warm start's SFT must not: eager attention
    rounds differently and would train another model from the same recipe (and key)."""
    import torch

    from tailrace.model import CausalLM, attention
    from tailrace.runtime.warmstart import model_config
    from tailrace.tokenizer import char_tokenizer
    from tailrace.trainer.sft import sft

    tok = char_tokenizer()
    model = CausalLM.from_config(
        model_config(ArchConfig(hidden_size=32, num_layers=1), tok.vocab_size, tok), seed=0
    )
    calls = []
    real = attention.eager_attention
    monkeypatch.setattr(attention, "eager_attention", lambda *a: calls.append(1) or real(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(1, 8, dtype=torch.long))
    assert calls  # outside sft, this forward attends eagerly
    calls.clear()
    pairs = [(tok.encode("1+2="), tok.encode("3")), (tok.encode("4+4="), tok.encode("8"))]
    losses = sft(
        model, pairs, lr=1e-3, warmup=1, batch_tokens=64, epochs=2, pad_id=tok.pad_id, seed=0, bf16=True
    )
    assert losses and not calls
    assert attention.attends_eagerly(8, torch.bfloat16, torch.device("cpu"))  # switched back on after


def test_a_cpu_without_bf16_gemms_warm_starts_in_fp32_under_its_own_name(monkeypatch, tmp_path):
    """bf16 autocast on an AVX2-only CPU is ~20x slower than fp32: there the warm start trains in fp32,
    says so in warmstart.json, and caches under another name (the recipe's key names one model)."""
    import json

    from tailrace.runtime import warmstart

    monkeypatch.setenv("TAILRACE_CACHE", str(tmp_path))
    arch = ArchConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    sft = SFTConfig(examples=40, batch_tokens=512, warmup=1, threads=1)
    monkeypatch.setattr(warmstart, "bf16_fast", lambda device: True)
    fast = warmstart.warm_start_dir(arch, sft)
    monkeypatch.setattr(warmstart, "bf16_fast", lambda device: False)
    slow = warmstart.ensure_warm_start(arch, sft)
    assert slow == fast.with_name(fast.name + "-fp32")
    assert json.loads((slow / "warmstart.json").read_text())["autocast"] == "float32"
    assert warmstart.warm_start_dir(arch, SFTConfig(examples=40, bf16=False)).name.endswith(
        recipe_key(arch, SFTConfig(examples=40, bf16=False), ChainSumTask())
    )
