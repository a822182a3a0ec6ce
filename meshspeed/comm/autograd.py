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
    all_to_all_start / all_to_all_wait: all_to_all_ad split in two, so compute placed between
                     them runs while the exchange is in flight, forward and backward

Chunks follow tensor_split's convention, so extents need not divide the group size.

While torch.compile traces (`torch.compiler.is_compiling()`), each of the pairs above except the
start/wait split runs comm/traceable.py's form instead: the same transposes over torch's
functional collectives, which dynamo puts in the graph. Eager calls never go there.
"""

from __future__ import annotations

import torch

from meshspeed.comm import collectives as C
from meshspeed.comm import traceable as T
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


class InFlight:
    """The all-to-all between all_to_all_start and all_to_all_wait: the forward exchange, and
    in backward the reverse one (launched by the wait's backward, awaited by the start's)."""

    def __init__(self):
        self.fwd = self.bwd = None


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_splits, out_splits, flight):
        ctx.flight = flight
        flight.fwd = C.all_to_all(x, group, in_splits, out_splits, async_op=True)
        return x.new_empty(0)  # a token: orders the wait after the start in the graph

    @staticmethod
    def backward(ctx, _token):
        g = ctx.flight.bwd.wait()
        ctx.flight.bwd = None
        return g, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, group, in_splits, out_splits, flight):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.flight = group, in_splits, out_splits, flight
        out = flight.fwd.wait()
        flight.fwd = None
        return out

    @staticmethod
    def backward(ctx, g):
        # Launch the reverse exchange and return at once. Autograd then runs the nodes
        # recorded between start and wait in forward (they have higher sequence numbers than
        # the start's node, so the engine prefers them) before the start's backward waits.
        ctx.flight.bwd = C.all_to_all(g.contiguous(), ctx.group, ctx.out_splits, ctx.in_splits, async_op=True)
        return g.new_zeros(0), None, None, None, None


def all_to_all_start(
    x: torch.Tensor, group: Group, in_splits: list[int], out_splits: list[int], flight: InFlight
) -> torch.Tensor:
    """Launch all_to_all_ad's exchange of x and return a token for all_to_all_wait. The group
    must have more than one member (with one, use all_to_all_ad: there is nothing to hide)."""
    if group.size < 2:
        raise ValueError("all_to_all_start needs a group of 2 or more members; use all_to_all_ad")
    return _AllToAllStart.apply(x, group, in_splits, out_splits, flight)


def all_to_all_wait(
    token: torch.Tensor, group: Group, in_splits: list[int], out_splits: list[int], flight: InFlight
) -> torch.Tensor:
    """The rows all_to_all_start's exchange delivered (same arguments). Same values and
    gradients as all_to_all_ad."""
    return _AllToAllWait.apply(token, group, in_splits, out_splits, flight)


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward."""
    if torch.compiler.is_compiling():
        return T.copy_to(x, group)
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    if torch.compiler.is_compiling():
        return T.reduce_from(x, group)
    return _ReduceFrom.apply(x, group)


def split_to(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Keep this member's chunk along `dim` forward; all-gather the gradient backward."""
    if torch.compiler.is_compiling():
        return T.split_to(x, group, dim % x.dim(), _SplitTo.apply)
    return _SplitTo.apply(x, group, dim % x.dim())


def gather_from(x: torch.Tensor, group: Group, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` forward; keep this member's chunk of the gradient backward."""
    if torch.compiler.is_compiling():
        return T.gather_from(x, group, dim % x.dim(), sizes, _GatherFrom.apply)
    return _GatherFrom.apply(x, group, dim % x.dim(), sizes)


def gather_sp(x: torch.Tensor, group: Group, dim: int = 1, sizes: list[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` forward; reduce-scatter the gradient backward."""
    if torch.compiler.is_compiling():
        return T.gather_sp(x, group, dim % x.dim(), sizes, _GatherSP.apply)
    return _GatherSP.apply(x, group, dim % x.dim(), sizes)


def reduce_scatter_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim` forward; all-gather the gradient backward."""
    if torch.compiler.is_compiling():
        return T.reduce_scatter_sp(x, group, dim % x.dim(), _ReduceScatterSP.apply)
    return _ReduceScatterSP.apply(x, group, dim % x.dim())


def all_to_all_ad(
    x: torch.Tensor, group: Group, in_splits: list[int] | None = None, out_splits: list[int] | None = None
) -> torch.Tensor:
    """All-to-all of rows forward; the reverse all-to-all (splits swapped) backward."""
    if torch.compiler.is_compiling():
        return T.all_to_all_ad(x, group, in_splits, out_splits, _AllToAll.apply)
    return _AllToAll.apply(x, group, in_splits, out_splits)
