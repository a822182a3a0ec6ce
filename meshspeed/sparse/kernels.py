"""Transposable 2:4 mask and the compression of W and W^T in one pass over the weight (Triton).

    out = mask_and_compress(weight, dtype=torch.bfloat16)         # mask from |W| (update steps)
    out = mask_and_compress(weight, mask, dtype=torch.bfloat16)   # the mask given (every other step)
    out.w, out.wt, out.mask  # compressed W [R, C] and W^T [C, R] (cslt_layout), bool mask [R, C]

The kernel (sparse24_triton.py, imported on first use) reads each [64, 128] tile of W once and
writes the mask and both compressed operands; its mask equals patterns.mask_reference bit for
bit and its compression cslt_layout.compress_reference. It runs compiled on CUDA and through
Triton's interpreter on CPU tensors (how the tests check it; also with TRITON_INTERPRET=1).
mask_and_compress_reference is the same computation in plain torch, the oracle of the tests and
the fallback where Triton is missing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

from meshspeed.sparse import cslt_layout
from meshspeed.sparse.patterns import PATTERN_PAIRS, ROW_PAIRS, mask_reference

HALF = (torch.float16, torch.bfloat16)


class Sparse24(NamedTuple):
    w: torch.Tensor | None  # compressed W, 1-D (cslt_layout), or None when not asked for
    wt: torch.Tensor | None  # compressed W^T
    mask: torch.Tensor  # bool [R, C]


_compiled: dict[bool, object] = {}
_bits: dict[torch.device, torch.Tensor] = {}


def _pattern_bits(device: torch.device) -> torch.Tensor:
    """[90] int32: pattern q's kept entries as bits 4 * row + col (the kernel decodes its choice)."""
    if device not in _bits:
        bits = [sum(1 << (4 * r + c) for r, p in enumerate(q) for c in ROW_PAIRS[p]) for q in PATTERN_PAIRS]
        _bits[device] = torch.tensor(bits, dtype=torch.int32, device=device)
    return _bits[device]


def _kernel(interpret: bool):
    """The kernel compiled for CUDA, or run by Triton's interpreter (CPU tensors)."""
    if interpret not in _compiled:
        import triton

        from meshspeed.sparse.sparse24_triton import sparse24_kernel

        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _compiled[interpret] = InterpretedFunction(sparse24_kernel)
        else:
            _compiled[interpret] = triton.jit(sparse24_kernel)
    return _compiled[interpret]


def available() -> bool:
    """Whether Triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _check(weight: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> None:
    if weight.dim() != 2:
        raise ValueError(f"2:4 compression needs a 2-D weight, got shape {tuple(weight.shape)}")
    why = cslt_layout.misfit(*weight.shape)
    if why:
        raise ValueError(why)
    if dtype not in HALF:
        raise ValueError(f"2:4 compression writes bf16/fp16, not {dtype}")
    if mask is not None and mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != weight shape {tuple(weight.shape)}")


def mask_and_compress(
    weight: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    want_w: bool = True,
    want_t: bool = True,
    tile: tuple[int, int] = (4, 128),
) -> Sparse24:
    """Mask (transposable 2:4 from |W|, unless `mask` is given) and compressed W / W^T of the
    [R, C] weight cast to `dtype`, in one kernel launch. A given mask must be 2:4 along rows
    (and along columns when want_t). `tile` = (16-row slabs, columns) per program."""
    dtype = dtype or weight.dtype
    _check(weight, mask, dtype)
    if not available():
        return mask_and_compress_reference(weight, mask, dtype=dtype, want_w=want_w, want_t=want_t)
    rows, cols = weight.shape
    tg, tc = tile
    tg = next(t for t in (tg, 2, 1) if (rows // 16) % t == 0)
    tc = tc if cols % tc == 0 else 64
    w = weight.detach()
    w = w if w.stride(1) == 1 else w.contiguous()
    compute = mask is None
    m8 = (
        torch.empty(rows, cols, dtype=torch.uint8, device=w.device)
        if compute
        else mask.detach().to(torch.bool).contiguous().view(torch.uint8)
    )
    n = cslt_layout.compressed_numel(rows, cols)
    out_w = torch.empty(n, dtype=dtype, device=w.device) if want_w else None
    out_t = torch.empty(n, dtype=dtype, device=w.device) if want_t else None
    half = rows * cols // 2
    # unused outputs point at a dummy: the constexpr flags compile their stores away
    dummy = torch.empty(16, dtype=dtype, device=w.device)
    vals, meta = (out_w[:half], out_w[half:]) if want_w else (dummy, dummy)
    valst, metat = (out_t[:half], out_t[half:]) if want_t else (dummy, dummy)
    meta, metat = meta.view(torch.uint8), metat.view(torch.uint8)
    interpret = w.device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
    grid = (rows // (16 * tg), cols // tc)
    options = {} if interpret else {"num_warps": 4, "enable_fp_fusion": False}
    _kernel(interpret)[grid](
        w, w.stride(0), m8, _pattern_bits(w.device), vals, meta, valst, metat, rows, cols,
        COMPUTE_MASK=compute, DO_W=want_w, DO_T=want_t, TG=tg, TC=tc, **options,
    )  # fmt: skip
    return Sparse24(out_w, out_t, m8.view(torch.bool) if compute else mask)


def mask_and_compress_reference(
    weight: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
    want_w: bool = True,
    want_t: bool = True,
) -> Sparse24:
    """mask_and_compress in plain torch: patterns.mask_reference + cslt_layout.compress_reference."""
    dtype = dtype or weight.dtype
    _check(weight, mask, dtype)
    w = weight.detach()
    mask = mask_reference(w.abs()) if mask is None else mask.bool()
    wd = w.to(dtype)
    out_w = cslt_layout.compress_reference(wd, mask) if want_w else None
    out_t = cslt_layout.compress_reference(wd.t().contiguous(), mask.t().contiguous()) if want_t else None
    return Sparse24(out_w, out_t, mask)
