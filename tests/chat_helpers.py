"""A checkpoint directory whose tokenizer has a chat template, built locally (no download): a
character-level tokenizer with ChatML's special tokens, and optionally a small random Llama/Qwen2/Qwen3."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")  # Gemma's ids 0, 1, 2, ...
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


# Gemma 3's template (string contents): BOS first, a system message folded into the first user turn, the
# assistant's turns as "model"
GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Gemma 2's: no system role (it raises)
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def write_tokenizer(
    d: Path, template: str | None = CHATML, bos: str = "<|im_start|>", in_file=False, specials=SPECIALS
) -> Path:
    """tokenizer.json + tokenizer_config.json (EOS <|endoftext|>, or Gemma's <eos> with its `specials`);
    the template goes into the config, or into chat_template.jinja with `in_file`."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens(list(specials))
    tok.decoder = decoders.Fuse()
    tok.save(str(d / "tokenizer.json"))
    eos = "<eos>" if specials == GEMMA_SPECIALS else "<|endoftext|>"
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
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
