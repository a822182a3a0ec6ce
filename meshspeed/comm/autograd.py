"""Differentiable collectives: the forward/backward pairs tensor, sequence and expert
parallel layers are built from. Each pair is the transpose of the other, which is what makes
the gradients exact (Megatron's f/g operators and their sequence-parallel forms).

    copy_to          identity        | all-reduce       (enter a tensor-parallel region)
    reduce_from      all-reduce      | identity         (leave it: sum partial results)
    split_to         keep my chunk   | all-gather
    gather_from      all-gather      | keep my chunk
    gather_sp        all-gather      | reduce-scatter   (sequence parallel: before the matmuls)
    reduce_scatter_sp reduce-scatter | all-gather       (sequence parallel: after them)
    all_to_all_ad    all-to-all      | all-to-all with the splits swapped (MoE dispatch)

Chunks follow tensor_split's convention, so extents need not divide the group size.
"""

from __future__ import annotations

import torch

from meshspeed.comm import collectives as C
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.group import Group


def _my_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    offs = bounds(x.shape[dim], group.size)
    return x.narrow(dim, offs[group.rank], offs[group.rank + 1] - offs[group.rank]).contiguous()


def _sizes(n_total: int, group: Group) -> list[int]:
    offs = bounds(n_total, group.size)
    return [offs[i + 1] - offs[i] for i in range(group.size)]


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return C.all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        return _my_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return C.all_gather(g.contiguous(), ctx.group, ctx.dim, sizes=_sizes(ctx.n, ctx.group)), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim = group, dim
        return C.all_gather(x.contiguous(), group, dim, sizes=sizes)

    @staticmethod
    def backward(ctx, g):
        return _my_chunk(g, ctx.group, ctx.dim), None, None, None


class _GatherSP(_GatherFrom):
    """_GatherFrom's forward; the gradient is summed over members, not just sliced."""

    @staticmethod
    def backward(ctx, g):
        return C.reduce_scatter(g.contiguous(), ctx.group, "sum", ctx.dim), None, None, None


class _ReduceScatterSP(_SplitTo):
    """_SplitTo's backward (all-gather); the forward sums over members before slicing."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.n = group, dim, x.shape[dim]
        return C.reduce_scatter(x.contiguous(), group, "sum", dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_splits, out_splits):
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        return C.all_to_all(x, group, in_splits, out_splits)

    @staticmethod
    def backward(ctx, g):
        return C.all_to_all(g.contiguous(), ctx.group, ctx.out_splits, ctx.in_splits), None, None, None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward."""
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return _ReduceFrom.apply(x, group)


def split_to(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this member's chunk along `dim` forward; all-gather the gradient backward."""
    return _SplitTo.apply(x, group, dim % x.dim())


def gather_from(x: torch.Tensor, group: Group, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` forward; keep this member's chunk of the gradient backward."""
    return _GatherFrom.apply(x, group, dim % x.dim(), sizes)


def gather_sp(x: torch.Tensor, group: Group, dim: int = 1, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` forward; reduce-scatter the gradient backward."""
    return _GatherSP.apply(x, group, dim % x.dim(), sizes)


def reduce_scatter_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim` forward; all-gather the gradient backward."""
    return _ReduceScatterSP.apply(x, group, dim % x.dim())


def all_to_all_ad(
    x: torch.Tensor, group: Group, in_splits: list[int] | None = None, out_splits: list[int] | None = None
) -> torch.Tensor:
    """All-to-all of rows forward; the reverse all-to-all (splits swapped) backward."""
    return _AllToAll.apply(x, group, in_splits, out_splits)
