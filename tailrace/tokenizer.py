"""Text <-> token ids. The default model uses a character-level `tokenizers` tokenizer saved as a
standard tokenizer.json (loadable by transformers' PreTrainedTokenizerFast); real checkpoints
bring their own, and often a chat template (rendered by tailrace/chat.py). Only tasks and the
session see text; the engine and trainer see ids.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models

from tailrace.common import InputError, one_line

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# printable ASCII without the rare whitespace characters; ids are stable: specials 0-3, chars from 4
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c\r\t")


class TokenizerError(InputError):
    pass


class Tokenizer:
    """A thin wrapper with what tailrace needs: encode, decode, the special ids, and the checkpoint's
    chat template (jinja source, None without one) with the special tokens' text it renders."""

    def __init__(
        self,
        tok: _HFTokenizer,
        bos_id: int | None,
        eos_id: int,
        pad_id: int,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tok
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... -> text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def added_ids(self) -> set[int]:
        """Ids of the added tokens (specials such as <|im_end|>, outside the learned vocabulary)."""
        return set(self._tok.get_added_tokens_decoder())

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "model_max_length": 1 << 20,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def char_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges: one token per char
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()  # join characters without inserted spaces
    return Tokenizer(tok, bos_id=vocab[BOS], eos_id=vocab[EOS], pad_id=vocab[PAD])


def load_tokenizer(directory: str | Path, eos_id: int | None = None) -> Tokenizer:
    """Load tokenizer.json from a checkpoint directory; special ids from tokenizer_config.json."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"no tokenizer.json in {d}; save one with the checkpoint "
            "(tokenizer.save_pretrained) or point --model.path at a full HF checkpoint"
        )
    try:
        tok = _HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
        raise TokenizerError(
            f"{path} is not a valid tokenizer.json ({e}); re-save it from the original tokenizer"
        ) from None
    cfg = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(
                f"{cfg_path} is not valid JSON ({one_line(e)}); restore it from the original"
            ) from None
        if not isinstance(cfg, dict):
            raise TokenizerError(
                f"{cfg_path} holds a {type(cfg).__name__}, not a JSON object; restore the original"
            )

    texts = {k: _content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    texts = {k: v for k, v in texts.items() if v is not None}

    def special(key: str) -> int | None:
        return tok.token_to_id(texts[key]) if key in texts else None

    eos = eos_id if eos_id is not None else special("eos_token")
    if eos is None:
        raise TokenizerError(f"{d} names no eos_token in tokenizer_config.json; add one or pass the eos id")
    pad = special("pad_token")
    return Tokenizer(
        tok, special("bos_token"), eos, eos if pad is None else pad, _chat_template(d, cfg), texts
    )


def _content(token) -> str | None:
    """A special token's text: tokenizer_config.json writes it as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(d: Path, cfg: dict) -> str | None:
    """tokenizer_config.json's chat_template (a string, or named templates: "default"), else
    chat_template.jinja beside it, as transformers reads them."""
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if isinstance(t, str):
        return t
    f = d / "chat_template.jinja"
    return f.read_text() if f.is_file() else None
