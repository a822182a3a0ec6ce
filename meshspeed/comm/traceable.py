"""The differentiable collectives of comm/autograd.py in a form torch.compile traces: the
same forward/backward pairs over torch's functional collectives
(torch.distributed._functional_collectives) on the group's process group, so a compiled block
keeps its tensor / sequence / context-parallel communication inside one graph (no graph break
at each parallel layer).

comm/autograd.py switches here only while dynamo traces (`torch.compiler.is_compiling()`): the
eager path keeps meshspeed.comm's collectives with their timeouts, flight recorder and algorithm
choice. The compiled path runs the backend's own collective (on gloo, reduce_scatter is its
all-reduce plus a slice, as comm.reduce_scatter's "native"), and needs equal chunks: an uneven
split takes the eager collective behind a graph break (`_eager`), the only break left.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc

from meshspeed.comm.group import Group


def _eager(fn):
    """An eager fallback called from traced code: a graph break, never a wrong answer."""
    return torch.compiler.disable(fn, recursive=True)


def _even(n: int, group: Group, sizes: list[int] | None = None) -> bool:
    return n % group.size == 0 and (sizes is None or len(set(sizes)) == 1)


def _chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x.narrow(dim, group.rank * (x.shape[dim] // group.size), x.shape[dim] // group.size)


def _gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return fc.all_gather_tensor(x.contiguous(), dim, group.pg)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return fc.reduce_scatter_tensor(x.contiguous(), "sum", dim, group.pg)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    return fc.all_reduce(x.contiguous(), "sum", group.pg)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _pair(name: str, doc: str, fwd, bwd) -> type:
    """A differentiable collective over one dimension: `fwd(x, group, dim)` forward, `bwd(g,
    group, dim)` backward. The four below differ only in which of chunk / gather / reduce-scatter
    runs each way, so they are built from one class rather than written out four times."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, dim):
            ctx.group, ctx.dim = group, dim
            return fwd(x, group, dim)

        @staticmethod
        def backward(ctx, g):
            return bwd(g, ctx.group, ctx.dim), None, None

    Pair.__name__ = Pair.__qualname__ = name
    Pair.__doc__ = doc
    return Pair


def _my_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return _chunk(x, group, dim).contiguous()


_SplitTo = _pair("_SplitTo", "Keep my chunk | all-gather.", _my_chunk, _gather)
_GatherFrom = _pair("_GatherFrom", "All-gather | keep my chunk.", _gather, _my_chunk)
_GatherSP = _pair("_GatherSP", "All-gather | reduce-scatter.", _gather, _reduce_scatter)
_ReduceScatterSP = _pair("_ReduceScatterSP", "Reduce-scatter | all-gather.", _reduce_scatter, _gather)


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal row blocks along dim 0 | the same exchange back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return fc.all_to_all_single(x.contiguous(), None, None, group.pg)

    @staticmethod
    def backward(ctx, g):
        return fc.all_to_all_single(g.contiguous(), None, None, ctx.group.pg), None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def _one_dim(fn, x: torch.Tensor, group: Group, dim: int, even: bool, eager, *eager_args) -> torch.Tensor:
    """`fn` traced when the chunks are equal; else the eager collective behind a graph break."""
    if group.size == 1:
        return x
    if not even:
        return _eager(eager)(x, group, dim, *eager_args)
    return fn.apply(x, group, dim)


def split_to(x: torch.Tensor, group: Group, dim: int, eager) -> torch.Tensor:
    return _one_dim(_SplitTo, x, group, dim, _even(x.shape[dim], group), eager)


def gather_from(x: torch.Tensor, group: Group, dim: int, sizes, eager) -> torch.Tensor:
    return _one_dim(_GatherFrom, x, group, dim, sizes is None or len(set(sizes)) == 1, eager, sizes)


def gather_sp(x: torch.Tensor, group: Group, dim: int, sizes, eager) -> torch.Tensor:
    return _one_dim(_GatherSP, x, group, dim, sizes is None or len(set(sizes)) == 1, eager, sizes)


def reduce_scatter_sp(x: torch.Tensor, group: Group, dim: int, eager) -> torch.Tensor:
    return _one_dim(_ReduceScatterSP, x, group, dim, _even(x.shape[dim], group), eager)


def all_to_all_ad(x: torch.Tensor, group: Group, in_splits, out_splits, eager) -> torch.Tensor:
    if group.size == 1:
        return x
    even = in_splits is None and out_splits is None and _even(x.shape[0], group)
    if not even:  # data-dependent splits (MoE dispatch) stay eager
        return _eager(eager)(x, group, in_splits, out_splits)
    return _AllToAll.apply(x, group)
