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
