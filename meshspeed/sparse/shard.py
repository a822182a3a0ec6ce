"""Masks under tensor parallelism: compute on the full logical weight, then slice (with
comm.placement, like the weight), so every rank's shard is exactly its piece of the one global
mask (ranks agree without any communication). This module checks a split keeps the pattern.

Sharding the input dim (dim -1 of [out, in]) must not cut an M-group: then every rank's shard is
itself N:M and the 2:4 kernels can run on it. Transposable 2:4 masks are also 2:4 along dim -2, so
sharding the output dim must not cut a 4-row group either.
"""

from __future__ import annotations

import torch


def check_shardable(
    name: str,
    shape: tuple[int, ...] | torch.Size,
    dim: int,
    world_size: int,
    nm: tuple[int, int] | None,
    *,
    transposable: bool = False,
) -> None:
    """Raise ValueError if sharding `shape` along `dim` over `world_size` ranks breaks the pattern."""
    ndim = len(shape)
    d = dim % ndim
    size = shape[d]
    if world_size < 1 or size % world_size:
        raise ValueError(
            f"{name}: dim {dim} of size {size} does not split evenly over tp degree {world_size}"
        )
    if nm is None:
        return
    m = nm[1]
    per_rank = size // world_size
    if d == ndim - 1 and per_rank % m:
        raise ValueError(
            f"{name}: in_features {size} over tp degree {world_size} "
            f"gives {per_rank} columns per rank, not a "
            f"multiple of M={m}, so an {nm[0]}:{m} group would straddle two ranks; use a tp degree dividing "
            f"{size // m} (the number of groups per row) or exclude the layer from sparsity.layers"
        )
    if transposable and d == ndim - 2 and per_rank % m:
        raise ValueError(
            f"{name}: out_features {size} over tp degree {world_size} gives {per_rank} rows per rank, not a "
            f"multiple of {m}; a transposable {nm[0]}:{m} block would straddle two ranks"
        )
