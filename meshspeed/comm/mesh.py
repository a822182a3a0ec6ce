"""ParallelDims: the degrees of parallelism, validated, and the mesh of groups they imply.

Rank layout (tp innermost so tensor parallelism, the chattiest, stays inside a node; pp
outermost so pipeline stages, the quietest, span nodes):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism borrows ranks from dp × cp as Megatron and torchtitan do: the dp·cp ranks
of one (pp, tp) line are cut into consecutive blocks of `ep` (the expert groups); members at
the same position of each block form the expert-data-parallel ("edp") group that averages
expert gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from meshspeed.comm.context import CommContext
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group

MESH_DIMS = ("pp", "dp", "cp", "tp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism. Their product dp·pp·cp·tp must equal the world size."""

    dp: int = 1
    """Data parallel: replicas that see different samples and average gradients."""
    pp: int = 1
    """Pipeline parallel: stages holding consecutive layers."""
    cp: int = 1
    """Context parallel: shards of the sequence dimension inside attention."""
    tp: int = 1
    """Tensor parallel: shards of each weight matrix (innermost: stays inside a node)."""
    ep: int = 1
    """Expert parallel: MoE experts spread over ranks borrowed from dp × cp; must divide dp·cp."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{f.name}={v!r} must be an integer ≥ 1")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide dp×cp = {self.dp * self.cp} (expert parallelism borrows "
                f"data/context-parallel ranks); valid: {', '.join(map(str, _divisors(self.dp * self.cp)))}"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def check_world(self, world_size: int) -> None:
        if self.world_size == world_size:
            return
        rest = self.pp * self.cp * self.tp
        hint = (
            f"e.g. dp={world_size // rest} with the other degrees as they are"
            if world_size % rest == 0
            else f"e.g. dp={world_size} with pp=cp=tp=1"
        )
        raise ConfigError(
            f"parallel degrees dp={self.dp} × pp={self.pp} × cp={self.cp} × tp={self.tp} = {self.world_size} "
            f"ranks, but the world size is {world_size}; choose degrees whose product is {world_size}, {hint}"
        )

    def coords(self, rank: int) -> dict[str, int]:
        tp_i = rank % self.tp
        cp_i = rank // self.tp % self.cp
        dp_i = rank // (self.tp * self.cp) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        dpcp = dp_i * self.cp + cp_i
        return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "ep": dpcp % self.ep, "edp": dpcp // self.ep}

    def partitions(self) -> dict[str, list[list[int]]]:
        """For each group kind, the list of rank lists it splits the world into."""
        grid = torch.arange(self.world_size).view(self.pp, self.dp, self.cp, self.tp)
        out = {}
        for i, name in enumerate(MESH_DIMS):
            out[name] = grid.movedim(i, -1).reshape(-1, grid.shape[i]).tolist()
        lines = (
            grid.reshape(self.pp, self.dp * self.cp, self.tp)
            .movedim(1, -1)
            .reshape(-1, self.dp * self.cp)
            .tolist()
        )
        out["dp_cp"] = lines
        out["ep"] = [
            line[b * self.ep : (b + 1) * self.ep] for line in lines for b in range(len(line) // self.ep)
        ]
        out["edp"] = [line[j :: self.ep] for line in lines for j in range(self.ep)]
        return out

    def build(self, ctx: CommContext) -> Mesh:
        self.check_world(ctx.world_size)
        return ctx.mesh_for(self, lambda: Mesh(self, ctx))


def _backend_options(backend: str, timeout):
    """The backend's process-group options carrying `timeout`, or None for a backend whose
    options class torch does not expose (its groups then get torch's default timeout, and
    meshspeed enforces its own deadline on every wait instead)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
    else:
        return None
    opts._timeout = timeout
    return opts


def _timeout_overrides(dims: ParallelDims, ctx: CommContext) -> tuple[dict, dict]:
    """init_device_mesh makes its groups with torch's default timeout (30 min on gloo, 10 on
    NCCL) unless told otherwise: pass the context's timeout for every dim that communicates
    (a dim of size 1 never does). A dim spanning the whole world then gets a group of its own
    rather than the default one, which DeviceMesh would otherwise reuse only sometimes (not for
    gloo on a CUDA machine). Returns (backend_override, the timeout in seconds each dim's group
    carries, None where unknown)."""
    override, timeouts = {}, {}
    for name in MESH_DIMS:
        opts = _backend_options(ctx.backend, ctx.group_timeout) if getattr(dims, name) > 1 else None
        if opts is not None:
            override[name] = (ctx.backend, opts)
        timeouts[name] = ctx.group_timeout.total_seconds() if opts is not None else None
    return override, timeouts


class Mesh:
    """This rank's view of a ParallelDims layout: coordinates, groups, and the DeviceMesh."""

    GROUPS = MESH_DIMS + ("dp_cp", "ep", "edp", "world", "node", "xnode")

    def __init__(self, dims: ParallelDims, ctx: CommContext):
        self.dims, self.ctx = dims, ctx
        self.coords = dims.coords(ctx.rank)
        self.device_mesh = None
        self._groups: dict[str, Group] = {"world": ctx.world}
        if ctx.world_size == 1:
            for name in self.GROUPS[:-3]:
                self._groups[name] = ctx.single(name)
            self._groups["node"] = self._groups["xnode"] = ctx.world
            return
        parts = dims.partitions()
        # Build the DeviceMesh first and reuse its process groups for the four mesh dims, so
        # DTensor users and meshspeed layers share groups instead of doubling them.
        from torch.distributed.device_mesh import init_device_mesh

        override, timeouts = _timeout_overrides(dims, ctx)
        self.device_mesh = init_device_mesh(
            ctx.device.type,
            tuple(getattr(dims, d) for d in MESH_DIMS),
            mesh_dim_names=MESH_DIMS,
            backend_override=override,
        )
        for name in MESH_DIMS:
            mine = next(r for r in parts[name] if ctx.rank in r)
            self._groups[name] = (
                ctx.adopt(self.device_mesh.get_group(name), mine, name, timeouts[name])
                if len(mine) > 1
                else ctx.single(name)
            )
        for name in ("dp_cp", "ep", "edp"):
            self._groups[name] = ctx.split(parts[name], name)
        k = ctx.ranks_per_node
        self._groups["node"] = ctx.split(
            [list(range(n * k, n * k + k)) for n in range(ctx.num_nodes)], "node"
        )
        self._groups["xnode"] = ctx.split([list(range(i, ctx.world_size, k)) for i in range(k)], "xnode")

    def expert_device_mesh(self):
        """A 1-D DeviceMesh over this rank's ep group, for tensors split over "ep" (checkpoints
        place expert shards on it; the ranks holding the same experts write the same chunks,
        which DCP writes once). Made without process groups: placing tensors needs none."""
        if getattr(self, "_expert_dm", None) is None:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.tensor(self["ep"].ranks)
            self._expert_dm = DeviceMesh(
                self.ctx.device.type, ranks, mesh_dim_names=("ep",), _init_backend=False
            )
        return self._expert_dm

    def group(self, name: str) -> Group:
        """The group of this rank along `name`: pp, dp, cp, tp, dp_cp, ep, edp, world, node
        (ranks on this node) or xnode (this rank's peers with the same local index elsewhere)."""
        if name not in self._groups:
            raise ConfigError(f"no mesh group {name!r}; valid: {', '.join(self.GROUPS)}")
        return self._groups[name]

    __getitem__ = group

    def __repr__(self) -> str:
        c = " ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"Mesh(rank {self.ctx.rank}: {c})"
