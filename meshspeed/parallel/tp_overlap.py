"""Tensor-parallel communication hidden behind the matmuls (sequence parallelism only).

Without overlap a column-parallel layer under SP all-gathers its whole input and only then
multiplies; a row-parallel one multiplies and only then reduce-scatters. Here each rank's
sequence block is cut into K chunks (tensor_split of seq/tp rows). Chunk k of every rank is one
collective and one matmul; chunk k+1's collective is in flight (gloo: its own thread; CUDA:
the process group's stream) while chunk k's matmul runs, forward and backward:

    column forward    all-gather x chunk k+1   | y rows of chunk k   = x_k Wᵀ
    column backward   reduce-scatter dx chunk k | dx rows of chunk k+1 = g_k+1 W, then dW
    row forward       reduce-scatter y chunk k | y rows of chunk k+1  = x_k+1 Wᵀ
    row backward      all-gather g chunk k+1   | dx, dW of chunk k

Rows of a full-sequence tensor [batch, seq, d] that belong to chunk k of every rank are
`rows(t, tp, c0, c1)`: the view [batch, tp, seq/tp, d] sliced at [c0, c1) on dim 2, which is
exactly the rank-major order an all-gather of chunk k returns and a reduce-scatter expects.
Every output row is the same dot products as without overlap, so the result is exact up to
the summation order inside the reduce-scatter (float32: ~1e-7 relative).
"""

from __future__ import annotations

import os

import torch

from meshspeed import comm
from meshspeed.comm import cost_model
from meshspeed.comm.algorithms import bounds

