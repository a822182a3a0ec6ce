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
from collections.abc import Iterator

import torch

from meshspeed.train.corpus import (  # noqa: F401
    DEFAULT_MAX_MB,
    DEFAULT_VAL_FRACTION,
    FORMATS,
    Corpus,
    DataError,
    load_corpus,
)
from meshspeed.train.tokenizer import ByteTokenizer

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) for `data.path` / `data.format`: `load_corpus` without
    the metadata. Text read with a Hugging Face `tokenizer` (data.tokenizer) is re-tokenized
    from the byte corpus (same files, same split); token files are already tokens."""
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
