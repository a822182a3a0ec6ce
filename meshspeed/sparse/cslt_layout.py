"""The compressed 2:4 layout cuSPARSELt reads on Hopper, written in plain torch: the reference the
fused Triton kernel (kernels.py) is tested against on CPU, and the inverse (decompress) the CPU
stand-in for torch._cslt_sparse_mm multiplies with.

One 1-D tensor of the weight's dtype, 9/16 of the dense element count, for a dense [R, C] 2:4
matrix (2 kept of every 4 along a row):

  values    R * C / 2 elements, row-major [R, C/2]: each group's two kept values, left one first
  metadata  R * C / 8 bytes: per group a nibble lo | hi << 2 (the kept positions 0..3, lo < hi);
            the nibbles of rows r and r + 8 (r % 16 < 8) share a byte (row r in the low half) at

              (r // 64) * 8C  +  (g // 8) * 256  +  ((r % 64) // 16) * 64  +  (r % 8) * 8
                              +  2 * (g % 4) + (g % 8) // 4            for 4-column group g

That is 64-row bands of C/32 strips of 256 bytes; each strip four 16-row slabs of 64 bytes; each
slab 8 row pairs of 8 bytes, the groups of a 32-column strip interleaved 0 4 1 5 2 6 3 7. The
layout is cuSPARSELt's own (not a documented format): it was read off the sm90 "cusparselt"
sparsify kernel of torchao (csrc/cuda/activation24/sparsify24.cu, store_metadata_reordered),
and the CUDA tests compare it byte for byte with torch._cslt_compress. Ampere uses another
order, so there the kernel self-check fails and compression goes through _cslt_compress.
Both dims must be multiples of 64 (whole bands and strips, for W and for W^T).
"""

from __future__ import annotations

import torch

BAND = 64  # rows and columns must be multiples of this (W and W^T both compressed)


def misfit(rows: int, cols: int) -> str:
    """Why [rows, cols] cannot take this layout ('' when it can)."""
    if rows % BAND or cols % BAND:
        return f"shape {rows}x{cols}: the fused compression needs both dims multiples of {BAND}"
    return ""


def compressed_numel(rows: int, cols: int) -> int:
    return rows * cols * 9 // 16


def meta_index(rows: int, cols: int, device=None) -> torch.Tensor:
    """[rows/2, cols/4] byte offsets: entry (i, g) holds the nibbles of groups g of row r and
    r + 8, where r is the i-th row with r % 16 < 8."""
    r = torch.arange(rows, device=device).reshape(rows // 16, 2, 8)[:, 0, :].reshape(-1, 1)
    g = torch.arange(cols // 4, device=device).reshape(1, -1)
    return (
        (r // 64) * 8 * cols
        + (g // 8) * 256
        + ((r % 64) // 16) * 64
        + (r % 8) * 8
        + 2 * (g % 4)
        + (g % 8) // 4
    )


def _positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept positions (lo, hi) per 4-group of a 2:4 mask [R, C] -> two [R, C/4] int64 tensors."""
    rows, cols = mask.shape
    m4 = mask.reshape(rows, cols // 4, 4)
    if not bool((m4.sum(-1) == 2).all()):
        raise ValueError("compression needs exactly 2 kept of every 4 along a row (a 2:4 mask)")
    ar = torch.arange(4, device=mask.device)
    lo = torch.where(m4, ar, 4).amin(-1)
    hi = torch.where(m4, ar, -1).amax(-1)
    return lo, hi


def compress_reference(dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Compress dense [R, C] under the 2:4 mask (values at pruned positions are ignored)."""
    rows, cols = dense.shape
    why = misfit(rows, cols)
    if why:
        raise ValueError(why)
    mask = mask.bool()
    lo, hi = _positions(mask)
    values = dense[mask].reshape(rows, cols // 2)  # row-major: left kept value first
    nib = (lo | (hi << 2)).to(torch.uint8).reshape(rows // 16, 2, 8, cols // 4)
    byte = nib[:, 0] | (nib[:, 1] << 4)  # [R/16, 8, C/4]: row r low nibble, row r + 8 high
    meta = torch.empty(rows * cols // 8, dtype=torch.uint8, device=dense.device)
    meta[meta_index(rows, cols, dense.device).reshape(-1)] = byte.reshape(-1)
    out = torch.empty(compressed_numel(rows, cols), dtype=dense.dtype, device=dense.device)
    out[: rows * cols // 2] = values.reshape(-1)
    out[rows * cols // 2 :].view(torch.uint8).copy_(meta)
    return out


def split(packed: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, C/2], metadata bytes [R*C/8]) views of a compressed tensor."""
    if packed.dim() != 1 or packed.numel() != compressed_numel(rows, cols):
        raise ValueError(
            f"compressed tensor of {packed.numel()} elements does not hold a {rows}x{cols} 2:4 "
            f"matrix ({compressed_numel(rows, cols)} expected)"
        )
    half = rows * cols // 2
    return packed[:half].view(rows, cols // 2), packed[half:].view(torch.uint8)


def decompress_reference(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The dense [R, C] matrix a compressed tensor stands for (zeros at pruned positions)."""
    values, meta = split(packed, rows, cols)
    byte = meta[meta_index(rows, cols, packed.device).reshape(-1)].reshape(rows // 16, 1, 8, cols // 4)
    nib = torch.cat([byte & 0xF, byte >> 4], dim=1).reshape(rows, cols // 4).long()  # rows back in order
    lo, hi = nib & 3, nib >> 2
    out = torch.zeros(rows, cols // 4, 4, dtype=packed.dtype, device=packed.device)
    v = values.reshape(rows, cols // 4, 2)
    out.scatter_(2, lo.unsqueeze(-1), v[..., :1])
    out.scatter_(2, hi.unsqueeze(-1), v[..., 1:])
    return out.reshape(rows, cols)
