"""The one placement vocabulary: how a local tensor relates to its full (logical) tensor.

Every layer that splits tensors says it with these words: tensor parallelism (weights),
ZeRO (gradient-norm accounting), checkpoints (resharding), safetensors export (gathering),
sparsity (masks laid out like their weights), and the pipeline and recipes above them.

    Replicate()      every member holds the whole tensor
    Shard(dim)       member i holds torch.chunk piece i along `dim` (uneven: the last pieces
                     may be shorter or empty) — what DTensor's Shard(dim) and DCP expect
    Partial("sum")   every member holds a summand; the full value is their sum

A sharded parameter (or a buffer laid out like one) carries a `Sharding`: its full shape and
one (mesh dim, placement) per split axis, applied in order (an expert weight may be split over
"ep" along dim 0 and over "tp" along dim 1). Untagged tensors are replicated.

DTensor is the model (its Shard/Replicate/Partial), but parameters stay plain tensors: a
column-parallel linear's forward + backward through DTensor took 1.7x (1024 features) to 3.1x
(64 features) the plain-tensor time on 2 CPU ranks (benchmarks/placement_overhead.py), paid by
every matmul; the tags cost nothing and checkpoints wrap tensors in DTensors only at save/load
time (checkpoint_io.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshspeed.comm.collectives import all_gather, all_reduce
from meshspeed.comm.errors import ConfigError

ATTR = "_ms_sharding"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "replicate"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"shard({self.dim})"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __str__(self) -> str:
        return f"partial({self.op})"


Placement = Replicate | Shard | Partial


def chunk_bounds(n: int, parts: int) -> list[int]:
    """parts + 1 offsets of torch.chunk's pieces of a length-n dim: piece i starts at
    i * ceil(n / parts); the last pieces may be shorter or empty."""
    size = -(-n // parts) if parts else 0
    return [min(i * size, n) for i in range(parts + 1)]


def chunk_sizes(n: int, parts: int) -> list[int]:
    offs = chunk_bounds(n, parts)
    return [offs[i + 1] - offs[i] for i in range(parts)]


def local_piece(full: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    """Member `rank`'s piece of `full` (a view; no copy, no communication). Partial: rank 0
    holds the value and the others zeros, so the sum is the value."""
    if isinstance(placement, Shard):
        dim = placement.dim % full.dim()
        offs = chunk_bounds(full.shape[dim], size)
        return full.narrow(dim, offs[rank], offs[rank + 1] - offs[rank])
    if isinstance(placement, Partial):
        return full if rank == 0 else torch.zeros_like(full)
    return full


def assemble(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The full tensor from every member's piece, in member order (the inverse of local_piece)."""
    if isinstance(placement, Shard):
        return torch.cat(pieces, dim=placement.dim % pieces[0].dim())
    if isinstance(placement, Partial):
        return torch.stack(pieces).sum(0)
    return pieces[0]


def gather(local: torch.Tensor, placement: Placement, group, full_extent: int | None = None) -> torch.Tensor:
    """The full tensor from this member's piece: collective over `group` (no gradient).
    Shard needs the full extent along its dim when pieces may be uneven."""
    if group.size == 1 or isinstance(placement, Replicate):
        return local
    if isinstance(placement, Partial):
        return all_reduce(local.detach().clone(), group)
    dim = placement.dim % local.dim()
    n = full_extent if full_extent is not None else local.shape[dim] * group.size
    return all_gather(local.detach().contiguous(), group, dim, sizes=chunk_sizes(n, group.size))


@dataclass(frozen=True)
class Sharding:
    """How a local tensor is cut from its full one: `axes` are (mesh dim, placement), applied in
    order; every mesh dim not named is replicated."""

    full_shape: torch.Size
    axes: tuple[tuple[str, Placement], ...]

    def placement(self, mesh_dim: str) -> Placement:
        return next((p for d, p in self.axes if d == mesh_dim), Replicate())

    def shard_dims(self) -> dict[str, int]:
        """mesh dim -> tensor dim, for the Shard axes."""
        return {d: p.dim % len(self.full_shape) for d, p in self.axes if isinstance(p, Shard)}

    def local_shape(self, coords: dict[str, int], sizes: dict[str, int]) -> torch.Size:
        shape = list(self.full_shape)
        for d, p in self.axes:
            if isinstance(p, Shard):
                k = p.dim % len(shape)
                shape[k] = chunk_sizes(shape[k], sizes[d])[coords[d]]
        return torch.Size(shape)

    def __str__(self) -> str:
        axes = ", ".join(f"{d}: {p}" for d, p in self.axes) or "replicate"
        return f"{list(self.full_shape)} [{axes}]"


