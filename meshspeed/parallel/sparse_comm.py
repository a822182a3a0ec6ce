"""Sparse gradient communication: the data-parallel reduction of masked weights sends only the
values their masks keep.

    comm = SparseGradComm(dp, {"layers.0.attention.wq.weight": mask, ...})   # live bool buffers
    comm.active = True     # this step's reduction packs (the caller decides: dense at mask updates)
    comm.masks_changed()   # after any mask update: the packing plan is rebuilt lazily

Every rank holds the same masks, so the indices are implied and only values travel. The kept
entries of a bucket [numel] are all entries of an unmasked parameter and the mask's True entries
of a masked one (alignment padding never). An all-reduce averages them packed end to end: packed
[kept]. A reduce-scatter needs equal slots: the bucket's dp ZeRO chunks [numel/dp] each put their
kept entries at the front of a slot of length L = the fullest chunk's count, packed [dp * L], so
member r receives exactly its chunk's kept entries. After the wait the values go back to their
places and every masked position of the reduced gradient is zero: a masked weight gets no
gradient between updates (as in RigL's sparse steps; the straight-through estimator under dense
communication would give it the dense one). `pack=False` keeps that meaning with a dense
collective (the reference the tests compare against). For N:M masks the bytes sent are N/M of
a masked weight's, plus the unmasked parameters whole.

This module knows parameter names and bool masks only (parallel must not import sparse);
meshspeed.train.sparsity builds it and keeps `active` right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshspeed import comm


@dataclass
class _Plan:
    src: torch.Tensor  # [kept] positions in the bucket, chunk by chunk
    dst: torch.Tensor  # [kept] positions in the reduce-scatter's packed: chunk r's at r * length + 0, 1, ...
    keep: torch.Tensor  # [numel] bool: the bucket's kept entries
    length: int  # L: one chunk's slot in packed
    counts: list[int]  # kept entries of each chunk


class _Unpack:
    """A collective's handle whose wait() also puts the values back."""

    def __init__(self, handle, finish) -> None:
        self.handle, self.finish = handle, finish

    def wait(self) -> None:
        self.handle.wait()
        self.finish()


class SparseGradComm:
    """Attached to a DataParallel (`dp.grad_comm`); see the module docstring."""

    def __init__(self, dp, masks: dict[str, torch.Tensor], *, pack: bool = True) -> None:
        unknown = sorted(set(masks) - set(dp.params))
        if unknown:
            raise comm.ConfigError(
                f"sparse gradient communication: {unknown[0]} is not a data-parallel parameter"
            )
        for name, mask in masks.items():
            if tuple(mask.shape) != tuple(dp.params[name].shape):
                raise comm.ConfigError(
                    f"sparse gradient communication: mask of {name} has shape {tuple(mask.shape)}, "
                    f"the parameter {tuple(dp.params[name].shape)}"
                )
        self.dp, self.masks, self.pack = dp, masks, pack
        self.active = False
        self._plans: dict[int, _Plan | None] = {}
        dp.grad_comm = self

    def masks_changed(self) -> None:
        self._plans.clear()

    def _plan(self, i: int) -> _Plan | None:
        """The packing plan of bucket i, or None when it holds no masked parameter."""
        if i not in self._plans:
            spec, b = self.dp.specs[i], self.dp.buckets[i]
            if not any(s.name in self.masks for s in spec.slots):
                self._plans[i] = None
                return None
            keep = torch.zeros(spec.numel, dtype=torch.bool, device=b.grad.device)
            for s in spec.slots:
                m = self.masks.get(s.name)
                keep[s.offset : s.offset + s.numel] = True if m is None else m.reshape(-1)
            size = self.dp.group_of(i).size
            n = spec.numel // size
            chunks = [torch.nonzero(keep[r * n : (r + 1) * n]).flatten() + r * n for r in range(size)]
            counts = [len(c) for c in chunks]
            length = max(max(counts), 1)
            dst = [torch.arange(c, device=keep.device) + r * length for r, c in enumerate(counts)]
            self._plans[i] = _Plan(torch.cat(chunks), torch.cat(dst), keep, length, counts)
        return self._plans[i]

    def launch(self, i: int, bucket):
        """Start the reduction of bucket i; None when it should go dense (the caller does that)."""
        plan = self._plan(i) if self.active else None
        if plan is None:
            return None
        dp, group = self.dp, self.dp.group_of(i)
        zero2 = bucket.grad_shard is not None
        if not self.pack:  # the reference: dense bytes, the same meaning
            dp.stats["grad_comm_bytes"] += bucket.grad.numel() * bucket.grad.element_size()
            if zero2:
                h = comm.reduce_scatter(bucket.grad, group, "avg", out=bucket.grad_shard, async_op=True)
                lo, hi = dp.dp_shard(i)
                return _Unpack(h, lambda: bucket.grad_shard.masked_fill_(~plan.keep[lo:hi], 0))
            h = comm.all_reduce(bucket.grad, group, "avg", async_op=True)
            return _Unpack(h, lambda: bucket.grad.masked_fill_(~plan.keep, 0))
        if zero2:
            packed = torch.zeros(group.size * plan.length, dtype=bucket.grad.dtype, device=bucket.grad.device)
            packed.index_copy_(0, plan.dst, bucket.grad.index_select(0, plan.src))
            dp.stats["grad_comm_bytes"] += packed.numel() * packed.element_size()
            r = group.rank
            mine = slice(sum(plan.counts[:r]), sum(plan.counts[: r + 1]))
            out = torch.empty(plan.length, dtype=packed.dtype, device=packed.device)
            h = comm.reduce_scatter(packed, group, "avg", out=out, async_op=True)

            def finish() -> None:
                lo = dp.dp_shard(i)[0]
                bucket.grad_shard.zero_()
                src, dst = plan.src[mine] - lo, plan.dst[mine] - r * plan.length
                bucket.grad_shard.index_copy_(0, src, out.index_select(0, dst))

            return _Unpack(h, finish)
        packed = bucket.grad.index_select(0, plan.src)  # [kept]
        dp.stats["grad_comm_bytes"] += packed.numel() * packed.element_size()
        h = comm.all_reduce(packed, group, "avg", async_op=True)

        def finish() -> None:
            bucket.grad.zero_()
            bucket.grad.index_copy_(0, plan.src, packed)

        return _Unpack(h, finish)
