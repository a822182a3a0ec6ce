"""Conversations and preference pairs (JSON lines) → fixed-length record tensors for SFT and DPO.

**Inputs** (TRL's dataset formats), one JSON object per line:

* chat, conversational: `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`,
  any number of turns; every assistant turn is trained on.
* chat, prompt/completion: `{"prompt": ..., "completion": ...}`; only the completion is trained on
  (TRL's completion-only loss).
* pairs: `{"prompt": ..., "chosen": ..., "rejected": ...}`.

A prompt is a string or a message list; a completion / chosen / rejected is a string or a list of
assistant messages. **Strings are wrapped** as one user (prompt) or assistant (answer) message and
go through the chat template like the rest: TRL would tokenize them as plain text without a
template, but a model trained here is prompted through the template (`generate --chat`), so it is
trained through it too. Templates: chat_template.py (the byte tokenizer's built-in one is there).

**Records** (all int64, `S` = seq_len, N rows):

* chat: `tokens` [N, S], `labels` [N, S] with `labels[i] = tokens[i+1]` when token i+1 is the
  model's (an assistant turn, its end-of-turn token included), else -100; padding: `pad_id` tokens,
  -100 labels. With packing, several conversations share a row and `doc_ids` [N, S] numbers them
  0, 1, 2… (padding gets the next number), for document-masked attention and per-document positions.
* pairs: `chosen_tokens`, `chosen_labels`, `rejected_tokens`, `rejected_labels` [N, S]; -100 on
  the prompt and the padding (only completion tokens count); row i of both is pair i.

**Length**, as TRL (`truncation_mode="keep_start"`): a sequence longer than S keeps its first S
tokens (the row then ends with a -100 label: what the S+1-th token would be is not asked), and a
sequence or pair left with no labelled token is dropped; both are counted (`ChatStats`). Packing
is TRL's best-fit decreasing: sequences (truncated first) sorted by length, each into the fullest
row it still fits, ties by order.

**Split**: the last ⌈val_fraction × n⌉ conversations / pairs of the file (after drops) validate
(at least one when val_fraction > 0, never all), as `meshspeed data prepare` splits documents.

**Errors**: a record that cannot be used is one line, `FILE line L: what is wrong`, never a silent
skip: a missing key, a role outside system/user/assistant, an empty assistant turn, a template
whose rendering cannot be split into turns.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, insort
from dataclasses import dataclass

import torch

from meshspeed.data.chat_template import ROLES, chat_format, common_chars
from meshspeed.data.corpus import DEFAULT_VAL_FRACTION, DataError

IGNORE_INDEX = -100
CHAT_KEYS = ("tokens", "labels")
PAIR_KEYS = ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels")


@dataclass
class ChatStats:
    records: int = 0
    truncated: int = 0
    dropped: int = 0
    """Sequences (or pairs) left with no labelled token after truncation."""


# --------------------------------------------------------------------------- reading
def read_jsonl(path: str):
    """(line number, record) for each non-blank line; a line that is not a JSON object is one error."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"data: cannot read {path!r} ({e.strerror}); give a JSON-lines file") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path} line {n}: not JSON ({str(e)[:80]})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path} line {n}: a JSON {type(rec).__name__}, expected an object")
            yield n, rec


