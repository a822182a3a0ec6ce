"""Transposable 2:4 masks: W and W^T both 2:4, so the input-gradient matmul (grad_y @ W) can use
the same sparse tensor cores as the forward (x @ W^T).

The block-optimal mask over the 90 valid 4x4 blocks is defined in patterns.py (one written-down
float32 addition tree per candidate, the first maximum wins); on CUDA the fused Triton kernel
(kernels.py) computes the same mask bit for bit in one pass.
"""

from __future__ import annotations

import warnings

import torch

from meshspeed.sparse import cslt_layout, kernels
from meshspeed.sparse.masks import is_nm
from meshspeed.sparse.patterns import PATTERN_PAIRS, ROW_PAIRS, mask_reference, transposable_patterns

__all__ = [
    "PATTERN_PAIRS",
    "ROW_PAIRS",
    "is_transposable_nm",
    "transposable_2to4_mask",
    "transposable_patterns",
]


def transposable_2to4_mask(
    weight: torch.Tensor, *, name: str = "", scores: torch.Tensor | None = None, fused: bool = True
) -> torch.Tensor:
    """Block-optimal mask that is 2:4 along the last dim AND along the second-to-last dim.

    Leading dims (stacked experts [E, out, in]) are folded into rows; since out % 4 == 0 no 4x4
    block crosses an expert boundary, so each expert gets its own valid mask. A 2-D CUDA weight
    whose dims are multiples of 64 goes through the fused Triton kernel (the same mask, one pass
    instead of a [blocks, 90] score matrix) unless fused=False or scores are given.
    """
    if weight.dim() < 2 or weight.shape[-1] % 4 or weight.shape[-2] % 4:
        raise ValueError(
            f"{name or 'weight'} of shape {tuple(weight.shape)}: "
            "a transposable 2:4 mask needs both of the last "
            "two dims to be multiples of 4; set sparsity.transposable=false or exclude this layer"
        )
    if fused and scores is None and weight.is_cuda and weight.dim() == 2 and kernels.available():
        if not cslt_layout.misfit(*weight.shape):
            try:  # a kernel that cannot build must not stop training: say so, use torch
                out = kernels.mask_and_compress(weight, dtype=torch.bfloat16, want_w=False, want_t=False)
                return out.mask
            except Exception as err:
                warnings.warn(f"fused transposable 2:4 mask unavailable ({type(err).__name__}: {err})")
    return mask_reference(weight.detach().abs() if scores is None else scores)


def is_transposable_nm(mask: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when the mask is N:M along the last dim and along the second-to-last dim."""
    if mask.dim() < 2:
        return False
    return is_nm(mask, n, m) and is_nm(mask.transpose(-1, -2), n, m)
