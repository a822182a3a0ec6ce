"""Tokenizers: the byte-level default, and Hugging Face tokenizers through `tokenizers`.

Byte-level tokenizer: token = byte value, vocabulary 256, nothing to train or download.

UTF-8 bytes are the tokens, so any text round-trips exactly and the embedding table stays tiny
(the `tiny` model presets use vocab_size=256). Byte 0 (NUL) separates documents in a corpus:
Python refuses source files that contain it and text files practically never do, so it can
never be confused with content.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import torch

from meshspeed.comm.errors import ConfigError


class ByteTokenizer:
    """encode(str) -> list[int] of UTF-8 bytes; decode(tokens) -> str."""

    vocab_size = 256
    eot = 0
    """Document separator (NUL byte) placed after every file of a text corpus."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """The same tokens as a uint8 tensor (one byte per token, no Python ints)."""
        data = text.encode("utf-8")
        return (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )

    def decode(self, tokens: Iterable[int] | torch.Tensor, errors: str = "replace") -> str:
        """Exact inverse of encode for valid UTF-8; a model's sample may cut a multi-byte
        character in half, hence errors="replace" rather than an exception by default."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        try:
            data = bytes(tokens)
        except ValueError:
            bad = next(t for t in tokens if not 0 <= int(t) < 256)
            raise ValueError(f"token {bad} is not a byte; ByteTokenizer accepts 0..255") from None
        return data.decode("utf-8", errors=errors)


# Files of a Hugging Face tokenizer directory, copied next to an exported model.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# End-of-document tokens of the common families, tried when tokenizer_config.json names none.
_EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """A Hugging Face fast tokenizer (tokenizer.json) through the `tokenizers` library.

    `vocab_size` counts added tokens: every id the tokenizer can emit must have an embedding row.
    `eot` separates documents: tokenizer_config.json's eos_token, else a known end-of-text token.
    """

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(
                f"data.tokenizer={path!r}: no tokenizer.json there; give 'bytes', a Hugging "
                "Face tokenizer directory, or its tokenizer.json"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f"data.tokenizer={path!r} needs the `tokenizers` package: pip install tokenizers"
            ) from None
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - the library's errors are long and varied
            raise ConfigError(
                f"data.tokenizer={path!r}: {file} is not a tokenizers file ({str(e)[:120]})"
            ) from None
        self.path, self.file, self.dir = path, file, os.path.dirname(os.path.abspath(file))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eot = self._eot()

    def _eot(self) -> int | None:
        names = list(_EOT_NAMES)
        cfg = os.path.join(self.dir, "tokenizer_config.json")
        if os.path.isfile(cfg):
            eos = _eos_token(cfg)
            if eos:
                names.insert(0, eos)
        return next((i for n in names if (i := self.tok.token_to_id(n)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: Iterable[int] | torch.Tensor) -> str:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        return self.tok.decode(list(tokens), skip_special_tokens=False)

    def files(self) -> list[str]:
        """The tokenizer's files to copy beside an exported model."""
        return [p for n in HF_TOKENIZER_FILES if os.path.isfile(p := os.path.join(self.dir, n))]


def _eos_token(path: str) -> str | None:
    """tokenizer_config.json's eos_token (a string, or {"content": string}), strictly read."""
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"data.tokenizer: {path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"data.tokenizer: {path} holds a JSON {type(cfg).__name__}, not an object")
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos is not None and not isinstance(eos, str):
        raise ConfigError(
            f"data.tokenizer: {path} has eos_token={cfg.get('eos_token')!r}; expected a string, "
            f'{{"content": string}} or null'
        )
    return eos


def load_tokenizer(spec: str = "bytes") -> ByteTokenizer | HFTokenizer:
    """`data.tokenizer`: 'bytes' (the default) or a Hugging Face tokenizer directory / tokenizer.json."""
    return ByteTokenizer() if spec in ("", "bytes") else HFTokenizer(spec)


def check_vocab(tokenizer, vocab_size: int, setting: str = "data.tokenizer") -> None:
    """One line when the model's embedding has fewer rows than the tokenizer has ids (a model may
    have more: vocabularies are often padded to a multiple of 64 or 128)."""
    if tokenizer.vocab_size > vocab_size:
        name = getattr(tokenizer, "path", "bytes")
        raise ConfigError(
            f"{setting}={name!r} has {tokenizer.vocab_size} tokens but the model's vocab_size "
            f"is {vocab_size}; use a model with vocab_size ≥ {tokenizer.vocab_size} or a "
            "matching tokenizer"
        )


def tokenizer_digest(tokenizer) -> str | None:
    """sha256 of a Hugging Face tokenizer's tokenizer.json (None for bytes): what identifies it
    in a token file's sidecar, since its directory's path differs between machines."""
    file = getattr(tokenizer, "file", None)
    if file is None:
        return None
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