def _messages(value, where: str, key: str, wrap_role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": wrap_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a string or a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}] must be {{'role': ..., 'content': string}}")
        if m.get("role") not in ROLES:
            raise DataError(
                f"{where}: {key}[{i}] has role {m.get('role')!r}; expected one of {', '.join(ROLES)}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _answer(value, where: str, key: str) -> list[dict]:
    msgs = _messages(value, where, key, "assistant")
    if any(m["role"] != "assistant" for m in msgs):
        raise DataError(f"{where}: {key!r} must hold assistant messages only (the prompt holds the rest)")
    return msgs


# --------------------------------------------------------------------------- one sequence
def _check(fmt, msgs: list[dict], where: str) -> None:
    for i, m in enumerate(msgs):
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: assistant turn {i} is empty; remove the record or give the answer")
        bad = fmt.check_content(m["content"])
        if bad:
            raise DataError(f"{where}: message {i} {bad}")


def _render(fmt, msgs, where: str, gen: bool = False) -> str:
    try:
        return fmt.render(msgs, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, undefined) are varied
        raise DataError(f"{where}: the chat template refused the conversation ({str(e)[:120]})") from None


def _span(fmt, before: list[dict], upto: list[dict], full: str, where: str, what: str) -> tuple[int, int]:
    """Characters of `full` that `upto[len(before):]` (the model's answer) renders to.

    Starts where the prompt rendered with its generation prompt and the conversation rendered up
    to the answer diverge (TRL's rule: a template whose generation prompt differs from its
    rendered turn, e.g. an empty `<think></think>` only in the latter, trains from the first
    difference). Ends where the conversation up to the answer and the whole one diverge: the
    turn's end, or earlier when the template closes only the last turn with something (Phi-3's
    final end-of-text); the answer must lie within, else the template rewrote it."""
    pre = _render(fmt, before, where, gen=True)
    end = _render(fmt, upto, where)
    start = common_chars(pre, end)
    stop = len(full) if end == full else fmt.common_prefix(end, full)
    answers = [m["content"].strip() for m in upto[len(before) :] if m["role"] == "assistant"]
    if any(a not in end[start:] for a in answers):
        raise DataError(
            f"{where}: the rendered {what} does not hold the assistant's content where expected "
            "(the template drops or rewrites it); use a template that renders assistant turns verbatim"
        )
    if stop < start or any(a not in full[start:stop] for a in answers):
        raise DataError(
            f"{where}: the chat template cannot be split at {what}: it renders that turn differently "
            "once later turns follow (e.g. drops earlier reasoning); use a template that renders each "
            "turn the same whatever follows"
        )
    return start, stop


def conversation_ids(fmt, rec: dict, where: str) -> tuple[list[int], list[bool]]:
    """(token ids, is-the-model's flag per token) of one chat record."""
    if "messages" in rec:
        msgs = _messages(rec["messages"], where, "messages", "user")
        _check(fmt, msgs, where)
        full = _render(fmt, msgs, where)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise DataError(f"{where}: 'messages' has no assistant turn; there is nothing to train on")
        spans = [_span(fmt, msgs[:i], msgs[: i + 1], full, where, f"assistant turn {i}") for i in turns]
    elif "prompt" in rec and "completion" in rec:
        prompt = _messages(rec["prompt"], where, "prompt", "user")
        msgs = prompt + _answer(rec["completion"], where, "completion")
        _check(fmt, msgs, where)
        full = _render(fmt, msgs, where)
        spans = [_span(fmt, prompt, msgs, full, where, "the completion")]
    else:
        raise DataError(
            f"{where}: a chat record needs 'messages' or 'prompt' + 'completion'; it has {sorted(rec)[:6]}"
        )
    return fmt.token_mask(full, spans)


def pair_ids(fmt, rec: dict, where: str) -> tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]:
    """((chosen ids, mask), (rejected ids, mask)) of one preference record; the mask is the completion."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
    if missing:
        raise DataError(
            f"{where}: a preference pair needs 'prompt', 'chosen' and 'rejected'; missing {missing}"
        )
    prompt = _messages(rec["prompt"], where, "prompt", "user")
    out = []
    for key in ("chosen", "rejected"):
        msgs = prompt + _answer(rec[key], where, key)
        _check(fmt, msgs, where)
        full = _render(fmt, msgs, where)
        out.append(fmt.token_mask(full, [_span(fmt, prompt, msgs, full, where, f"the {key} answer")]))
    return out[0], out[1]


def shifted_labels(ids: list[int], mask: list[bool]) -> list[int]:
    """labels[i] = ids[i+1] where token i+1 is the model's, else -100; the last position -100."""
    return [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])] + [IGNORE_INDEX]


def _fit(ids, mask, seq_len: int, stats: ChatStats) -> tuple[list[int], list[int]] | None:
    if len(ids) > seq_len:
        stats.truncated += 1
        ids, mask = ids[:seq_len], mask[:seq_len]
    labels = shifted_labels(ids, mask)
    return (ids, labels) if any(t != IGNORE_INDEX for t in labels) else None


