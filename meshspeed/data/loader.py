"""Batches whose content does not depend on the parallel layout, and resume exactly.

**Global batch.** At step t the global batch is `global_batch_size` windows of `seq_len + 1`
tokens, window g starting at `hash(seed, t, g) mod (tokens - seq_len)`: a counter-based draw,
not a stateful RNG, so step t's batch is a pure function of (seed, t) — the same for any
dp/tp/pp/cp layout or micro-batch size, and the same after a resume (`state_dict() = {"step": t}`).

**Who gets what.** With accumulation steps A = global ÷ (micro × dp), dp rank r's a-th
micro-batch holds global rows `[(a·dp + r)·micro, (a·dp + r + 1)·micro)`: each accumulation step
is one contiguous slice of the global batch cut into dp pieces. Concatenating the micro-batches
accumulation-step-major, then rank (a=0: r=0, 1, …; a=1: r=0, 1, …) reproduces the global batch.
Every rank sharing a dp coordinate (its tp/pp/cp peers) gets the same micro-batches; context
parallelism splits them along the sequence afterwards.

Inputs and targets are int64 `[micro, seq_len]`, targets = inputs shifted left by one token.
The validation loader walks the validation split in consecutive non-overlapping windows: the
same fixed batches at every evaluation and for every layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator

import torch

from meshspeed.data.corpus import (  # noqa: F401
    DEFAULT_MAX_MB,
    DEFAULT_VAL_FRACTION,
    FORMATS,
    TOKEN_DTYPES,
    Corpus,
    DataError,
    default_cache_dir,
    load_corpus,
    read_sidecar,
)
from meshspeed.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_digest

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs [micro, seq], targets [micro, seq]) int64


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """global ÷ (micro × dp), or one line naming the settings and values that would work."""
    for key, value in (
        ("train.global_batch_size", global_batch_size),
        ("train.micro_batch_size", micro_batch_size),
        ("parallel.dp", dp_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise DataError(f"{key}={value!r} must be a positive integer")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        lo = max(per_step, global_batch_size // per_step * per_step)
        fix = f"train.global_batch_size={lo} or {lo + per_step}"
        if global_batch_size % dp_size == 0:
            micros = _divisors(global_batch_size // dp_size)[:8]
            fix += f", or train.micro_batch_size in {{{', '.join(map(str, micros))}}}"
        raise DataError(
            f"train.global_batch_size={global_batch_size} is not divisible by train.micro_batch_size × "
            f"parallel.dp = {micro_batch_size} × {dp_size} = {per_step}; use {fix}"
        )
    return global_batch_size // per_step


def load_tokens(
    path: str | None = "",
    format: str = "text",
    *,
    max_mb: float = DEFAULT_MAX_MB,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cache_dir: str | None = None,
    tokenizer=None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) for `data.path` / `data.format`: `load_corpus` without
    the metadata. Text read with a Hugging Face `tokenizer` (data.tokenizer) is re-tokenized
    from the byte corpus (same files, same split); token files are already tokens, checked
    against the model's `vocab_size` when given (check_token_data)."""
    if vocab_size is not None:
        check_token_data(path, format, vocab_size, tokenizer or "bytes", cache_dir)
    c = load_corpus(path, format, max_mb=max_mb, val_fraction=val_fraction, cache_dir=cache_dir)
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer) or format != "text":
        return c.train, c.val
    return retokenize(c.train, tokenizer), retokenize(c.val, tokenizer)


def retokenize(data: torch.Tensor, tokenizer) -> torch.Tensor:
    """A byte corpus (documents separated by NUL) as `tokenizer`'s ids, documents separated by
    its end-of-document token (when it has one). int32: every vocabulary fits. In memory and
    on every rank: for large corpora `meshspeed data prepare` writes a token file once."""
    docs = [d.decode("utf-8", errors="replace") for d in bytes(data.numpy()).split(b"\0") if d]
    ids: list[int] = []
    for doc in tokenizer.encode_batch(docs):
        ids += doc
        if tokenizer.eot is not None:
            ids.append(tokenizer.eot)
    return torch.tensor(ids, dtype=torch.int32)