MAX_CHUNKS = 8
# Matmul throughput assumed by default_chunks when nothing better is known (FLOP/s): one CPU
# core running float32 GEMM, and a recent GPU's dense bf16 rate; and the fixed cost of one
# more chunk (a collective issued from Python plus a matmul launch). Only the K choice uses them.
_DEVICE_FLOPS = {"cpu": 5e10, "cuda": 4e14}
_CHUNK_LAUNCH_S = {"cpu": 1e-4, "cuda": 2e-5}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rows(t: torch.Tensor, tp: int, c0: int, c1: int) -> torch.Tensor:
    """Rows [c0, c1) of each rank's sequence block: [b, seq, ...] -> [b, tp * (c1 - c0), ...]."""
    b, s = t.shape[:2]
    v = t.view(b, tp, s // tp, *t.shape[2:])[:, :, c0:c1]
    return v.reshape(b, tp * (c1 - c0), *t.shape[2:])


def _put_rows(out: torch.Tensor, y: torch.Tensor, tp: int, c0: int, c1: int) -> None:
    b, s = out.shape[:2]
    out.view(b, tp, s // tp, *out.shape[2:])[:, :, c0:c1] = y.view(b, tp, c1 - c0, *y.shape[2:])


def _spans(local_seq: int, chunks: int) -> list[tuple[int, int]]:
    offs = bounds(local_seq, max(1, min(chunks, local_seq)))
    return [(a, b) for a, b in zip(offs, offs[1:]) if b > a]


def default_chunks(group: comm.Group, comm_bytes: int, flops: float) -> int:
    """K from the cost model: the pipeline time of K chunks, each collective predicted by
    cost_model.predict for the algorithm the group would pick (its α counts K times), each
    matmul taking flops / K at the device's assumed rate, plus a launch cost per chunk; the
    first collective is never hidden. Same answer on every rank.

    On CPU, when this node's ranks (one torch thread each at least) already fill its cores,
    gloo's transfer threads can only take time from the matmuls: nothing is hidden, K = 1."""
    ctx = group.ctx
    dev = ctx.device.type
    if dev == "cpu" and ctx.ranks_per_node * torch.get_num_threads() >= _cores():
        return 1
    rate = _DEVICE_FLOPS.get(dev, _DEVICE_FLOPS["cpu"])
    launch = _CHUNK_LAUNCH_S.get(dev, _CHUNK_LAUNCH_S["cpu"])

    def pipeline(k: int) -> float:
        n = comm_bytes / k
        algo = cost_model.choose("all_gather", int(n), group.nodes, group.backend, ctx.link_params)
        c = cost_model.predict("all_gather", algo, n, group.nodes, group.backend, ctx.link_params)
        m = flops / rate / k
        return c + (k - 1) * max(c, m) + m + k * launch

    return min(range(1, MAX_CHUNKS + 1), key=lambda k: (pipeline(k), k))


def overlap_cost(kind: str, x_shape: tuple, elem: int, weight_shape: tuple, tp: int) -> tuple[int, float]:
    """(bytes the layer's collective moves, its matmul's FLOPs) for default_chunks. column: x
    [b, seq/tp, in] all-gathered then times W [out/tp, in]; row: x [b, seq, in/tp] times
    W [out, in/tp], the output [b, seq, out] reduce-scattered."""
    tokens = x_shape[0] * x_shape[1]
    if kind == "column":
        return tokens * tp * x_shape[2] * elem, 2.0 * tokens * tp * x_shape[2] * weight_shape[0]
    return tokens * weight_shape[0] * elem, 2.0 * tokens * weight_shape[0] * weight_shape[1]


def chunks_for(layer, x: torch.Tensor, kind: str) -> int:
    """K for this call of a column- or row-parallel `layer` (tensor.py): its own
    tp_overlap_chunks, else the cost model's K for this input shape, worked out once per
    shape and kept on the layer (`tp_overlap_auto`: shape -> K). K = 1 means nothing can be
    hidden: the caller then runs the plain sequence-parallel path, so auto never loses to it."""
    if layer.tp_overlap_chunks:
        return layer.tp_overlap_chunks
    key = (tuple(x.shape), x.dtype)
    k = layer.tp_overlap_auto.get(key)
    if k is None:
        cost = overlap_cost(
            kind, tuple(x.shape), x.element_size(), tuple(layer.weight.shape), layer.group.size
        )
        k = layer.tp_overlap_auto[key] = default_chunks(layer.group, *cost)
    return k


class _ColumnSP(torch.autograd.Function):
    """x [b, seq/tp, in] (SP shard) -> gather(x) Wᵀ [b, seq, out/tp], K chunks overlapped."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks):
        tp, (b, sl) = group.size, x.shape[:2]
        spans = _spans(sl, chunks)
        x_full = x.new_empty(b, sl * tp, x.shape[2])  # saved for dW, as the plain layer saves it
        y = x.new_empty(b, sl * tp, weight.shape[0])

        def issue(i):
            c0, c1 = spans[i]
            return comm.all_gather(x[:, c0:c1].contiguous(), group, 1, async_op=True)

        pending = issue(0)
        for i, (c0, c1) in enumerate(spans):
            nxt = issue(i + 1) if i + 1 < len(spans) else None
            xk = pending.wait()  # [b, tp*ck, in]
            _put_rows(y, xk @ weight.t(), tp, c0, c1)
            _put_rows(x_full, xk, tp, c0, c1)
            pending = nxt
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.spans = group, spans
        return y

    @staticmethod
    def backward(ctx, g):
        x_full, weight = ctx.saved_tensors
        group, spans = ctx.group, ctx.spans
        g = g.contiguous()
        parts, pending = [], None
        for c0, c1 in spans:
            gx = (rows(g, group.size, c0, c1) @ weight).contiguous()  # [b, tp*ck, in]
            handle = comm.reduce_scatter(gx, group, "sum", 1, async_op=True)
            if pending is not None:
                parts.append(pending.wait())
            pending = handle
        # dW runs while the last reduce-scatter is in flight.
        dw = g.flatten(0, -2).t() @ x_full.flatten(0, -2)  # [out/tp, in]
        parts.append(pending.wait())
        return torch.cat(parts, 1), dw, None, None


class _RowSP(torch.autograd.Function):
    """x [b, seq, in/tp] -> reduce_scatter(x Wᵀ) [b, seq/tp, out], K chunks overlapped."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks):
        tp, s = group.size, x.shape[1]
        if s % tp:
            raise comm.ConfigError(
                f"parallel.tp_overlap needs the sequence length divisible by parallel.tp={tp}, got "
                f"seq={s}; pad the batch to a multiple of {tp} or turn tp_overlap off"
            )
        spans = _spans(s // tp, chunks)
        x = x.contiguous()
        parts, pending = [], None
        for c0, c1 in spans:
            yk = (rows(x, tp, c0, c1) @ weight.t()).contiguous()  # partial sums [b, tp*ck, out]
            handle = comm.reduce_scatter(yk, group, "sum", 1, async_op=True)
            if pending is not None:
                parts.append(pending.wait())
            pending = handle
        parts.append(pending.wait())
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.spans = group, spans
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        group, spans, tp = ctx.group, ctx.spans, ctx.group.size
        g = g.contiguous()
        dx = torch.empty_like(x)
        dw = torch.zeros_like(weight)

        def issue(i):
            c0, c1 = spans[i]
            return comm.all_gather(g[:, c0:c1].contiguous(), group, 1, async_op=True)

        pending = issue(0)
        for i, (c0, c1) in enumerate(spans):
            nxt = issue(i + 1) if i + 1 < len(spans) else None
            gk = pending.wait()  # [b, tp*ck, out]
            _put_rows(dx, gk @ weight, tp, c0, c1)
            dw += gk.flatten(0, -2).t() @ rows(x, tp, c0, c1).flatten(0, -2)
            pending = nxt
        return dx, dw, None, None


def column_sp(x: torch.Tensor, weight: torch.Tensor, group: comm.Group, chunks: int | None) -> torch.Tensor:
    """`F.linear(gather_sp(x), weight)` with the all-gather overlapped in `chunks` pieces
    (None: the cost model's K for this shape)."""
    if not chunks:
        chunks = default_chunks(
            group, *overlap_cost("column", tuple(x.shape), x.element_size(), weight.shape, group.size)
        )
    return _ColumnSP.apply(x, weight, group, chunks)


def row_sp(x: torch.Tensor, weight: torch.Tensor, group: comm.Group, chunks: int | None) -> torch.Tensor:
    """`reduce_scatter_sp(F.linear(x, weight))` with the reduce-scatter overlapped."""
    if not chunks:
        chunks = default_chunks(
            group, *overlap_cost("row", tuple(x.shape), x.element_size(), weight.shape, group.size)
        )
    return _RowSP.apply(x, weight, group, chunks)
