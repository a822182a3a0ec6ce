"""Checkpoint I/O through torch.distributed.checkpoint (DCP): the thin layer under
`meshspeed.train.checkpoint`.

It is the one deliberate use of torch.distributed outside the collectives: DCP runs its own
planning collectives on the default group, and its resharding works on DTensors, which need the
DeviceMesh. Everything here is mechanism; the policy (directories, atomicity, what goes in)
lives in the train layer.

A tensor is described to this module by its *local* value plus an optional `ShardSpec`
(mesh dim, tensor dim, full shape) — contract 1 of parallel/CONTRACTS.md. A sharded tensor
becomes `DTensor(Shard(dim))` on that mesh dim's sub-mesh; every other mesh dim is implicitly
replicated, so replicas write identical chunk indices and DCP's planner keeps one copy. An
untagged tensor is saved as a plain tensor (replicated; DCP dedups it the same way). On load the
DTensors are built for the CURRENT layout around the destination tensors, so DCP reads exactly
the slice each rank needs from whatever layout wrote the files.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshspeed.comm.collectives import all_gather
from meshspeed.comm.errors import CommError, ConfigError

try:  # public since torch 2.4
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Shard


class CheckpointIOError(CommError):
    """DCP failed; raised on every rank (DCP gathers each rank's failure), naming the ranks and causes."""


def _dcp(what: str, fn, *args, **kwargs):
    # DCP's CheckpointException derives from BaseException (`except Exception` misses it) and
    # prints whole tracebacks; turn it into one line naming each failing rank's error.
    try:
        with warnings.catch_warnings():
            # A lone process (no process group) is a supported case, not one to warn about.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            return fn(*args, **kwargs)
    except CheckpointException as e:
        causes = "; ".join(f"rank {r}: {type(x[0]).__name__}: {x[0]}" for r, x in sorted(e.failures.items()))
        raise CheckpointIOError(f"DCP {what} failed on rank{'s' if len(e.failures) > 1 else ''} "
                                f"{', '.join(map(str, sorted(e.failures)))} ({causes})") from None


class ShardSpec(NamedTuple):
    """`local` is shard i (torch.chunk semantics) of a `full_shape` tensor split along `dim`
    over the mesh group `group` (one of the DeviceMesh dims: pp dp cp tp)."""

    group: str
    dim: int
    full_shape: torch.Size


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Extent of each torch.chunk piece of a length-n dim split `parts` ways (trailing ones may be 0)."""
    c = math.ceil(n / parts) if n else 0
    return [max(0, min(c, n - i * c)) for i in range(parts)]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _wrap(name: str, local: torch.Tensor, spec: ShardSpec | None, mesh):
    if spec is None:
        return local
    group = mesh[spec.group]
    want = list(spec.full_shape)
    want[spec.dim] = chunk_sizes(spec.full_shape[spec.dim], group.size)[group.rank]
    if list(local.shape) != want:
        raise ConfigError(f"{name}: local shard shape {list(local.shape)} is not torch.chunk piece {group.rank} "
                          f"of {list(spec.full_shape)} along dim {spec.dim} over {group.size} ranks (expected {want})")
    if group.size == 1:
        return local
    dims = (mesh.device_mesh.mesh_dim_names or ()) if mesh.device_mesh is not None else ()
    if spec.group not in dims:
        raise ConfigError(f"{name}: sharded over {spec.group!r}, which is not a DeviceMesh dim; "
                          f"checkpoints can reshard over {', '.join(dims) or 'no dim'}")
    sub = mesh.device_mesh[spec.group]
    return DTensor.from_local(local, sub, [Shard(spec.dim)], run_check=False,
                              shape=torch.Size(spec.full_shape), stride=_contiguous_stride(spec.full_shape))


def _state(tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec], mesh) -> dict:
    return {k: _wrap(k, t.detach(), specs.get(k), mesh) for k, t in tensors.items()}


def save(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec], mesh) -> None:
    """Collective over the world: every rank writes its shards of `tensors` under directory
    `path` (one file per rank plus DCP's `.metadata`); replicated chunks are written once."""
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
    _dcp("save", dcp.save, _state(tensors, specs, mesh), storage_writer=writer, no_dist=not _distributed())


def load(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec], mesh) -> None:
    """Collective over the world: fill `tensors` (this rank's local shards, described by `specs`
    in the current layout) in place from the DCP checkpoint at `path`, whatever layout wrote it.
    Values are cast to each destination tensor's dtype."""
    state = _state(tensors, specs, mesh)
    _dcp("load", dcp.load, state, storage_reader=FileSystemReader(path), no_dist=not _distributed())
    # DCP copies into each DTensor's local tensor; from_local shares storage with ours, but a
    # planner is free to substitute tensors, so copy back whatever is not the same storage.
    for k, t in tensors.items():
        v = state[k]
        local = v.to_local() if isinstance(v, DTensor) else v
        if local.data_ptr() != t.data_ptr() or local.shape != t.shape:
            with torch.no_grad():
                t.copy_(local)


def saved_tensors(path: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(full shape, dtype) of every tensor in the DCP checkpoint at `path`, whichever ranks wrote
    it (DCP's metadata is the union over all of them); read on this rank, no collective."""
    md = FileSystemReader(path).read_metadata()
    return {k: (v.size, v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def gather_full(local: torch.Tensor, spec: ShardSpec | None, mesh) -> torch.Tensor:
    """The full tensor from its shards (collective over the spec's group; a no-op if replicated)."""
    if spec is None:
        return local
    group = mesh[spec.group]
    if group.size == 1:
        return local
    sizes = chunk_sizes(spec.full_shape[spec.dim], group.size)  # trailing ones may be 0: fine
    full = all_gather(local.contiguous(), group, dim=spec.dim, sizes=sizes)
    return full.reshape(spec.full_shape)
