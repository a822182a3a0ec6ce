"""The safetensors file format, written and read without the `safetensors` package.

Layout (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned header size
N, then N bytes of UTF-8 JSON `{name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]},
"__metadata__": {str: str}}`, then the data: every tensor's bytes, little-endian, C order, at
offsets relative to the end of the header. The header is padded with spaces so data starts
8-byte aligned (what the reference writer does; readers may rely on it for zero-copy loads).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys

import torch

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the reference reader's limit: a larger one is a corrupt file


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order. ctypes, not numpy: torch does not require numpy."""
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships on is little-endian
        raise RuntimeError("safetensors writing needs a little-endian host")
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      *, use_package: bool = True) -> None:
    """Write `tensors` to `path` (atomically: a temporary file renamed into place), with the
    `safetensors` package when it is installed and `use_package`, else with the writer below."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if use_package:
        try:
            from safetensors.torch import save_file
        except ImportError:
            pass
        else:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp,
                      metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
            os.replace(tmp, path)
            return
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code; valid: "
                             f"{', '.join(str(d) for d in DTYPES)}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(_raw_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_header(f, path: str) -> dict:
    head = f.read(8)
    if len(head) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER:
        raise ValueError(f"{path}: not a safetensors file (header size {n} bytes is implausible)")
    return json.loads(f.read(n))


def read_safetensors_header(path: str) -> dict:
    """{name: {"dtype", "shape", "data_offsets"}} of a safetensors file, without its data."""
    with open(path, "rb") as f:
        header = _read_header(f, path)
    header.pop("__metadata__", None)
    return header


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) from a safetensors file; tensors are CPU copies in file order."""
    with open(path, "rb") as f:
        header = _read_header(f, path)
        data = f.read()
    metadata = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        if info["dtype"] not in CODES:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}, which this reader does not know")
        dtype, shape = CODES[info["dtype"]], info["shape"]
        b, e = info["data_offsets"]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if e - b != size or e > len(data):
            raise ValueError(f"{path}: {name} data_offsets {[b, e]} do not fit shape {shape} {info['dtype']} "
                             f"in a {len(data)}-byte data section")
        if size == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(bytearray(data[b:e]), dtype=dtype).reshape(shape)
    return out, metadata
