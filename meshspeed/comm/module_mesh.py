"""ModuleMesh: one sub-model's layout (its ParallelDims) over its own ranks of the world.

A vision-language model may run its image encoder at dp 4 over all four ranks while the decoder
runs tp 2 x dp 2 over the same ranks (colocated, per-module degrees), or the encoder on ranks
0-1 and the decoder on ranks 2-3 (disaggregated). Each module then has its own mesh: the
ParallelDims rank formula applied to the module's ranks (`ranks[i]` plays rank i), and its
groups made by CommContext.split under the module's name, so they never alias another
module's groups or the whole-model Mesh's.

Building is collective over the whole world (torch's new_group requires every rank to take
part), so every rank builds every module's mesh; a rank outside the module gets a one-member
group per dim (no process group: nothing it could call would communicate) and `member` False.
The trainer runs a module on a ModuleMesh where it runs a whole model on a Mesh (a
disaggregated decoder), so it answers what the trainer asks of a Mesh: `coords`, the groups
(ep and edp included), "world" (the whole job, not the module: a gradient norm or a checkpoint
spans both modules) and a `device_mesh` for checkpoints' tensor placement. Mesh's node/xnode
groups are not made here: no per-module layout needs them yet.
"""

from __future__ import annotations

from meshspeed.comm.context import CommContext
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group
from meshspeed.comm.mesh import MESH_DIMS, ParallelDims

GROUPS = MESH_DIMS + ("dp_cp", "ep", "edp")


def parse_ranks(text: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """'0-1' / '0,2,3' / '0-1,4' / [0, 1] -> (0, 1, ...): the launcher-style rank lists
    (torchrun's and MindSpeed's dist-train configs use ranges)."""
    if isinstance(text, (list, tuple)):
        return tuple(int(r) for r in text)
    out: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"rank list {text!r} is not like '0-1' or '0,2,3'")
        out += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    return tuple(out)


class ModuleMesh:
    """This rank's view of one module's layout: `dims` over the global `ranks` (module order)."""

    def __init__(self, name: str, dims: ParallelDims, ranks: tuple[int, ...] | list[int], ctx: CommContext):
        ranks = tuple(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < ctx.world_size for r in ranks):
            raise ConfigError(
                f"modules.{name}.ranks={list(ranks)}: ranks must be distinct and in 0..{ctx.world_size - 1}"
            )
        if dims.world_size != len(ranks):
            raise ConfigError(
                f"modules.{name}: degrees dp={dims.dp} x pp={dims.pp} x cp={dims.cp} x tp={dims.tp} = "
                f"{dims.world_size} ranks, but the module has {len(ranks)} ({list(ranks)})"
            )
        self.name, self.dims, self.ranks, self.ctx = name, dims, ranks, ctx
        self.member = ctx.rank in ranks
        self.local_rank = ranks.index(ctx.rank) if self.member else None
        self.coords = dims.coords(self.local_rank) if self.member else None
        others = [[r] for r in range(ctx.world_size) if r not in ranks]
        parts = dims.partitions()
        self._groups: dict[str, Group] = {}
        for dim in GROUPS:
            # Global rank lists; the non-members as singletons, so every rank finds its group.
            partition = [[ranks[i] for i in row] for row in parts[dim]] + others
            self._groups[dim] = ctx.split(partition, f"{name}.{dim}")
        self._groups["module"] = ctx.split([list(ranks)] + others, f"{name}.all")
        self._groups["world"] = ctx.world
        self._placement: dict = {}

    def placement_mesh(self, names: tuple[str, ...]):
        """A DeviceMesh over this rank's peers along `names` (Mesh's dim order), for placing
        checkpoint tensors split over those dims: made directly (a sliced backend-less
        DeviceMesh is not supported) and without process groups (placing needs none)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        key = tuple(names)
        if key not in self._placement:
            grid = torch.tensor(self.ranks).view(*(getattr(self.dims, d) for d in MESH_DIMS))
            index = tuple(slice(None) if d in names else self.coords[d] for d in MESH_DIMS)
            self._placement[key] = DeviceMesh(
                self.ctx.device.type, grid[index], mesh_dim_names=key, _init_backend=False
            )
        return self._placement[key]

    def coords_of(self, global_rank: int) -> dict[str, int]:
        """The mesh coordinates of a member of this module, by global rank."""
        return self.dims.coords(self.ranks.index(global_rank))

    def group(self, name: str) -> Group:
        """This rank's group along `name` (pp, dp, cp, tp, dp_cp, or module: all its ranks)."""
        if name not in self._groups:
            raise ConfigError(f"no module mesh group {name!r}; valid: {', '.join(self._groups)}")
        return self._groups[name]

    __getitem__ = group

    def __repr__(self) -> str:
        return f"ModuleMesh({self.name}: ranks {list(self.ranks)}, {self.dims})"
