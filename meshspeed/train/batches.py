"""The trainer's batches: the loaders each objective reads, and one micro-batch made ready for
the model on this rank (its rows, this rank's context-parallel slice, counts, device).

Every objective sees a dict (DESIGN.md, "A batch is a dict of named tensors"): token windows
become `{"tokens", "labels"}`, conversations `{"tokens", "labels"[, "doc_ids"]}` with labels
only on assistant turns, preference pairs `{"chosen_tokens", "chosen_labels",
"rejected_tokens", "rejected_labels"}`. Their split into micro-batches and dp ranks is the
same for every key and layout independent (data/loader.py, data/records.py).
"""

from __future__ import annotations

import os

import torch

from meshspeed.comm import ConfigError
from meshspeed.data.loader import GlobalBatchLoader, ValidationLoader, load_tokens
from meshspeed.data.records import RecordLoader, RecordValidation
from meshspeed.models.llama import document_positions
from meshspeed.parallel.context import shard_sequence

Batch = dict[str, torch.Tensor]


def packed_documents(x: torch.Tensor, eot: int | None) -> torch.Tensor:
    """[batch, seq] tokens -> document ids: a token after the end-of-text separator starts a new
    document (the separator ends its own)."""
    if eot is None:
        raise ConfigError(
            "data.packing=true needs a tokenizer with an end-of-text token; use data.packing=false"
        )
    ends = (x == eot).long()
    return torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1].cumsum(1)], dim=1)


class TokenBatches:
    """A token-window loader (data/loader.py) whose micro-batches are batch dicts."""

    def __init__(self, loader):
        self.loader = loader
        self.num_batches = getattr(loader, "num_batches", None)

    @staticmethod
    def _dict(pair) -> Batch:
        return {"tokens": pair[0], "labels": pair[1]}

    def batches(self, step: int) -> list[Batch]:
        return [self._dict(p) for p in self.loader.batches(step)]

    def global_batch(self, step: int) -> Batch:
        return self._dict(self.loader.global_batch(step))


def record_splits(cfg, tokenizer, objective: str) -> tuple[Batch, Batch]:
    """(train, validation) records of a post-training objective: data.path a JSON-lines file of
    conversations (sft) or pairs (dpo), or a record file `meshspeed data prepare --kind` wrote;
    empty = the built-in arithmetic task (data/arith.py)."""
    from meshspeed.data import chat
    from meshspeed.data.record_file import load_records

    t, path = cfg.train, cfg.data.path
    kind = "chat" if objective == "sft" else "pairs"
    if not path:  # the arithmetic task, built in
        return builtin_arith(kind, tokenizer, t.seq_len, cfg.data.packing)
    if os.path.isdir(path):  # one `meshspeed data prepare --kind arith` wrote
        return arith_split(path, kind, tokenizer, t.seq_len, cfg.data.packing)
    if path.endswith((".jsonl", ".ndjson", ".json")):
        if kind == "chat":
            return chat.load_chat_split(path, tokenizer, t.seq_len, packing=cfg.data.packing)
        return chat.load_pairs_split(path, tokenizer, t.seq_len)
    f = load_records(path)
    if f.kind != kind or f.meta.get("seq_len") != t.seq_len:
        raise ConfigError(
            f"data.path={path!r} holds {f.kind} records of {f.meta.get('seq_len')} tokens; "
            f"train.objective={objective} with train.seq_len={t.seq_len} needs {kind} records of that "
            f"length: prepare it with --kind {kind} --seq-len {t.seq_len}"
        )
    return f.train, f.val


def builtin_arith(kind: str, tokenizer, seq_len: int, packing: bool) -> tuple[Batch, Batch]:
    """The built-in arithmetic task (data/arith.py, seed 0): written into a private temporary
    directory (each rank its own: no race on a shared cache), read, removed."""
    import tempfile

    from meshspeed.data.arith import write_arith

    with tempfile.TemporaryDirectory(prefix="meshspeed-arith-") as tmp:
        out = os.path.join(tmp, "arith")
        write_arith(out, seed=0)
        return arith_split(out, kind, tokenizer, seq_len, packing)


