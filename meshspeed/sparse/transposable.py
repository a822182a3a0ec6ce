"""Transposable 2:4 masks: W and W^T both 2:4, so the input-gradient matmul (grad_y @ W) can use
the same sparse tensor cores as the forward (x @ W^T).

Per 4x4 block the mask must have exactly two kept entries in every row and every column. There are
exactly 90 such 0/1 matrices, so the block-optimal mask (max kept |W|) is an argmax over 90 dot
products per block: one [blocks, 16] @ [16, 90] matmul. That is exact, not a heuristic, and the
result is valid by construction because every candidate is valid.
"""

from __future__ import annotations

import itertools
from functools import cache

import torch

from meshspeed.sparse.masks import is_nm

# Blocks per matmul chunk: 2^18 blocks * 90 patterns * 4 bytes ~ 94 MB of scores at most.
_CHUNK_BLOCKS = 1 << 18


@cache
def _patterns_cpu() -> torch.Tensor:
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]  # 6 two-hot rows
    valid = []
    for combo in itertools.product(rows, repeat=4):
        block = torch.tensor(combo)
        if bool((block.sum(0) == 2).all()):
            valid.append(block.flatten())
    return torch.stack(valid).float()  # [90, 16]


def transposable_patterns(device: torch.device | str = "cpu") -> torch.Tensor:
    """All 90 valid 4x4 transposable 2:4 patterns as a float [90, 16] tensor (row-major blocks)."""
    return _patterns_cpu().to(device)


def _to_blocks(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    # [rows/4, 4, cols/4, 4] -> [rows/4, cols/4, 4, 4] -> [blocks, 16]
    return x.reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def _from_blocks(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return blocks.reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def transposable_2to4_mask(
    weight: torch.Tensor, *, name: str = "", scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Block-optimal mask that is 2:4 along the last dim AND along the second-to-last dim.

    Leading dims (stacked experts [E, out, in]) are folded into rows; since out % 4 == 0 no 4x4
    block crosses an expert boundary, so each expert gets its own valid mask.
    """
    if weight.dim() < 2 or weight.shape[-1] % 4 or weight.shape[-2] % 4:
        raise ValueError(
            f"{name or 'weight'} of shape {tuple(weight.shape)}: "
            "a transposable 2:4 mask needs both of the last "
            "two dims to be multiples of 4; set sparsity.transposable=false or exclude this layer"
        )
    s = (weight.detach().abs() if scores is None else scores.detach()).float()
    rows, cols = s.numel() // s.shape[-1], s.shape[-1]
    blocks = _to_blocks(s.reshape(rows, cols))  # [blocks, 16]
    patterns = transposable_patterns(s.device)  # [90, 16]
    chosen = torch.empty(blocks.shape[0], dtype=torch.long, device=s.device)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        chosen[start : start + chunk.shape[0]] = (chunk @ patterns.t()).argmax(1)
    mask_blocks = patterns[chosen].bool()
    return _from_blocks(mask_blocks, rows, cols).reshape(weight.shape)


def is_transposable_nm(mask: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """True when the mask is N:M along the last dim and along the second-to-last dim."""
    if mask.dim() < 2:
        return False
    return is_nm(mask, n, m) and is_nm(mask.transpose(-1, -2), n, m)
