"""safetensors files through the `safetensors` package, the format's reference implementation
(memory-mapped reads, every dtype, the exact header layout other tools expect).

These few functions are what meshspeed's callers use (export, checkpoints, the Hugging Face
import/export); meshspeed no longer carries its own reader and writer. The package is optional
for training itself, so it is imported where needed and its absence is one line saying how to
install it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct

import torch

from meshspeed.comm import outputs
from meshspeed.comm.errors import ConfigError

_MAX_HEADER = 100 * 1024 * 1024  # the reference reader's limit: a larger one is a corrupt file
# Bytes per element of every dtype the format defines (its own names).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


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
    """A `safe_open` handle (a context manager) on `path`: tensors and slices read on demand.
    The package's own errors (damaged files) become one SafetensorsError line naming the file."""
    safe_open = _package()[1]
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError, OSError, ...: all mean "cannot read it"
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise SafetensorsError(f"{path} cannot be read as safetensors ({why})") from None


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, **_ignored
) -> None:
    """Write `tensors` to `path` atomically: a temporary sibling (comm/outputs.py's naming,
    so an interrupted write's leftover is recognised and removed by the next one), fsynced, then
    renamed into place. A full disk is one line saying so; the old file stays.

    Extra keywords (the former `use_package=`) are accepted and ignored: the package always writes.
    """
    st, _ = _package()
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
    outputs.clean_orphans(path)
    tmp = outputs.sibling(path)
    try:
        st.save_file(out, tmp, metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
        with open(tmp, "rb") as f:  # durable before it is renamed into place
            os.fsync(f.fileno())
        outputs.commit_file(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, Exception) and (full := outputs.disk_error(e, path)) is not None:
            raise full from None
        raise


class SafetensorsError(ConfigError):
    """A safetensors file is damaged or not one; the message names the file and what is wrong."""


def read_safetensors_header(path: str, with_metadata: bool = False) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a safetensors file, without its data (the
    header is plain JSON after an 8-byte length). Every entry is checked against the format
    before anything trusts it: a known dtype, a shape of sizes ≥ 0, offsets that hold exactly
    that many bytes, inside the file, not overlapping; anything else is one SafetensorsError
    line naming the file. `with_metadata`: keep the "__metadata__" entry."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(
                    f"{path} is not a safetensors file (a {n:,}-byte header declared in a {size:,}-byte file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SafetensorsError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: its header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise SafetensorsError(f"{path}: its __metadata__ is not an object of strings")
    _check_entries(path, header, size - 8 - n)
    if with_metadata:
        header["__metadata__"] = meta or {}
    return header


def _check_entries(path: str, header: dict, data_bytes: int) -> None:
    spans = []
    for name, e in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or e.get("dtype") not in DTYPE_BYTES:
            got = e.get("dtype") if isinstance(e, dict) else e
            raise SafetensorsError(f"{where} has dtype {got!r}; known: {', '.join(DTYPE_BYTES)}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**40 for d in shape):
            raise SafetensorsError(f"{where} has shape {shape!r}; expected a list of sizes ≥ 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise SafetensorsError(f"{where} has data_offsets {offs!r}; expected [begin, end]")
        want = math.prod(shape) * DTYPE_BYTES[e["dtype"]]
        if not 0 <= offs[0] <= offs[1] <= data_bytes or offs[1] - offs[0] != want:
            raise SafetensorsError(
                f"{where} has data_offsets {offs} for {want:,} bytes of {e['dtype']} {shape}; the file "
                f"holds {data_bytes:,} bytes of data (truncated or damaged?)"
            )
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise SafetensorsError(f"{path}: tensors {a!r} and {b!r} overlap (a damaged file)")


def read_safetensors_metadata(path: str) -> dict[str, str]:
    """The "__metadata__" strings of a safetensors file ({} when it has none)."""
    return read_safetensors_header(path, with_metadata=True)["__metadata__"]


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) from a safetensors file, as CPU tensors (the header checked first)."""
    read_safetensors_header(path)
    with open_safetensors(path) as f:
        metadata = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, dict(metadata)
