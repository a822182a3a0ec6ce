"""The 90 transposable 2:4 blocks and the block-optimal mask in plain torch (the reference the
fused kernel in kernels.py matches bit for bit; transposable.py is the public entry point).

Per 4x4 block the mask must have exactly two kept entries in every row and every column. There are
exactly 90 such 0/1 matrices, so the block-optimal mask (max kept score, |W| by default) is an
argmax over 90 sums per block. That is exact, not a heuristic, and the result is valid by
construction because every candidate is valid.

Each sum is one fixed float32 addition tree, (row0 pair + row1 pair) + (row2 pair + row3 pair),
and ties go to the first pattern in PATTERN_PAIRS order. A matmul would leave the summation order
to the BLAS, so two implementations could round a near-tie differently; with the tree written
down, the Triton kernel reproduces this mask bit for bit on CPU and on CUDA. A NaN score counts
as +inf (argmax ranks NaN highest: the same blocks win).
"""

from __future__ import annotations

import itertools
from functools import cache

import torch

# Blocks per chunk: 2^16 blocks * 90 patterns * 4 bytes = 24 MB per score temporary.
_CHUNK_BLOCKS = 1 << 16

# The 6 ways to keep 2 of 4 entries in a row, as (lo, hi) column pairs, in the order of
# itertools.product((0, 1), repeat=4) filtered to two-hot rows (0011, 0101, 0110, 1001, 1010, 1100).
ROW_PAIRS = ((2, 3), (1, 3), (1, 2), (0, 3), (0, 2), (0, 1))


@cache
def _pattern_pairs() -> tuple[tuple[int, int, int, int], ...]:
    """The 90 valid blocks as one ROW_PAIRS index per row, in enumeration (tie-break) order."""
    out = []
    for combo in itertools.product(range(6), repeat=4):
        counts = [0, 0, 0, 0]
        for p in combo:
            for c in ROW_PAIRS[p]:
                counts[c] += 1
        if counts == [2, 2, 2, 2]:
            out.append(combo)
    return tuple(out)


PATTERN_PAIRS = _pattern_pairs()  # 90 x (pair of row 0, row 1, row 2, row 3)


@cache
def _patterns_cpu() -> torch.Tensor:
    pats = torch.zeros(len(PATTERN_PAIRS), 4, 4)
    for k, combo in enumerate(PATTERN_PAIRS):
        for r, p in enumerate(combo):
            pats[k, r, list(ROW_PAIRS[p])] = 1.0
    return pats.reshape(-1, 16)  # [90, 16]


def transposable_patterns(device: torch.device | str = "cpu") -> torch.Tensor:
    """All 90 valid 4x4 transposable 2:4 patterns as a float [90, 16] tensor (row-major blocks)."""
    return _patterns_cpu().to(device)


def _to_blocks(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    # [rows/4, 4, cols/4, 4] -> [rows/4, cols/4, 4, 4] -> [blocks, 16]
    return x.reshape(rows // 4, 4, cols // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def _from_blocks(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return blocks.reshape(rows // 4, cols // 4, 4, 4).permute(0, 2, 1, 3).reshape(rows, cols)


def pattern_scores(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] float32 scores -> [blocks, 90] kept sums, each by the documented addition tree."""
    b = blocks.reshape(-1, 4, 4)
    lo = torch.tensor([p[0] for p in ROW_PAIRS], device=b.device)
    hi = torch.tensor([p[1] for p in ROW_PAIRS], device=b.device)
    pairs = b[:, :, lo] + b[:, :, hi]  # [blocks, 4 rows, 6 pairs]
    idx = torch.tensor(PATTERN_PAIRS, device=b.device)  # [90, 4]
    top = pairs[:, 0, idx[:, 0]] + pairs[:, 1, idx[:, 1]]  # rows 0 and 1
    return top + (pairs[:, 2, idx[:, 2]] + pairs[:, 3, idx[:, 3]])


def mask_reference(scores: torch.Tensor) -> torch.Tensor:
    """The block-optimal transposable mask of `scores` [..., rows, cols] (dims multiples of 4),
    leading dims folded into rows."""
    s = scores.detach().float()
    s = s.masked_fill(s.isnan(), float("inf"))
    rows, cols = s.numel() // s.shape[-1], s.shape[-1]
    blocks = _to_blocks(s.reshape(rows, cols))  # [blocks, 16]
    patterns = transposable_patterns(s.device)  # [90, 16]
    chosen = torch.empty(blocks.shape[0], dtype=torch.long, device=s.device)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        chosen[start : start + chunk.shape[0]] = pattern_scores(chunk).argmax(1)  # the first maximum
    return _from_blocks(patterns[chosen].bool(), rows, cols).reshape(scores.shape)
