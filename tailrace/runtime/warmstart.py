"""Build, warm-start and cache the default model (no weights are ever downloaded).

The default model is a small Llama-style decoder with the character tokenizer, trained from scratch
on chainsum demonstrations. The result is an ordinary HF checkpoint directory, cached under
$TAILRACE_CACHE (default ~/.cache/tailrace) in a folder named by the hash of the recipe (the arch and
sft sections), so a later run reuses it and a changed recipe rebuilds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from tailrace.common import cache_root
from tailrace.config import ArchConfig, SFTConfig
from tailrace.model.checkpoint import load_pretrained, save_pretrained
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM
from tailrace.model.device import bf16_fast
from tailrace.tasks.chaincalc import ChainCalcTask
from tailrace.tasks.chainsum import ChainSumTask
from tailrace.tokenizer import char_tokenizer
from tailrace.trainer.sft import sft

RECIPE_VERSION = 1  # bump when the warm-start code changes what it produces


def recipe(arch: ArchConfig, sft: SFTConfig) -> dict:
    """The recipe as one flat dict: the shape, then the training (the names the sft section once held
    alone, so the default recipe's hash, and with it the cached default model, did not change)."""
    return dataclasses.asdict(arch) | dataclasses.asdict(sft)


def recipe_key(arch: ArchConfig, sft: SFTConfig, task: ChainSumTask) -> str:
    data = {"v": RECIPE_VERSION, "sft": recipe(arch, sft), "task": dataclasses.asdict(task.spec)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def warm_start_dir(arch: ArchConfig, sft: SFTConfig, task: ChainSumTask | None = None) -> Path:
    task = task or ChainSumTask()
    fp32 = "-fp32" if sft.bf16 and not _autocast(sft) else ""  # another model: another name
    return cache_root() / "warmstart" / f"chainsum-{recipe_key(arch, sft, task)}{fp32}"


def model_config(cfg: ArchConfig, vocab_size: int, tok) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_len,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        model_type="llama",
    )


def demonstrations(cfg: SFTConfig, task: ChainSumTask, tok) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(cfg.seed)
    pairs = []
    for ex in task.examples("train", cfg.examples, seed=cfg.seed):
        prompt = tok.encode(ex.question, bos=True)
        response = tok.encode(task.demonstration(ex, rng)) + [tok.eos_id]
        pairs.append((prompt, response))
    return pairs


def build_warm_start(arch: ArchConfig, cfg: SFTConfig, out: Path, progress=None) -> dict:
    """Train the default model from scratch into `out` (atomically: built aside, then renamed)."""
    task = ChainSumTask(dataclasses.replace(ChainSumTask().spec, p_slip=cfg.slip))
    tok = char_tokenizer()
    torch.manual_seed(cfg.seed)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = CausalLM.from_config(model_config(arch, tok.vocab_size, tok), seed=cfg.seed)
        pairs = demonstrations(cfg, task, tok)
        t0 = time.perf_counter()
        losses = sft(
            model,
            pairs,
            lr=cfg.lr,
            warmup=cfg.warmup,
            batch_tokens=cfg.batch_tokens,
            epochs=cfg.epochs,
            pad_id=tok.pad_id,
            seed=cfg.seed,
            bf16=_autocast(cfg),
            on_step=progress,
        )
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(prev_threads)
    info = {
        "recipe": recipe(arch, cfg),
        "task": dataclasses.asdict(task.spec),
        "seconds": round(seconds, 1),
        "final_loss": _final_loss(losses),
        "steps": len(losses),
        "parameters": model.num_parameters(),
        "autocast": "bfloat16" if _autocast(cfg) else "float32",
    }
    return _publish(model, tok, info, out)


def _autocast(cfg: SFTConfig) -> bool:
    """sft.bf16, where this CPU multiplies bf16 at least at fp32's pace: on an AVX2-only CPU bf16 runs
    about 20x slower, and the warm start trains in fp32 (warmstart.json says which) into a folder of
    its own (`-fp32`), so a key names one model."""
    return cfg.bf16 and bf16_fast(torch.device("cpu"))


def _final_loss(losses: list[float]) -> float:
    return round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4)


def _publish(model, tok, info: dict, out: Path) -> dict:
    """The model, its tokenizer and `info` (warmstart.json) written to a temporary directory beside
    `out`, then renamed over it: a reader never sees half a warm start."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp)
    tok.save(tmp)
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return info


# chaincalc's warm start: the chainsum model fine-tuned on chaincalc's demonstrations (half of them
# calling the calculator on every step), so the base policy samples both ways
TOOL_RECIPE = {"examples": 6000, "lr": 1e-3, "warmup": 20}


def ensure_warm_start(arch: ArchConfig, sft: SFTConfig, progress=None, task: str = "chainsum") -> Path:
    """The default model warm-started for `task` (chainsum, or chaincalc: fine-tuned from chainsum's)."""
    out = warm_start_dir(arch, sft)
    if not (out / "warmstart.json").is_file():
        build_warm_start(arch, sft, out, progress)
    if task != "chaincalc":
        return out
    key = hashlib.sha256(json.dumps([out.name, TOOL_RECIPE], sort_keys=True).encode()).hexdigest()[:12]
    tool_out = out.with_name(f"chaincalc-{key}")
    if not (tool_out / "warmstart.json").is_file():
        build_tool_warm_start(out, sft, tool_out, progress)
    return tool_out


def build_tool_warm_start(
    base: Path, cfg: SFTConfig, out: Path, progress=None, examples: int = TOOL_RECIPE["examples"]
) -> dict:
    """Fine-tune the chainsum model in `base` on chaincalc demonstrations into `out` (atomically)."""
    task = ChainCalcTask(dataclasses.replace(ChainSumTask().spec, p_slip=cfg.slip))
    tok = char_tokenizer()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        model = load_pretrained(base)
        sub = dataclasses.replace(cfg, examples=examples, seed=cfg.seed + 1)
        pairs = demonstrations(sub, task, tok)
        t0 = time.perf_counter()
        losses = sft(
            model, pairs, lr=TOOL_RECIPE["lr"], warmup=TOOL_RECIPE["warmup"], batch_tokens=cfg.batch_tokens,
            epochs=1, pad_id=tok.pad_id, seed=cfg.seed, bf16=_autocast(cfg), on_step=progress,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(prev_threads)
    info = {
        "base": base.name, "recipe": TOOL_RECIPE, "seconds": round(seconds, 1),
        "final_loss": _final_loss(losses), "steps": len(losses),
        "autocast": "bfloat16" if _autocast(cfg) else "float32",
    }  # fmt: skip
    return _publish(model, tok, info, out)