def arith_split(directory: str, kind: str, tokenizer, seq_len: int, packing: bool) -> tuple[Batch, Batch]:
    """(train, validation) records from a directory `meshspeed data prepare --kind arith` wrote:
    its held-out questions are its .val files (never in .train)."""
    from meshspeed.data import chat

    prefix = "sft" if kind == "chat" else "pairs"
    files = [os.path.join(directory, f"{prefix}.{split}.jsonl") for split in ("train", "val")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(
            f"data.path={directory!r} is a directory without {os.path.basename(missing[0])}; give a "
            "JSON-lines file, a prepared record file, or a directory `meshspeed data prepare --kind "
            "arith --out DIR` wrote"
        )
    if kind == "chat":
        return tuple(chat.load_chat(f, tokenizer, seq_len, packing=packing) for f in files)
    return tuple(chat.load_pairs(f, tokenizer, seq_len) for f in files)


def make_loaders(cfg, tokenizer, dp_rank: int, dp_size: int, model_config=None):
    """(training loader, validation loader) for `train.objective` (a vlm: `model_config`, else
    resolved from cfg), each with
    `batches(step) -> [micro-batch dicts of this dp rank]` and `global_batch(step)`."""
    t, d = cfg.train, cfg.data
    if t.objective == "lm":
        train, val = load_tokens(d.path, d.format, max_mb=d.max_mb, tokenizer=tokenizer)
        args = (t.seq_len, t.global_batch_size, t.micro_batch_size)
        return (
            TokenBatches(GlobalBatchLoader(train, *args, dp_rank=dp_rank, dp_size=dp_size, seed=t.seed)),
            TokenBatches(
                ValidationLoader(val, *args, dp_rank=dp_rank, dp_size=dp_size, max_batches=t.eval_batches)
            ),
        )
    if t.objective == "flow":  # images + labels (data/images.py); "digits" is built in
        from meshspeed.data.images import load_image_records

        train, val = load_image_records(d.path or "digits")
    elif t.objective == "sft" and (vlm := vlm_config(cfg, model_config)) is not None:
        from meshspeed.train.vlm_run import caption_records  # images + captions

        train, val = caption_records(d.path, vlm, t.seq_len)
    else:
        train, val = record_splits(cfg, tokenizer, t.objective)
    args = (t.global_batch_size, t.micro_batch_size, dp_rank, dp_size)
    return RecordLoader(train, *args, seed=t.seed), RecordValidation(val, *args, max_batches=t.eval_batches)


def vlm_config(cfg, config=None):
    """The ModelConfig (given, else resolved from cfg) when it is a vlm's, else None."""
    if config is None:
        from meshspeed.plan.run_plan import resolve_model

        config = resolve_model(cfg)[0]
    return config if config.family == "vlm" else None


def prepare_rows(rows: Batch, *, cp=None, packing_eot: int | None = None, packing: bool = False):
    """(rows, rope positions or None): `rows` cut to this rank's context-parallel slice of every
    sequence (with the global RoPE positions, document-relative when packed) and their
    labelled tokens counted on the host (`n_labels`: SFT normalises by it without a device
    sync). Still on the host."""
    if packing and "doc_ids" not in rows:  # pretraining: documents split by the separator
        rows = {**rows, "doc_ids": packed_documents(rows["tokens"], packing_eot)}
    rope = None
    if cp is not None:
        pos = cp.positions(rows["tokens"].shape[1])
        docs = rows.get("doc_ids")
        rope = pos if docs is None else shard_sequence(document_positions(docs), pos)
        rows = {k: shard_sequence(v, pos) if v.dim() > 1 else v for k, v in rows.items()}
    rows["n_labels"] = (rows["labels"] != -100).sum()
    return rows, rope


def to_device(rows: Batch, device) -> Batch:
    """Sequence tensors to the device; 0-dim host counts stay where they are."""
    return {k: (v.to(device) if v.dim() else v) for k, v in rows.items()}
