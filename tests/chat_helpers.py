"""A checkpoint directory whose tokenizer has a chat template, built locally (no download): a
character-level tokenizer with ChatML's special tokens, and optionally a small random Llama/Qwen2/Qwen3."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c\r\t")

# SmolLM2-Instruct's template (shorter default system message); its BOS is <|im_start|>
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with Qwen3's thinking switch at the generation prompt (as Qwen3's own template ends)
THINKING = CHATML.replace(
    "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
)
# writes BOS itself, as Llama 3's does (here BOS is <|endoftext|>, the end of a turn <|im_end|>)
BOS_FIRST = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' + message['content'] | trim"
    " + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def write_tokenizer(d: Path, template: str | None = CHATML, bos: str = "<|im_start|>", in_file=False) -> Path:
    """tokenizer.json + tokenizer_config.json (EOS <|endoftext|>); the template goes into the config,
    or into chat_template.jinja with `in_file`."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|endoftext|>"}
    if template is not None and not in_file:
        cfg["chat_template"] = template
    elif template is not None:
        (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def write_chat_model(
    d: Path, model_type: str = "qwen2", template: str = CHATML, max_position_embeddings: int = 256, **arch
) -> Path:
    """A random model (vocab = the tokenizer's) saved with the chat tokenizer beside it; `arch`
    overrides its ModelConfig fields (vLLM's CPU attention wants heads of 32 or more)."""
    from tailrace.model import CausalLM, ModelConfig, save_pretrained

    write_tokenizer(d, template)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    cfg = ModelConfig(
        model_type=model_type, vocab_size=len(SPECIALS + CHARS), max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=0, tie_word_embeddings=True, **{**shape, **arch},
    )  # fmt: skip
    save_pretrained(CausalLM.from_config(cfg, seed=0), d)
    return d