def sharding_of(t: torch.Tensor) -> Sharding | None:
    """The tensor's Sharding, or None for a replicated (untagged) tensor."""
    return getattr(t, ATTR, None)


def tag(t: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
    """Attach `sharding` to `t` (None: remove); returns t."""
    if sharding is None:
        if hasattr(t, ATTR):
            delattr(t, ATTR)
    else:
        setattr(t, ATTR, sharding)
    return t


def add_axis(t: torch.Tensor, full_shape: torch.Size, mesh_dim: str, placement: Placement) -> Sharding:
    """The Sharding of `t` after one more split over `mesh_dim` (its previous axes kept)."""
    old = sharding_of(t)
    if old is not None and any(d == mesh_dim for d, _ in old.axes):
        raise ConfigError(f"tensor already split over {mesh_dim!r} ({old}); split each mesh dim once")
    base = old.full_shape if old is not None else torch.Size(full_shape)
    return Sharding(base, (old.axes if old is not None else ()) + ((mesh_dim, placement),))


def shard_tensor(full: torch.Tensor, mesh_dim: str, placement: Placement, group) -> torch.Tensor:
    """This member's piece of `full` split over `group` (mesh dim `mesh_dim`), tagged. Works on
    meta tensors, so a model built on the meta device can be split before it holds memory.
    An empty piece is a one-line error (checked alike on every member, so all raise)."""
    if isinstance(placement, Shard):
        dim = placement.dim % full.dim()
        n = full.shape[dim]
        if min(chunk_sizes(n, group.size)) == 0:
            ok = ", ".join(str(q) for q in range(1, group.size) if min(chunk_sizes(n, q)) > 0)
            raise ConfigError(
                f"parallel.{mesh_dim}={group.size} leaves an empty piece of a {list(full.shape)} "
                f"tensor along dim {dim}; valid {mesh_dim}: {ok}"
            )
    sharding = add_axis(full, full.shape, mesh_dim, placement)
    local = local_piece(full.detach(), placement, group.rank, group.size)
    return tag(local, sharding)


def full_tensor(local: torch.Tensor, mesh, sharding: Sharding | None = None) -> torch.Tensor:
    """The full tensor of a local piece laid out as `sharding` (default: its own tag), no grad:
    collective over each split axis's group; the local tensor itself when replicated.
    `mesh` maps mesh dim -> Group (a comm Mesh or a dict). Gradients and optimizer moments
    pass their parameter's sharding."""
    s = sharding if sharding is not None else sharding_of(local)
    if s is None:
        return local
    out = local.detach()
    for d, p in reversed(s.axes):  # undo the last split first
        ext = s.full_shape[p.dim % len(s.full_shape)] if isinstance(p, Shard) else None
        out = gather(out, p, mesh[d], ext)
    return out.reshape(s.full_shape)


def shard_parameter(p: torch.Tensor, mesh_dim: str, placement: Placement, group) -> torch.nn.Parameter:
    """A new Parameter holding this member's tagged piece of parameter `p` (a copy on a real
    device, free on meta). The old Parameter is left for the caller to drop."""
    local = shard_tensor(p, mesh_dim, placement, group)
    q = torch.nn.Parameter(local if local.is_meta else local.clone(), requires_grad=p.requires_grad)
    return tag(q, sharding_of(local))


def full_grad(p: torch.Tensor, mesh) -> torch.Tensor | None:
    """The full-shape gradient of a (possibly split) parameter: collective over its split axes."""
    return None if p.grad is None else full_tensor(p.grad, mesh, sharding_of(p))


__all__ = [
    "ATTR",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Sharding",
    "add_axis",
    "assemble",
    "chunk_bounds",
    "chunk_sizes",
    "full_grad",
    "full_tensor",
    "gather",
    "local_piece",
    "shard_tensor",
    "shard_parameter",
    "sharding_of",
    "tag",
]
