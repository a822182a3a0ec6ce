"""The backend's own collectives called directly, with nothing of meshspeed around them.

Only for benchmarks: `meshspeed bench comm` times these next to meshspeed's path in the same
run so meshspeed's overhead (or gain) is a measured ratio, not a claim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshspeed.comm.group import Group

_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def raw_call(
    op: str,
    group: Group,
    inp: torch.Tensor,
    out: torch.Tensor | None,
    redop: str = "sum",
    async_op: bool = False,
) -> Callable[[], object]:
    """A zero-argument function running one raw `op` on preallocated buffers (returning the
    backend's Work when async_op)."""
    pg, red = group.pg, _OPS.get(redop, dist.ReduceOp.SUM)
    if redop == "avg":
        red = dist.ReduceOp.AVG
    if op == "all_reduce":
        return lambda: dist.all_reduce(inp, op=red, group=pg, async_op=async_op)
    if op == "all_gather":
        return lambda: _ag(out, inp, group=pg, async_op=async_op)
    if op == "reduce_scatter":
        return lambda: _rs(out, inp, op=red, group=pg, async_op=async_op)
    if op == "broadcast":
        src = group.ranks[0]
        return lambda: dist.broadcast(inp, src=src, group=pg, async_op=async_op)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp, group=pg, async_op=async_op)
    raise ValueError(f"no raw call for {op}")
