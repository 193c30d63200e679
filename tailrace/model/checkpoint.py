"""Local HF checkpoint I/O: config.json + model.safetensors (or a sharded model.safetensors.index.json).

Reads the decoder's families' checkpoints (`config.ARCHITECTURES`; Qwen2.5 and SmolLM included: their
model_type is qwen2 or llama; Phi-3's fused projections are split, `model/fused.py`; Mixtral's and
Granite's experts renamed and unstacked, `model/moe.py`)
and writes ones `transformers.AutoModelForCausalLM.from_pretrained` loads. Every bad input raises
`CheckpointError` with one line naming the problem and the fix. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tailrace.common import InputError, one_line
from tailrace.model import fused, moe
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What a checkpoint carries besides config and weights: the tokenizer (in any of its HF forms), its chat
# template (inline in tokenizer_config.json, or a file of its own) and the generation defaults.
COMPANIONS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)  # fmt: skip
# Tensors some checkpoints carry that this decoder recomputes (old HF saved the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(InputError):
    """A checkpoint directory that cannot be loaded; the message says what is wrong and how to fix it."""


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = _checkpoint_dir(path)
    f = path / CONFIG
    if not f.is_file():
        raise CheckpointError(f"{f} is missing; a checkpoint directory needs the model's HF config.json")
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{f} is not valid JSON ({one_line(e)}); restore the file from the original checkpoint"
        )
    if not isinstance(d, dict):
        raise CheckpointError(
            f"{f} holds a {type(d).__name__}, not a JSON object; restore the original config.json"
        )
    try:
        return ModelConfig.from_hf(d)
    except KeyError as e:
        raise CheckpointError(
            f"{f} lacks the field {e.args[0]!r}; add it (see the model's original config.json)"
        )
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{f}: {one_line(e)}")


def load_pretrained(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> CausalLM:
    """The model in `path` (config attached as `model.config`), in eval mode. dtype None keeps the stored
    dtype (as transformers' dtype="auto"); device None is the CPU."""
    path = _checkpoint_dir(path)
    cfg = read_config(path)
    state = stored_state(path, cfg)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = model.state_dict()  # meta tensors: names and shapes only
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding wins
    for name in [n for n in state if n.endswith(_IGNORED_SUFFIXES)]:
        del state[name]
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for a "
            f"{cfg.model_type} model with this config.json; check that config.json belongs to "
            "these weights"
        )
    for name, meta in expected.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name not in state:
            raise CheckpointError(
                f"{path}: tensor {name!r} is missing; the weights do not match config.json "
                "(or a shard is missing)"
            )
        if tuple(state[name].shape) != tuple(meta.shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(state[name].shape)}, config.json implies "
                f"{tuple(meta.shape)}; the weights do not match config.json"
            )
        if not state[name].is_floating_point():
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {state[name].dtype}; only unquantized float "
                "checkpoints are supported"
            )
    target = dtype or state["model.embed_tokens.weight"].dtype
    state = {n: t.to(target) for n, t in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gave lm_head its own Parameter object; share the embedding's again
    model.to(device=device or "cpu", dtype=target)
    return model.eval()


def save_pretrained(
    model: CausalLM,
    path: str | os.PathLike,
    companions_from: str | os.PathLike | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write config.json + model.safetensors (no lm_head entry when tied), and the `COMPANIONS` files
    (tokenizer, chat template, ...) that `companions_from` has. A new directory appears whole (built
    aside, then renamed); in an existing one each file is replaced atomically. `state_dict`: the
    weights to write instead of `model`'s (a LoRA model's merged ones: `lora.merged_state`)."""
    path = Path(path)
    cfg: ModelConfig = model.config
    own = model.state_dict() if state_dict is None else state_dict
    state = {n: t.detach().to("cpu").contiguous() for n, t in moe.to_disk(fused.join(own, cfg), cfg).items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    config = cfg.to_hf()
    config["dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would otherwise become the checkpoint's mode
    try:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        shutil.copymode(
            tmp / CONFIG, tmp / WEIGHTS
        )  # safetensors writes 0600; every file gets the umask's mode
        src = Path(companions_from) if companions_from is not None else None
        extra = [n for n in COMPANIONS if src is not None and (src / n).is_file()]
        for name in extra:
            shutil.copyfile(src / name, tmp / name)
        for name in (WEIGHTS, CONFIG, *extra):
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        if not path.exists():
            os.replace(tmp, path)
            return
        for name in (
            WEIGHTS,
            CONFIG,
            *extra,
        ):  # weights first: a config never describes weights not yet there
            os.replace(tmp / name, path / name)
        (path / INDEX).unlink(missing_ok=True)  # a stale shard index would shadow the new weights
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; pass a local checkpoint directory holding {CONFIG} and {WEIGHTS}"
        )
    return path


def stored_state(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the decoder's names, in the dtype they are stored in: views of its
    files, mapped (nothing read until touched, nothing copied; the page cache holds one copy for every
    process that maps them). Phi-3's fused projections split, MoEs' experts one matrix each (views)."""
    return moe.as_ours(fused.split(_read_tensors(_checkpoint_dir(path)), cfg))


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS).is_file():
        return _read_file(path / WEIGHTS)
    if not (path / INDEX).is_file():
        hint = (
            " (found pytorch_model.bin: convert it to safetensors)"
            if (path / "pytorch_model.bin").exists()
            else ""
        )
        raise CheckpointError(
            f"{path} has neither {WEIGHTS} nor {INDEX}{hint}; save the weights as safetensors"
        )
    try:
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{path / INDEX} is not a valid shard index ({one_line(e)}); restore it from the "
            "original checkpoint"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise CheckpointError(f"{path / shard} is missing but {INDEX} lists it; copy the missing shard")
        state.update(_read_file(path / shard))
    return state


def _read_file(f: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(f), framework="pt") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as e:  # safetensors raises its own error types (and OSError) for corrupt files
        raise CheckpointError(
            f"{f} is not a readable safetensors file ({one_line(e)}); it is corrupt or "
            "truncated: re-save or re-copy it"
        )
