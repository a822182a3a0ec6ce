"""ParallelDims: the degrees of parallelism, validated, and the mesh of groups they imply.

Rank layout (tp innermost so tensor parallelism, the chattiest, stays inside a node; pp
outermost so pipeline stages, the quietest, span nodes):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Expert parallelism borrows ranks from dp × cp as Megatron and torchtitan do: the dp·cp ranks
of one (pp, tp) line are cut into consecutive blocks of `ep` (the expert groups); members at
the same position of each block form the expert-data-parallel ("edp") group that averages
expert gradients. With tp > 1 the tp ranks join the expert layout in one of three ways:

    etp = tp (default)   each expert's weights are split over tp: ep and edp groups per tp rank
    etp = 1              every tp rank holds whole experts and takes 1/tp of the tokens: the
                         ep group is per tp rank, edp spans tp (the same experts, other tokens)
    tp_extend_ep         the tp ranks are extra expert-parallel ranks: the ep group is the
                         ep block × tp (member j·tp + t), edp per tp rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import meshspeed.comm.gloo_transport as gloo_transport
from meshspeed.comm.context import CommContext
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group

MESH_DIMS = ("pp", "dp", "cp", "tp")


def divisors(n: int) -> list[int]:
    """1 .. n's divisors, ascending."""
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
    etp: int = 0
    """Expert tensor parallel: 0 or tp = expert weights split over tp; 1 = whole on every tp rank."""
    tp_extend_ep: bool = False
    """Fold the tp ranks into the expert-parallel group (ep·tp expert ranks; experts whole)."""

    def __post_init__(self):
        for name in ("dp", "pp", "cp", "tp", "ep"):  # the degrees
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{name}={v!r} must be an integer ≥ 1")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide dp×cp = {self.dp * self.cp} (expert parallelism borrows "
                f"data/context-parallel ranks); valid: {', '.join(map(str, divisors(self.dp * self.cp)))}"
            )
        if self.etp not in (0, 1, self.tp) or isinstance(self.etp, bool):
            raise ConfigError(
                f"parallel.etp={self.etp!r} must be 1 (whole experts on every tp rank) or "
                f"tp={self.tp} (each expert split over tp), or 0 for tp"
            )
        if not isinstance(self.tp_extend_ep, bool) or (self.tp_extend_ep and self.etp > 1):
            raise ConfigError(
                f"moe.tp_extend_ep={self.tp_extend_ep!r} with parallel.etp={self.etp}: folding tp into "
                "the expert-parallel group keeps experts whole; set parallel.etp=1 (or 0)"
            )

    @property
    def expert_tp(self) -> str:
        """How tp ranks hold experts: 'split' (weights over tp), 'tokens' (whole experts, tokens
        split over tp) or 'fold' (tp ranks are extra ep ranks). 'split' when tp = 1."""
        if self.tp == 1:
            return "split"
        if self.tp_extend_ep:
            return "fold"
        return "tokens" if self.etp == 1 else "split"

    def size(self, name: str) -> int:
        """Ranks in this rank's group `name` (a mesh dim, dp_cp, ep or edp)."""
        fold, tokens = self.expert_tp == "fold", self.expert_tp == "tokens"
        sizes = {
            "dp_cp": self.dp * self.cp,
            "ep": self.ep * (self.tp if fold else 1),
            "edp": self.dp * self.cp // self.ep * (self.tp if tokens else 1),
        }
        return sizes[name] if name in sizes else getattr(self, name)

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
        ep_i, edp_i = dpcp % self.ep, dpcp // self.ep
        if self.expert_tp == "fold":
            ep_i = ep_i * self.tp + tp_i
        elif self.expert_tp == "tokens":
            edp_i = edp_i * self.tp + tp_i
        return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "ep": ep_i, "edp": edp_i}

    def members(self, name: str, rank: int = 0) -> list[int]:
        """The ranks of `rank`'s group `name` (a mesh dim, dp_cp, ep or edp), ascending: the row
        of `partitions()[name]` that holds `rank`, in closed form. The planner asks this of
        worlds of 10^5 ranks and more, where building every partition costs seconds."""
        c, tp, cp, dp = self.coords(rank), self.tp, self.cp, self.dp
        strides = {"tp": 1, "cp": tp, "dp": tp * cp, "pp": tp * cp * dp}
        if name in strides:
            base = rank - c[name] * strides[name]
            return [base + k * strides[name] for k in range(getattr(self, name))]
        dpcp, t = dp * cp, c["tp"]
        line = c["pp"] * dpcp  # rank = (line + j) * tp + t for the j-th member of the dp·cp line
        if name == "dp_cp":
            return [(line + j) * tp + t for j in range(dpcp)]
        pos = c["dp"] * cp + c["cp"]
        block, j = pos // self.ep * self.ep, pos % self.ep  # the ep block's first position; place in it
        mode = self.expert_tp
        if name == "ep":
            ts = range(tp) if mode == "fold" else (t,)
            return [(line + block + i) * tp + u for i in range(self.ep) for u in ts]
        if name == "edp":
            ts = range(tp) if mode == "tokens" else (t,)
            return [(line + b + j) * tp + u for b in range(0, dpcp, self.ep) for u in ts]
        raise ConfigError(f"no mesh group {name!r}; valid: {', '.join(MESH_DIMS)}, dp_cp, ep, edp")

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
        # [pp, dp·cp, tp]: the ep blocks cut dim 1; tp joins ep ("fold") or edp ("tokens")
        lay = grid.reshape(self.pp, self.dp * self.cp // self.ep, self.ep, self.tp).tolist()
        mode, ep_out, edp_out, ts, js = self.expert_tp, [], [], range(self.tp), range(self.ep)
        for blocks in lay:  # one pipeline stage: blocks[b][j][t]
            if mode == "fold":
                ep_out += [[bl[j][t] for j in js for t in ts] for bl in blocks]
            else:
                ep_out += [[bl[j][t] for j in js] for t in ts for bl in blocks]
            if mode == "tokens":
                edp_out += [[bl[j][t] for bl in blocks for t in ts] for j in js]
            else:
                edp_out += [[bl[j][t] for bl in blocks] for t in ts for j in js]
        out["ep"], out["edp"] = ep_out, edp_out
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
        with gloo_transport.shared(ctx.backend):
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

    def expert_device_mesh(self, with_tp: bool = False):
        """A DeviceMesh over this rank's ep group, for tensors split over "ep" (checkpoints
        place expert shards on it; the ranks holding the same experts write the same chunks,
        which DCP writes once); `with_tp`: 2-D ("ep", "tp"), for expert weights also split over
        tp (row j: ep member j's tp group). Made without process groups: placing tensors needs none."""
        cache = self.__dict__.setdefault("_expert_dms", {})
        if with_tp not in cache:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.tensor(self["ep"].ranks)
            names = ("ep",)
            if with_tp:  # tp is innermost: ep member j's tp peers are its rank - tp_i + t
                ranks = ranks.view(-1, 1) - self.coords["tp"] + torch.arange(self.dims.tp)
                names = ("ep", "tp")
            cache[with_tp] = DeviceMesh(
                self.ctx.device.type, ranks, mesh_dim_names=names, _init_backend=False
            )
        return cache[with_tp]

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
