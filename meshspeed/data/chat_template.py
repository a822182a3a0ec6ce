"""Chat templates: messages → text → tokens, with which tokens the model is trained to produce.

**Hugging Face tokenizers** render through their own `apply_chat_template` (the Jinja template of
tokenizer_config.json or chat_template.jinja, via `transformers`), and the rendered text is
tokenized with the same tokenizer, so the ids equal `apply_chat_template(..., tokenize=True)`.

**The byte tokenizer** has this built-in template (it has no vocabulary to hold special tokens, so
the role headers are plain text and the end of an assistant turn is one byte):

    <|system|>\\n{content}\\n          (only when the conversation has a system message)
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}\\0        ← END_OF_TURN: byte 0, NUL

End-of-turn id 0 is `ByteTokenizer.eot`, the corpus' end-of-document byte: generation already
stops at it, and UTF-8 text never holds it (a message that does is refused). The generation
prompt (what `generate --chat` appends before the model answers) is `<|assistant|>\\n`.

**Which tokens are the model's** (chat.py's `_span`): the template is rendered once per assistant
turn, up to the turn with the generation prompt and up to the turn's end. The answer starts where
the two first differ (TRL's rule: a token straddling the boundary counts as the answer's) and ends
where the conversation up to it and the whole conversation first differ, compared token by token
(`common_prefix`), so a template that closes only the final turn (Phi-3's end-of-text) marks that
token on the final turn alone. The span holds the content and the turn's closing tokens (`\\0`
here, `<|im_end|>\\n` for ChatML); every token overlapping it is trained on. A template that
renders an earlier turn differently once later turns follow, or drops the assistant's content,
cannot be split this way and is reported.
"""

from __future__ import annotations

import os

import torch

from meshspeed.data.corpus import DataError
from meshspeed.data.tokenizer import ByteTokenizer

END_OF_TURN = "\0"
END_OF_TURN_ID = 0
BYTE_HEADERS = {"system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n"}
ROLES = tuple(BYTE_HEADERS)


class ByteChatFormat:
    """The byte tokenizer's built-in template (module docstring)."""

    end_of_turn_id = END_OF_TURN_ID
    pad_id = END_OF_TURN_ID  # padding is never attended by real tokens nor labelled: any id works
    name = "bytes"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        parts = []
        for m in messages:
            close = END_OF_TURN if m["role"] == "assistant" else "\n"
            parts.append(BYTE_HEADERS[m["role"]] + m["content"] + close)
        if add_generation_prompt:
            parts.append(BYTE_HEADERS["assistant"])
        return "".join(parts)

    def check_content(self, text: str) -> str | None:
        return "holds a NUL byte, the byte template's end-of-turn token" if END_OF_TURN in text else None

    def common_prefix(self, a: str, b: str) -> int:
        """Characters of the longest common prefix of a and b (bytes are the tokens here)."""
        return common_chars(a, b)

    def token_mask(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        data = text.encode("utf-8")
        mask = [False] * len(data)
        for a, b in spans:  # character offsets → byte offsets
            ba, bb = len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))
            mask[ba:bb] = [True] * (bb - ba)
        return list(data), mask


class HFChatFormat:
    """A Hugging Face tokenizer's own chat template (through `transformers`)."""

    def __init__(self, hf, name: str):
        if not getattr(hf, "chat_template", None):
            raise DataError(
                f"data.tokenizer={name!r} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use a chat/instruct model's tokenizer, add a template, or use 'bytes' "
                "(built-in template)"
            )
        self.hf, self.name = hf, name
        eos = hf.eos_token_id
        self.end_of_turn_id = eos
        pad = hf.pad_token_id if hf.pad_token_id is not None else eos
        self.pad_id = 0 if pad is None else int(pad)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def check_content(self, text: str) -> str | None:
        return None

    def common_prefix(self, a: str, b: str) -> int:
        """Characters of a's tokens up to the first token where a and b differ: token-level, so a
        special token (`<|im_end|>` against `<|im_start|>`) is never split by the texts' shared
        first characters."""
        ea, eb = self._encode(a), self._encode(b)
        ia, ib = ea["input_ids"], eb["input_ids"]
        k = next((i for i in range(min(len(ia), len(ib))) if ia[i] != ib[i] or
                  ea["offset_mapping"][i] != eb["offset_mapping"][i]), min(len(ia), len(ib)))  # fmt: skip
        return ea["offset_mapping"][k - 1][1] if k else 0

    def _encode(self, text: str):
        try:
            return self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow (pure Python) tokenizer keeps no character offsets
            raise DataError(
                f"data.tokenizer={self.name!r} is a slow tokenizer without character offsets; give its "
                "fast version (a directory with tokenizer.json)"
            ) from None

    def token_mask(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
        enc = self._encode(text)
        ids = list(enc["input_ids"])
        if not spans:
            return ids, [False] * len(ids)
        off = torch.tensor(enc["offset_mapping"], dtype=torch.long).view(-1, 2)
        start, end = off[:, 0], off[:, 1]
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in spans:
            # overlap, or a zero-width token inside the span
            mask |= ((start < b) & (end > a)) | ((start == end) & (start >= a) & (start < b))
        return ids, mask.tolist()


def common_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def chat_format(tokenizer) -> ByteChatFormat | HFChatFormat:
    """The chat format of a meshspeed tokenizer (`load_tokenizer`'s ByteTokenizer / HFTokenizer) or of
    a `transformers` tokenizer object (anything with `apply_chat_template`)."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteChatFormat()
    if hasattr(tokenizer, "apply_chat_template"):
        return HFChatFormat(tokenizer, getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    path = getattr(tokenizer, "dir", None)
    if path is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} has no chat template; give the byte tokenizer, "
            "a Hugging Face tokenizer directory, or a transformers tokenizer"
        )
    return HFChatFormat(_transformers_tokenizer(path, tokenizer.file), tokenizer.path)


def _transformers_tokenizer(path: str, file: str):
    """The `transformers` tokenizer of a directory: it owns the Jinja rendering (and its extensions,
    `{% generation %}`, `raise_exception`) that chat templates are written against."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise DataError(
            f"data.tokenizer={path!r}: rendering its chat template needs `transformers` "
            "(pip install transformers; it does not pull torch)"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a bare tokenizer.json has no config naming its class
        hf = PreTrainedTokenizerFast(tokenizer_file=file)
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                hf.chat_template = f.read()
        return hf


def prompt_ids(tokenizer, messages: list[dict]) -> tuple[list[int], int | None]:
    """(ids of `messages` rendered with the generation prompt, the end-of-turn id to stop at): what
    a chat model is given to answer, tokenized exactly as its training records were."""
    fmt = chat_format(tokenizer)
    ids, _ = fmt.token_mask(fmt.render(messages, add_generation_prompt=True), [])
    return ids, fmt.end_of_turn_id
