"""meshspeed.comm: the only package that calls torch.distributed.

ctx = comm.init()                         # joins the job (torchrun / meshspeed spawn) or runs alone
mesh = comm.ParallelDims(dp=2, tp=2).build(ctx)
comm.all_reduce(grad, mesh["dp"], op="avg")
h = comm.all_gather(x, mesh["tp"], dim=-1, async_op=True); ...; y = h.wait()
"""

from meshspeed.comm import placement
from meshspeed.comm.autograd import (
    InFlight,
    all_to_all_ad,
    all_to_all_start,
    all_to_all_wait,
    copy_to,
    gather_from,
    gather_sp,
    reduce_from,
    reduce_scatter_sp,
    split_to,
)
from meshspeed.comm.collectives import (
    REDUCE_OPS,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    reduce_scatter,
    select_algo,
)
from meshspeed.comm.context import CommContext, init, launched
from meshspeed.comm.cost_model import ALGOS, LinkParams
from meshspeed.comm.errors import CollectiveTimeout, CommError, ConfigError, DesyncError
from meshspeed.comm.group import Group, Handle
from meshspeed.comm.launch import spawn
from meshspeed.comm.mesh import Mesh, ParallelDims
from meshspeed.comm.p2p import P2P, batch, irecv, isend, recv, send
from meshspeed.comm.placement import Partial, Replicate, Shard, Sharding

__all__ = [
    "ALGOS",
    "REDUCE_OPS",
    "CollectiveTimeout",
    "CommContext",
    "CommError",
    "ConfigError",
    "DesyncError",
    "Group",
    "Handle",
    "LinkParams",
    "Mesh",
    "P2P",
    "ParallelDims",
    "Partial",
    "Replicate",
    "Shard",
    "Sharding",
    "placement",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "InFlight",
    "all_to_all_ad",
    "all_to_all_start",
    "all_to_all_wait",
    "barrier",
    "batch",
    "broadcast",
    "copy_to",
    "gather_from",
    "gather_sp",
    "init",
    "irecv",
    "isend",
    "launched",
    "recv",
    "reduce_from",
    "reduce_scatter",
    "reduce_scatter_sp",
    "select_algo",
    "send",
    "spawn",
    "split_to",
]
