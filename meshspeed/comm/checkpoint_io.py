"""Checkpoint I/O through torch.distributed.checkpoint (DCP): the thin layer under
`meshspeed.train.checkpoint`.

It is the one deliberate use of torch.distributed outside the collectives: DCP runs its own
planning collectives on the default group, and its resharding works on DTensors, which need the
DeviceMesh. Everything here is mechanism; the policy (directories, atomicity, what goes in)
lives in the train layer.

A tensor is described to this module by its *local* value plus an optional
`comm.placement.Sharding` (full shape, (mesh dim, Shard(dim)) axes). A sharded tensor becomes a
DTensor with those Shard placements on the sub-mesh of its mesh dims; every other mesh dim is
implicitly replicated, so replicas write identical chunk indices and DCP's planner keeps one copy. An
untagged tensor is saved as a plain tensor (replicated; DCP dedups it the same way). On load the
DTensors are built for the CURRENT layout around the destination tensors, so DCP reads exactly
the slice each rank needs from whatever layout wrote the files.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshspeed.comm.errors import CommError, ConfigError
from meshspeed.comm.placement import Shard, Sharding

try:  # public since torch 2.4
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor
    from torch.distributed._tensor import Shard as DShard


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


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _wrap(name: str, local: torch.Tensor, sharding: Sharding | None, mesh):
    if sharding is None:
        return local
    axes = [(d, p) for d, p in sharding.axes if mesh[d].size > 1]
    if any(not isinstance(p, Shard) for _, p in axes):
        raise ConfigError(f"{name}: checkpoints save Shard splits only, not {sharding}")
    sizes = {d: mesh[d].size for d, _ in sharding.axes}
    coords = {d: mesh[d].rank for d, _ in sharding.axes}
    want = sharding.local_shape(coords, sizes)
    if local.shape != want:
        raise ConfigError(f"{name}: local shard shape {list(local.shape)} is not this rank's torch.chunk piece "
                          f"of {sharding} (expected {list(want)})")
    if not axes:
        return local
    dims = (mesh.device_mesh.mesh_dim_names or ()) if mesh.device_mesh is not None else ()
    missing = [d for d, _ in axes if d not in dims]
    if missing:
        raise ConfigError(f"{name}: sharded over {missing[0]!r}, which is not a DeviceMesh dim; "
                          f"checkpoints can reshard over {', '.join(dims) or 'no dim'}")
    names = tuple(d for d, _ in axes)
    sub = mesh.device_mesh[names if len(names) > 1 else names[0]]
    full = torch.Size(sharding.full_shape)
    return DTensor.from_local(local, sub, [DShard(p.dim % len(full)) for _, p in axes], run_check=False,
                              shape=full, stride=_contiguous_stride(full))


def _state(tensors: dict[str, torch.Tensor], specs: dict[str, Sharding], mesh) -> dict:
    return {k: _wrap(k, t.detach(), specs.get(k), mesh) for k, t in tensors.items()}


def save(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, Sharding], mesh) -> None:
    """Collective over the world: every rank writes its shards of `tensors` under directory
    `path` (one file per rank plus DCP's `.metadata`); replicated chunks are written once."""
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
    _dcp("save", dcp.save, _state(tensors, specs, mesh), storage_writer=writer, no_dist=not _distributed())


def load(path: str, tensors: dict[str, torch.Tensor], specs: dict[str, Sharding], mesh) -> None:
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
