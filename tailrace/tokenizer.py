"""Text <-> token ids. The default model uses a character-level `tokenizers` tokenizer saved as a
standard tokenizer.json (loadable by transformers' PreTrainedTokenizerFast); real checkpoints
bring their own. Only tasks and the CLI see text; the engine and trainer see ids.
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
    """A thin wrapper with the four things tailrace needs: encode, decode, and the special ids."""

    def __init__(self, tok: _HFTokenizer, bos_id: int | None, eos_id: int, pad_id: int) -> None:
        self._tok = tok
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

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

    def special(key: str) -> int | None:
        name = cfg.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        return tok.token_to_id(name) if isinstance(name, str) else None

    eos = eos_id if eos_id is not None else special("eos_token")
    if eos is None:
        raise TokenizerError(f"{d} names no eos_token in tokenizer_config.json; add one or pass the eos id")
    pad = special("pad_token")
    return Tokenizer(tok, bos_id=special("bos_token"), eos_id=eos, pad_id=eos if pad is None else pad)
