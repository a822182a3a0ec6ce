"""safetensors files through the `safetensors` package, the format's reference implementation
(memory-mapped reads, every dtype, the exact header layout other tools expect).

These few functions are what meshspeed's callers use (export, checkpoints, the Hugging Face
import/export); meshspeed no longer carries its own reader and writer. The package is optional
for training itself, so it is imported where needed and its absence is one line saying how to
install it.
"""

from __future__ import annotations

import json
import os
import struct

import torch

_MAX_HEADER = 100 * 1024 * 1024  # the reference reader's limit: a larger one is a corrupt file


def _package():
    try:
        import safetensors.torch
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "reading or writing safetensors needs the `safetensors` package: "
            "pip install safetensors (or pip install -e '.[dev]')"
        ) from None
    return safetensors.torch, safe_open


def open_safetensors(path: str):
    """A `safe_open` handle (a context manager) on `path`: tensors and slices read on demand."""
    return _package()[1](path, framework="pt")


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, **_ignored
) -> None:
    """Write `tensors` to `path` atomically (a temporary file renamed into place, fsynced).

    Extra keywords (the former `use_package=`) are accepted and ignored: the package always writes.
    """
    st, _ = _package()
    tmp = f"{path}.tmp-{os.getpid()}"
    out, seen = {}, set()
    for k, v in tensors.items():
        v = v.detach().to("cpu").contiguous()
        storage = v.untyped_storage()
        # The package refuses tensors sharing a storage (tied weights, experts unbound from one
        # stacked tensor): copy views and repeats.
        if storage.data_ptr() in seen or storage.nbytes() != v.numel() * v.element_size():
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    st.save_file(out, tmp, metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
    with open(tmp, "rb") as f:  # durable before it is renamed into place
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors_header(path: str) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a safetensors file, without its data (the
    header is plain JSON after an 8-byte length: reading it needs no tensor library)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header size {n} bytes is implausible)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) from a safetensors file, as CPU tensors."""
    with open_safetensors(path) as f:
        metadata = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, dict(metadata)
