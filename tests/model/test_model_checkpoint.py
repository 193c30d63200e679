"""Checkpoint I/O: round trips (single file, sharded, tied, dtype) and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import make_config, max_diff, random_model
from safetensors.torch import load_file, save_file

from tailrace.model import CheckpointError, load_pretrained, save_pretrained
from tailrace.model import checkpoint as ckpt


@pytest.fixture
def saved(tmp_path):
    """(model, checkpoint dir) for a small tied llama."""
    model = random_model(make_config(tie_word_embeddings=True, num_key_value_heads=2))
    save_pretrained(model, tmp_path / "ck")
    return model, tmp_path / "ck"


def logits(model, T=12):
    ids = torch.arange(T)[None] % model.config.vocab_size
    with torch.no_grad():
        return model(ids)


def test_round_trip_is_exact_and_tied(saved):
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    loaded = load_pretrained(path)
    assert loaded.config == model.config and not loaded.training
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert max_diff(logits(loaded), logits(model)) == 0.0
    assert loaded.num_parameters() == model.num_parameters()


def test_untied_checkpoint_has_lm_head(tmp_path):
    model = random_model(make_config(model_type="qwen2"))
    save_pretrained(model, tmp_path)  # an existing (empty) directory
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    assert max_diff(logits(load_pretrained(tmp_path)), logits(model)) == 0.0


def test_dtype_and_device_arguments(saved):
    model, path = saved
    bf = load_pretrained(path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    save_pretrained(bf, path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_pretrained(path).model.embed_tokens.weight.dtype == torch.bfloat16  # None keeps stored dtype
    assert max_diff(logits(bf), logits(model)) < 0.25  # bf16 rounding only


def test_sharded_checkpoint_with_extra_buffers_loads(saved):
    model, path = saved
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old HF checkpoints carry this
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # some tied checkpoints do too
    names = sorted(state)
    half = len(names) // 2
    (path / "model.safetensors").unlink()
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in chunk}, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert max_diff(logits(load_pretrained(path)), logits(model)) == 0.0
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        load_pretrained(path)


def test_save_over_existing_checkpoint_replaces_it_and_leaves_no_temp_files(saved, tmp_path):
    model, path = saved
    (path / "model.safetensors.index.json").write_text("{}")  # stale index must not shadow the new weights
    other = random_model(model.config, seed=5)
    save_pretrained(other, path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert max_diff(logits(load_pretrained(path)), logits(other)) == 0.0


def test_crash_while_saving_keeps_the_old_checkpoint(saved, tmp_path, monkeypatch):
    model, path = saved

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError):
        save_pretrained(random_model(model.config, seed=9), path)
    with pytest.raises(OSError):
        save_pretrained(model, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no half checkpoint, no temp dir
    assert max_diff(logits(load_pretrained(path)), logits(model)) == 0.0


# -- bad input: CheckpointError (a ValueError) with one line naming the problem and the fix ----------


def expect_error(path, *words):
    with pytest.raises(CheckpointError) as e:
        load_pretrained(path)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_missing_directory(tmp_path):
    expect_error(tmp_path / "nope", "nope", "not a directory", "config.json")


def test_missing_config(saved):
    _, path = saved
    (path / "config.json").unlink()
    expect_error(path, "config.json is missing")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_config_not_json(saved, text):
    _, path = saved
    (path / "config.json").write_text(text)
    expect_error(path, "config.json", "JSON")


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["gpt2", "llama", "qwen2"]),
        (
            {"architectures": ["LlamaForTokenClassification"]},
            ["LlamaForTokenClassification", "LlamaForCausalLM"],
        ),
        (
            {"use_sliding_window": True, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            ["sliding"],
        ),
        ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
    ],
)
def test_unsupported_config(saved, changes, words):
    _, path = saved
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, **changes}))
    expect_error(path, *words)


def test_config_missing_required_field(saved):
    _, path = saved
    d = json.loads((path / "config.json").read_text())
    del d["hidden_size"]
    (path / "config.json").write_text(json.dumps(d))
    expect_error(path, "hidden_size")


def test_missing_weights(saved):
    _, path = saved
    (path / "model.safetensors").unlink()
    expect_error(path, "model.safetensors", "safetensors")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_weights(saved, damage):
    _, path = saved
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"garbage": b"\x13\x00" * 50, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    expect_error(path, "model.safetensors", "corrupt or truncated")


def test_missing_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    expect_error(path, "'model.layers.1.mlp.up_proj.weight' is missing")


def test_wrongly_shaped_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    expect_error(path, "'model.layers.0.self_attn.k_proj.weight' has shape (3, 3)", "(32, 64)")


def test_unexpected_tensor(saved):
    _, path = saved
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    expect_error(path, "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'")


def test_pytorch_bin_only_is_named(saved):
    _, path = saved
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    expect_error(path, "pytorch_model.bin", "safetensors")
