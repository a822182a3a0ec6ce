"""Prepared chat / preference records on disk: what `meshspeed data prepare --kind chat|pairs` writes
and the trainer reads back with `load_records`.

One safetensors file (tensors and a string metadata table, nothing executable: no pickle) holds
both splits: `train/<key>` and `val/<key>` for each record key of chat.py (`tokens`, `labels`,
`doc_ids` when packed; `chosen_tokens`, `chosen_labels`, `rejected_tokens`, `rejected_labels`),
all int64 [N, seq_len]. The metadata's `meshspeed` entry is JSON: `format` (RECORD_FORMAT), `kind`,
`seq_len`, `packing`, `tokenizer` (its spec), `tokenizer_sha256` (None for bytes), `pad_id`,
`end_of_turn_id`, `vocab_size`, the source file and the counts (records, truncated, dropped, rows
per split), so the trainer can check the file against its settings in one line.

Written to a temporary sibling and renamed; an existing --out that this command did not write is
refused unless --overwrite.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from meshspeed.comm import outputs
from meshspeed.data.chat import (
    CHAT_KEYS,
    PAIR_KEYS,
    ChatStats,
    load_chat_split,
    load_pairs_split,
)
from meshspeed.data.chat_template import chat_format
from meshspeed.data.corpus import DEFAULT_VAL_FRACTION, DataError
from meshspeed.data.tokenizer import load_tokenizer, tokenizer_digest

RECORD_FORMAT = "meshspeed-records/1"
KINDS = ("chat", "pairs")
WHAT_WORKS = "prepare one with `meshspeed data prepare --kind chat|pairs --input FILE.jsonl --out FILE`"


@dataclass(frozen=True)
class RecordFile:
    """A prepared file: its kind ("chat" or "pairs"), both splits' record tensors and its metadata."""

    kind: str
    train: dict[str, torch.Tensor]
    val: dict[str, torch.Tensor]
    meta: dict


def expected_keys(kind: str, packing: bool = False) -> tuple[str, ...]:
    return PAIR_KEYS if kind == "pairs" else CHAT_KEYS + (("doc_ids",) if packing else ())