# --------------------------------------------------------------------------- rows
def _rows(seqs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    tokens = torch.full((len(seqs), seq_len), pad_id, dtype=torch.int64)
    labels = torch.full((len(seqs), seq_len), IGNORE_INDEX, dtype=torch.int64)
    for r, (ids, lab) in enumerate(seqs):
        tokens[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        labels[r, : len(lab)] = torch.tensor(lab, dtype=torch.int64)
    return {"tokens": tokens, "labels": labels}


def pack_rows(seqs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Best-fit decreasing: longest first, each into the row with the least room that still fits."""
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i][0]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = len(seqs[i][0])
        k = bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            insort(free, (seq_len - n, len(rows) - 1))
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            insort(free, (room - n, row))
    out = {
        k: torch.full((len(rows), seq_len), v, dtype=torch.int64)
        for k, v in (("tokens", pad_id), ("labels", IGNORE_INDEX), ("doc_ids", 0))
    }
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(sorted(members)):
            ids, lab = seqs[i]
            out["tokens"][r, at : at + len(ids)] = torch.tensor(ids, dtype=torch.int64)
            out["labels"][r, at : at + len(ids)] = torch.tensor(lab, dtype=torch.int64)
            out["doc_ids"][r, at : at + len(ids)] = d
            at += len(ids)
        out["doc_ids"][r, at:] = len(members)  # padding: a document of its own
    return out


def _val_count(n: int, val_fraction: float) -> int:
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1), e.g. {DEFAULT_VAL_FRACTION}")
    if val_fraction == 0 or n < 2:
        return 0
    return min(max(1, math.ceil(val_fraction * n)), n - 1)


def _check_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len={seq_len!r} must be an integer ≥ 2, e.g. 512")


# --------------------------------------------------------------------------- entry points
def chat_sequences(path: str, tokenizer, seq_len: int, stats: ChatStats | None = None) -> tuple[list, int]:
    """([(ids, labels)] of the file's conversations, fitted to seq_len, in file order; pad id)."""
    _check_len(seq_len)
    fmt, stats = chat_format(tokenizer), stats if stats is not None else ChatStats()
    seqs = []
    for n, rec in read_jsonl(path):
        stats.records += 1
        ids, mask = conversation_ids(fmt, rec, f"{path} line {n}")
        fitted = _fit(ids, mask, seq_len, stats)
        if fitted is None:
            stats.dropped += 1
        else:
            seqs.append(fitted)
    if not seqs:
        raise DataError(
            f"{path}: no conversation with a labelled token fits seq_len={seq_len}; raise seq_len"
        )
    return seqs, fmt.pad_id


def pair_sequences(path: str, tokenizer, seq_len: int, stats: ChatStats | None = None) -> tuple[list, int]:
    """([((chosen ids, labels), (rejected ids, labels))] in file order; pad id)."""
    _check_len(seq_len)
    fmt, stats = chat_format(tokenizer), stats if stats is not None else ChatStats()
    pairs = []
    for n, rec in read_jsonl(path):
        stats.records += 1
        (ci, cm), (ri, rm) = pair_ids(fmt, rec, f"{path} line {n}")
        c, r = _fit(ci, cm, seq_len, stats), _fit(ri, rm, seq_len, stats)
        if c is None or r is None:
            stats.dropped += 1
        else:
            pairs.append((c, r))
    if not pairs:
        raise DataError(
            f"{path}: no preference pair keeps a completion token within seq_len={seq_len}; raise it"
        )
    return pairs, fmt.pad_id


def chat_rows(seqs, seq_len: int, pad_id: int, packing: bool = False) -> dict[str, torch.Tensor]:
    return pack_rows(seqs, seq_len, pad_id) if packing else _rows(seqs, seq_len, pad_id)


def pair_rows(pairs, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    c, r = _rows([p[0] for p in pairs], seq_len, pad_id), _rows([p[1] for p in pairs], seq_len, pad_id)
    return {
        "chosen_tokens": c["tokens"],
        "chosen_labels": c["labels"],
        "rejected_tokens": r["tokens"],
        "rejected_labels": r["labels"],
    }


def load_chat(path: str, tokenizer, seq_len: int, *, packing: bool = False) -> dict[str, torch.Tensor]:
    """Every conversation of a JSON-lines file as chat records (module docstring)."""
    seqs, pad = chat_sequences(path, tokenizer, seq_len)
    return chat_rows(seqs, seq_len, pad, packing)


def load_pairs(path: str, tokenizer, seq_len: int) -> dict[str, torch.Tensor]:
    """Every preference pair of a JSON-lines file as pair records (module docstring)."""
    pairs, pad = pair_sequences(path, tokenizer, seq_len)
    return pair_rows(pairs, seq_len, pad)


def load_chat_split(
    path: str,
    tokenizer,
    seq_len: int,
    *,
    packing: bool = False,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    stats: ChatStats | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(train records, validation records): the last ⌈val_fraction × n⌉ conversations validate;
    each side is packed on its own, so no row mixes the two."""
    seqs, pad = chat_sequences(path, tokenizer, seq_len, stats)
    k = _val_count(len(seqs), val_fraction)
    return chat_rows(seqs[: len(seqs) - k], seq_len, pad, packing), chat_rows(
        seqs[len(seqs) - k :], seq_len, pad, packing
    )


def load_pairs_split(
    path: str,
    tokenizer,
    seq_len: int,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    stats: ChatStats | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(train records, validation records): the last ⌈val_fraction × n⌉ pairs validate."""
    pairs, pad = pair_sequences(path, tokenizer, seq_len, stats)
    k = _val_count(len(pairs), val_fraction)
    return pair_rows(pairs[: len(pairs) - k], seq_len, pad), pair_rows(pairs[len(pairs) - k :], seq_len, pad)
