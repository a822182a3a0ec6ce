"""The flat-bucket layout data parallelism reduces and ZeRO shards (data.py uses it).

Trainable parameters (this rank's local tensor-parallel shards: a shard is just a parameter
here) are packed in reverse registration order, roughly the order backward produces their
gradients, into flat buckets of about `bucket_mb` of gradient. A bucket owns a parameter buffer
(param dtype) and a gradient buffer (grad dtype, fp32 by default); each parameter's `.data` is
a view into the first and its gradient a view into the second. Parameter starts are aligned to
16 elements and buckets padded to a multiple of 16·dp, so each of the dp ZeRO shards of a bucket
is equal and aligned; padding stays zero. Pure layout: no communication here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 16  # elements: 64 B of fp32, enough for vectorised kernels and NCCL's alignment wishes


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Slot:
    """Parameter `name` is elements [offset, offset + numel) of bucket `bucket`."""

    name: str
    bucket: int
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: its padded length and the parameters it holds."""

    index: int
    numel: int
    slots: tuple[Slot, ...]
    kind: str = "dp"  # "dp": reduced over the data-parallel group; "expert": over "edp"

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """[lo, hi) of member `rank`'s slice (numel is a multiple of size)."""
        n = self.numel // size
        return rank * n, (rank + 1) * n


def plan_buckets(
    shapes: list[tuple[str, tuple[int, ...]]],
    bucket_numel: int,
    dp_size: int,
    align: int = ALIGN,
    kinds: dict[str, str] | None = None,
    sizes: dict[str, int] | None = None,
    units: dict[str, str] | None = None,
) -> list[BucketSpec]:
    """Pack (name, shape) in the given order into buckets of at most `bucket_numel` elements
    (a larger parameter gets a bucket of its own). Pure data: print it, test it.

    kinds/sizes (expert parallelism): a parameter's reduction group kind (default "dp") and each
    kind's group size; a bucket holds one kind only and is padded for its own group's shards.
    units (ZeRO-3): a parameter's unit; a bucket holds one unit only."""
    kinds, sizes, units = kinds or {}, sizes or {}, units or {}
    buckets: list[BucketSpec] = []
    slots: list[Slot] = []
    used, kind, unit = 0, None, None

    def close() -> None:
        n = round_up(max(used, 1), align * sizes.get(kind, dp_size))
        buckets.append(BucketSpec(len(buckets), n, tuple(slots), kind or "dp"))

    for name, shape in shapes:
        numel = math.prod(shape)
        k, u = kinds.get(name, "dp"), units.get(name)
        if slots and (used + numel > bucket_numel or k != kind or u != unit):
            close()
            slots, used = [], 0
        kind, unit = k, u
        slots.append(Slot(name, len(buckets), used, numel, tuple(shape)))
        used = round_up(used + numel, align)
    if slots:
        close()
    return buckets


def segments(spec: BucketSpec, lo: int, hi: int, keep) -> list[tuple[int, int]]:
    """[s, e) ranges, relative to lo, of the slots within [lo, hi) for which keep(slot) holds;
    neighbouring slots merged (the alignment gaps between them are zero, so they may be swallowed)."""
    out: list[list[int]] = []
    prev = -2
    for j, s in enumerate(spec.slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b or not keep(s):
            continue
        if out and prev == j - 1:
            out[-1][1] = b - lo
        else:
            out.append([a - lo, b - lo])
        prev = j
    return [(a, b) for a, b in out]


class Bucket:
    """A bucket's parameter and gradient buffers; zero=2/3 release the gradient's storage
    between backwards (free) and re-allocate it zeroed on the next gradient (materialize)."""

    def __init__(self, spec: BucketSpec, param_dtype, grad_dtype, device):
        self.spec = spec
        self.data = torch.zeros(spec.numel, dtype=param_dtype, device=device)
        self.grad = torch.zeros(spec.numel, dtype=grad_dtype, device=device)
        self.grad_shard: torch.Tensor | None = None  # zero=2: this rank's reduced slice
        self.nbytes = self.grad.untyped_storage().nbytes()
        self.ready = 0
        self.handle = None
        self.freed = False
        self.landed: set[str] = set()  # parameters with a gradient in `grad` since it was zeroed
        # stale: zero_grad left the last step's values in `grad` instead of a pass of zeros; the
        # first gradient of each parameter is copied over its view, and DataParallel.settle
        # zeroes the views no gradient reached before anything reads the bucket
        self.stale = False

    def materialize(self) -> None:
        if self.freed:
            self.grad.untyped_storage().resize_(self.nbytes)
            self.grad.zero_()
            self.landed.clear()
            self.freed = self.stale = False

    def free(self) -> None:
        self.grad.untyped_storage().resize_(0)
        self.freed = True


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is the view `b` (same storage start, dtype and shape): a gradient that is the
    bucket's own view needs no copy."""
    return a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.shape == b.shape


def describe(specs: list[BucketSpec]) -> str:
    """The bucket layout, one line per bucket."""
    lines = []
    for spec in specs:
        names = ", ".join(s.name for s in spec.slots)
        lines.append(f"bucket {spec.index}: {spec.numel} elements, {len(spec.slots)} params: {names}")
    return "\n".join(lines)