def save_records(path: str, kind: str, train: dict, val: dict, meta: dict) -> None:
    """Write both splits and `meta` (JSON-able) to `path` through a temporary sibling."""
    from safetensors.torch import save_file

    tensors = {f"{split}/{k}": v.contiguous() for split, recs in (("train", train), ("val", val))
               for k, v in recs.items()}  # fmt: skip
    full = {**meta, "format": RECORD_FORMAT, "kind": kind}
    tmp = outputs.sibling(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        save_file(tensors, tmp, metadata={"meshspeed": json.dumps(full)})
        outputs.commit_file(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise outputs.disk_error(e, path) or e from None


def load_records(path: str, setting: str = "data.path") -> RecordFile:
    """The records `meshspeed data prepare --kind chat|pairs` wrote to `path` (int64 tensors)."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise DataError(f"{setting}={path!r} is not a file; {WHAT_WORKS}")
    try:
        with safe_open(path, "pt") as f:
            raw = (f.metadata() or {}).get("meshspeed")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    except (OSError, SafetensorError) as e:
        raise DataError(
            f"{setting}={path!r} is not a prepared record file ({type(e).__name__}); {WHAT_WORKS}"
        ) from None
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError:
        meta = {}
    if not isinstance(meta, dict) or meta.get("format") != RECORD_FORMAT or meta.get("kind") not in KINDS:
        raise DataError(
            f"{setting}={path!r} was not written by `meshspeed data prepare --kind chat|pairs`; {WHAT_WORKS}"
        )
    kind, seq_len = meta["kind"], meta.get("seq_len")
    splits = {"train": {}, "val": {}}
    for name, t in tensors.items():
        split, _, key = name.partition("/")
        if split in splits:
            splits[split][key] = t
    want = set(expected_keys(kind, bool(meta.get("packing"))))
    for split, recs in splits.items():
        bad = [k for k, t in recs.items() if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != seq_len]
        if set(recs) != want or bad or len({t.shape[0] for t in recs.values()}) > 1:
            raise DataError(
                f"{setting}={path!r}: its {split} split holds {sorted(recs)} (expected {sorted(want)}, int64 "
                f"[N, {seq_len}], one N); the file is damaged or from another version; prepare it again"
            )
    return RecordFile(kind, splits["train"], splits["val"], meta)


OBJECTIVE_KINDS = {"sft": "chat", "dpo": "pairs"}


def check_records(rf: RecordFile, *, objective: str | None = None, tokenizer=None, seq_len: int | None = None,
                  vocab_size: int | None = None, setting: str = "data.path") -> None:  # fmt: skip
    """One line when a prepared file does not fit the run: the objective's kind (sft reads chat
    records, dpo pairs), the tokenizer it was made with (sha256 of tokenizer.json; bytes = None),
    the model's vocabulary, or a row length other than the run's seq_len (rows are not re-cut)."""
    src = rf.meta.get("source", "?")
    if objective is not None and OBJECTIVE_KINDS.get(objective, rf.kind) != rf.kind:
        raise DataError(
            f"{setting} holds {rf.kind} records but train.objective={objective!r} reads "
            f"{OBJECTIVE_KINDS[objective]} records; prepare {src} with --kind {OBJECTIVE_KINDS[objective]}"
        )
    if tokenizer is not None and tokenizer_digest(tokenizer) != rf.meta.get("tokenizer_sha256"):
        raise DataError(
            f"{setting} was prepared with tokenizer {rf.meta.get('tokenizer')!r}, not the run's "
            f"{getattr(tokenizer, 'path', 'bytes')!r}; prepare it again with --tokenizer set to the run's"
        )
    if seq_len is not None and seq_len != rf.meta["seq_len"]:
        raise DataError(
            f"{setting} holds rows of {rf.meta['seq_len']} tokens but the run's seq_len is {seq_len}; set "
            f"seq_len {rf.meta['seq_len']} or prepare it again with --seq-len {seq_len}"
        )
    if vocab_size is not None and rf.meta.get("vocab_size", 0) > vocab_size:
        raise DataError(
            f"{setting} was made with a {rf.meta['vocab_size']}-token vocabulary but the model's vocab_size "
            f"is {vocab_size}; use a model with vocab_size ≥ {rf.meta['vocab_size']} or a matching tokenizer"
        )


def prepare_records(
    kind: str,
    inputs: list[str],
    out: str,
    tokenizer_spec: str = "bytes",
    seq_len=None,
    *,
    packing: bool = False,
    val_fraction=DEFAULT_VAL_FRACTION,
    overwrite: bool = False,
) -> dict:
    """`meshspeed data prepare --kind chat|pairs`: one JSON-lines file → `out`; returns the metadata."""
    if kind not in KINDS:
        raise DataError(f"--kind={kind!r} is not a record kind; choose one of {', '.join(KINDS)}")
    if len(inputs) != 1:
        raise DataError(f"--kind {kind} reads one JSON-lines file: give one --input (got {len(inputs)})")
    if not out:
        raise DataError(f"--out is required: the record file to write, e.g. data/{kind}.safetensors")
    if os.path.isdir(out):
        raise DataError(f"--out={out!r} is a directory; name a file to write")
    if packing and kind == "pairs":
        raise DataError("--packing applies to --kind chat only; chosen and rejected each fill their own row")
    try:
        seq_len = int(seq_len)
    except (TypeError, ValueError):
        raise DataError(f"--seq-len={seq_len!r}: --kind {kind} needs the row length, e.g. 512") from None
    try:
        val_fraction = float(val_fraction)
    except ValueError:
        raise DataError(f"--val-fraction={val_fraction!r} must be a number in [0, 1), e.g. 0.02") from None
    if os.path.exists(out) and not overwrite:
        try:
            load_records(out, "--out")
        except DataError:
            raise DataError(
                f"--out={out!r} exists and was not written by `meshspeed data prepare --kind chat|pairs`; "
                "choose another path or pass --overwrite"
            ) from None
    tok = load_tokenizer(tokenizer_spec)
    fmt, stats = chat_format(tok), ChatStats()
    if kind == "chat":
        train, val = load_chat_split(
            inputs[0], tok, seq_len, packing=packing, val_fraction=val_fraction, stats=stats
        )
    else:
        train, val = load_pairs_split(inputs[0], tok, seq_len, val_fraction=val_fraction, stats=stats)
    first = next(iter(train))
    meta = {
        "seq_len": seq_len, "packing": packing, "tokenizer": tokenizer_spec or "bytes",
        "tokenizer_sha256": tokenizer_digest(tok), "vocab_size": tok.vocab_size, "pad_id": fmt.pad_id,
        "end_of_turn_id": fmt.end_of_turn_id, "source": os.path.abspath(inputs[0]), "records": stats.records,
        "truncated": stats.truncated, "dropped": stats.dropped,
        "rows": {"train": train[first].shape[0], "val": val[first].shape[0]},
    }  # fmt: skip
    save_records(out, kind, train, val, meta)
    return {**meta, "kind": kind}
