"""Checkpoint I/O through torch.distributed.checkpoint (DCP): the thin layer under
`meshspeed.checkpoint.dcp`.

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

import io
import os
import pathlib
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from meshspeed.comm.errors import CommError, ConfigError
from meshspeed.comm.mesh import MESH_DIMS
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
        raise CheckpointIOError(
            f"DCP {what} failed on rank{'s' if len(e.failures) > 1 else ''} "
            f"{', '.join(map(str, sorted(e.failures)))} ({causes})"
        ) from None


# -- reading DCP's metadata without running code from it ------------------------------------
# DCP's `.metadata` is a pickle, and FileSystemReader unpickles it without restriction: a
# tampered file runs any code it names. It is read here through an unpickler that can build
# only the classes DCP's tensor metadata is made of. BytesStorageMetadata is left out on
# purpose: meshspeed saves tensors only, and an entry of that kind makes DCP torch.load the
# matching bytes with weights_only=False, which would let a planted shard run code.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeCheckpointError(CommError):
    """A checkpoint file holds something that loading would execute; it was refused, not run."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return getattr(
                {
                    "torch.distributed.checkpoint.metadata": dcp_md,
                    "pathlib": pathlib,
                    "torch.distributed.checkpoint.filesystem": dcp_fs,
                    "torch": torch,
                    "torch.serialization": torch.serialization,
                }[module],
                name,
            )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} asks to load {module}.{name}, which DCP's tensor metadata never holds; refused "
            f"without running it (was the file altered?). Restore the checkpoint from a trusted copy"
        )


def read_metadata(path: str):
    """DCP's metadata of the checkpoint directory `path`, read with the allow-listed unpickler."""
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        data = f.read()
    try:
        md = _MetadataUnpickler(io.BytesIO(data), meta_path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, garbage: say so in one line
        raise CommError(f"{meta_path} is not readable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, dcp_md.Metadata):
        raise UnsafeCheckpointError(f"{meta_path} holds a {type(md).__name__}, not DCP metadata; refused")
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-listed unpickler (its tensor data
    is already read with torch.load(weights_only=True))."""

    def read_metadata(self, *args, **kwargs):
        md = read_metadata(str(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


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
        raise ConfigError(
            f"{name}: local shard shape {list(local.shape)} is not this rank's torch.chunk piece "
            f"of {sharding} (expected {list(want)})"
        )
    if not axes:
        return local
    if hasattr(mesh, "placement_mesh") and not any(d == "ep" for d, _ in axes):  # a ModuleMesh
        names = tuple(d for d in MESH_DIMS if d in dict(axes))
        return _dtensor(local, mesh.placement_mesh(names), names, dict(axes), sharding)
    device_mesh = mesh.device_mesh
    if any(d == "ep" for d, _ in axes):  # expert shards: a mesh of this rank's ep group (× tp)
        if any(d not in ("ep", "tp") for d, _ in axes):
            raise ConfigError(
                f"{name}: checkpoints save expert shards split over ep (and tp), not {sharding}"
            )
        device_mesh = mesh.expert_device_mesh(with_tp=len(axes) > 1)
    dims = (device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()
    missing = [d for d, _ in axes if d not in dims]
    if missing:
        raise ConfigError(
            f"{name}: sharded over {missing[0]!r}, which is not a DeviceMesh dim; "
            f"checkpoints can reshard over {', '.join(dims) or 'no dim'}"
        )
    by_dim = dict(axes)
    names = tuple(d for d in dims if d in by_dim)  # DeviceMesh order, whatever order the splits came in
    sub = device_mesh if names == dims else device_mesh[names if len(names) > 1 else names[0]]
    return _dtensor(local, sub, names, by_dim, sharding)


def _dtensor(local, sub, names, by_dim, sharding):
    full = torch.Size(sharding.full_shape)
    return DTensor.from_local(
        local,
        sub,
        [DShard(by_dim[d].dim % len(full)) for d in names],
        run_check=False,
        shape=full,
        stride=_contiguous_stride(full),
    )


def _state(tensors: dict[str, torch.Tensor], specs: dict[str, Sharding], mesh) -> dict:
    # a mesh with mesh_for (train/modules_run.Placement): each tensor placed on its module's mesh
    at = getattr(mesh, "mesh_for", lambda k: mesh)
    return {k: _wrap(k, t.detach(), specs.get(k), at(k)) for k, t in tensors.items()}


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
    _dcp("load", dcp.load, state, storage_reader=SafeReader(path), no_dist=not _distributed())
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
    md = read_metadata(path)
    return {k: (v.size, v.properties.dtype) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
