"""Byte-level tokenizer: token = byte value, vocabulary 256, nothing to train or download.

UTF-8 bytes are the tokens, so any text round-trips exactly and the embedding table stays tiny
(the `tiny` model presets use vocab_size=256). Byte 0 (NUL) separates documents in a corpus:
Python refuses source files that contain it and text files practically never do, so it can
never be confused with content.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

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