class _Batches:
    """The rank slicing shared by the training and validation loaders."""

    split = "train"

    def __init__(
        self, tokens, seq_len: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
    ):
        self.accum_steps = accumulation_steps(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside parallel.dp={dp_size}; use 0..{dp_size - 1}")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"train.seq_len={seq_len!r} must be a positive integer")
        self.tokens = torch.as_tensor(tokens).reshape(-1)  # 1-D, any integer dtype, may be memory-mapped
        if self.tokens.dtype.is_floating_point or self.tokens.dtype == torch.bool:
            raise DataError(f"token array has dtype {self.tokens.dtype}; it must hold integers")
        n = self.tokens.numel()
        if n < seq_len + 1:
            raise DataError(
                f"the {self.split} split has {n} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; "
                f"use a larger corpus (data.path, data.max_mb) or train.seq_len ≤ {max(1, n - 1)}"
            )
        self.seq_len, self.global_batch_size, self.micro_batch_size = (
            seq_len,
            global_batch_size,
            micro_batch_size,
        )
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._offsets = torch.arange(seq_len + 1)

    def _start(self, step: int, g: int) -> int:
        raise NotImplementedError

    def window_starts(self, step: int) -> list[int]:
        """Token offsets of the global batch's windows at `step`, in global order."""
        return [self._start(step, g) for g in range(self.global_batch_size)]

    def _rows(self, starts: list[int]) -> MicroBatch:
        idx = torch.tensor(starts, dtype=torch.int64)[:, None] + self._offsets  # [rows, seq+1]
        w = self.tokens[idx].to(torch.int64)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def global_batch(self, step: int) -> MicroBatch:
        """The whole global batch ([global, seq] inputs and targets): the single-device reference."""
        return self._rows(self.window_starts(step))

    def batches(self, step: int) -> list[MicroBatch]:
        """This dp rank's `accum_steps` micro-batches at `step`, in accumulation order."""
        m, out = self.micro_batch_size, []
        for a in range(self.accum_steps):
            first = (a * self.dp_size + self.dp_rank) * m
            out.append(self._rows([self._start(step, g) for g in range(first, first + m)]))
        return out


class GlobalBatchLoader(_Batches):
    """Training batches: random windows keyed by (seed, step); see the module docstring.

    `batches(t)` is pure: this rank's micro-batches at step t. `next(loader)` returns those of
    `loader.step` and advances it (what `state_dict` records).
    """

    def __init__(
        self,
        tokens,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        super().__init__(tokens, seq_len, global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.seed, self.step = int(seed), 0
        self._n_windows = self.tokens.numel() - seq_len  # valid starts: 0 .. n - seq_len - 1

    def _start(self, step: int, g: int) -> int:
        # Hashing (seed, step, row) gives every row its own stream: any rank computes only its
        # rows, and the draw is identical on every machine, Python and torch version.
        h = hashlib.blake2b(f"{self.seed}/{step}/{g}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") % self._n_windows

    def __iter__(self) -> GlobalBatchLoader:
        return self

    def __next__(self) -> list[MicroBatch]:
        out = self.batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class ValidationLoader(_Batches):
    """Fixed validation batches: window k starts at k·seq_len (consecutive, non-overlapping);
    batch b holds windows [b·global, (b+1)·global). Iterating yields, per batch, this rank's
    micro-batches (same slicing as training), for `num_batches` batches; `batches(b)` gives one."""

    split = "validation"

    def __init__(
        self,
        tokens,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_batches: int | None = None,
    ):
        super().__init__(tokens, seq_len, global_batch_size, micro_batch_size, dp_rank, dp_size)
        windows = (self.tokens.numel() - 1) // seq_len
        if windows < global_batch_size:
            raise DataError(
                f"the validation split has {self.tokens.numel()} tokens = {windows} windows of "
                f"train.seq_len={seq_len}, fewer than one train.global_batch_size={global_batch_size}; "
                "use a larger corpus (data.max_mb), a smaller seq_len or global batch"
            )
        self.num_batches = windows // global_batch_size
        if max_batches is not None:
            if not 1 <= max_batches <= self.num_batches:
                raise DataError(
                    f"train.eval_batches={max_batches} but the validation split holds "
                    f"{self.num_batches} batches of train.global_batch_size={global_batch_size} × "
                    f"train.seq_len={seq_len}; use 1..{self.num_batches} or a larger corpus (data.max_mb)"
                )
            self.num_batches = max_batches

    def batches(self, step: int) -> list[MicroBatch]:
        if not 0 <= step < self.num_batches:
            raise IndexError(f"validation batch {step} is outside 0..{self.num_batches - 1}")
        return super().batches(step)

    def _start(self, step: int, g: int) -> int:
        return (step * self.global_batch_size + g) * self.seq_len

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        for b in range(self.num_batches):
            yield self.batches(b)


# --------------------------------------------------------------------------- token file checks
_SCAN_TOKENS = 1 << 22  # tokens per chunk of the largest-id scan (32 MiB as int64)


def check_token_data(path: str, format: str, vocab_size: int, tokenizer="bytes", cache_dir=None) -> None:
    """Refuse, in one line naming the file, a token file the model cannot train on: a format,
    tokenizer or vocabulary other than its sidecar records, a sidecar that does not describe
    the file (size, SHA-256, largest id), or any id ≥ `vocab_size` (which would index past the
    embedding: a crash at tp 1, wrong numbers at tp ≥ 2). `tokenizer` is data.tokenizer's spec
    or a loaded tokenizer. The sidecar's claims are never believed: the largest id and the
    digest come from a scan of the file, done once and cached by (path, size, mtime) (`meshspeed
    data prepare` leaves that cache filled). Text data passes through."""
    if format not in TOKEN_DTYPES or not path or not os.path.isfile(path):
        return  # text, or a missing/misnamed file: load_corpus words those errors
    itemsize = torch.empty(0, dtype=TOKEN_DTYPES[format]).element_size()
    size = os.path.getsize(path)
    n = size // itemsize
    side = read_sidecar(path)
    if side is not None:
        made = f"{path}.json, written by `meshspeed data prepare`"
        if side["format"] != format:
            raise DataError(
                f"data.format={format} but data.path={path!r} holds {side['format']} tokens ({made}); "
                f"use --data.format {side['format']}"
            )
        if side["count"] != n or side.get("bytes", size) != size:
            raise DataError(
                f"data.path={path!r} holds {n:,} tokens but {path}.json says {side['count']}: the "
                "sidecar is stale; re-run `meshspeed data prepare` or delete the sidecar"
            )
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        name = getattr(tok, "path", "bytes")
        if "tokenizer_sha256" in side:
            same = side["tokenizer_sha256"] == tokenizer_digest(tok)
        else:  # sidecars written before the digest: tell bytes from Hugging Face at least
            same = (side["tokenizer"] == "bytes") == (name == "bytes")
        if not same:
            raise DataError(
                f"data.tokenizer={name!r} but data.path={path!r} was tokenized with "
                f"{side['tokenizer']!r} ({made}); use --data.tokenizer {side['tokenizer']} "
                "(or that tokenizer's directory on this machine)"
            )
        if side["vocab_size"] > vocab_size:
            raise DataError(
                f"data.path={path!r} was tokenized with a {side['vocab_size']:,}-token vocabulary "
                f"({side['tokenizer']}) but the model's vocab_size is {vocab_size:,}; use a model "
                f"with vocab_size ≥ {side['vocab_size']:,} (model.preset) or a matching tokenizer"
            )
    top, digest = scan_token_file(path, format, cache_dir)
    if side is not None and (side.get("sha256", digest) != digest or side["max_id"] != top):
        what = f"largest id is {top:,}, not {side['max_id']:,}" if side["max_id"] != top else "digest differs"
        raise DataError(
            f"data.path={path!r} does not match its sidecar {path}.json (the file's {what}: it changed "
            f"after `meshspeed data prepare`); re-run it, or delete the sidecar"
        )
    if top >= vocab_size:
        raise DataError(
            f"data.path={path!r} holds token id {top:,} but the model's vocab_size is {vocab_size:,} "
            f"(ids must be below it); use a model with vocab_size ≥ {top + 1:,} (model.preset) "
            "or a token file made with the model's tokenizer"
        )


def _memo(path: str, format: str, cache_dir=None) -> str:
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{format}".encode())
    return os.path.join(cache_dir or default_cache_dir(), f"scan-{key.hexdigest()[:24]}.json")


def remember_scan(path: str, format: str, max_id: int, sha256: str, cache_dir=None) -> None:
    """Record what a scan of token file `path` would find (what `data prepare` just wrote), keyed
    by its path, size and mtime; best effort (an unwritable cache means a scan later)."""
    memo = _memo(path, format, cache_dir)
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(memo + f".{os.getpid()}.tmp", "w") as f:
            json.dump({"path": os.path.abspath(path), "max_id": int(max_id), "sha256": sha256}, f)
        os.replace(memo + f".{os.getpid()}.tmp", memo)
    except OSError:
        pass


def scan_token_file(path: str, format: str, cache_dir=None) -> tuple[int, str]:
    """(largest id, SHA-256) of a token file: a chunked scan (memory-mapped, 32 MiB at a time),
    cached in the corpus cache by (absolute path, size, mtime, format): a large file is read once."""
    memo = _memo(path, format, cache_dir)
    try:
        with open(memo) as f:
            got = json.load(f)
        if type(got["max_id"]) is int and isinstance(got["sha256"], str):
            return got["max_id"], got["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    n = os.path.getsize(path) // torch.empty(0, dtype=TOKEN_DTYPES[format]).element_size()
    tokens = torch.from_file(path, shared=False, size=n, dtype=TOKEN_DTYPES[format])
    top = 0
    for i in range(0, n, _SCAN_TOKENS):  # uint16/uint32 have no max() on CPU: compare as int64
        top = max(top, int(tokens[i : i + _SCAN_TOKENS].to(torch.int64).max()))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    remember_scan(path, format, top, h.hexdigest(), cache_dir)
    return top, h.hexdigest()
