"""Mask construction and validity checks: N:M, unstructured top-k, density and flip rate.

Masks are bool tensors with the weight's shape. N:M groups run along the LAST dim, which is the
input dim of an nn.Linear weight [out, in] and of stacked expert weights [experts, out, in]: that
is the reduction dim of y = x @ W^T, the one the 2:4 sparse tensor cores compress.
Transposable 2:4 masks live in transposable.py.
"""

from __future__ import annotations

import torch


def _check_groups(shape: torch.Size, m: int, name: str) -> None:
    if len(shape) < 1 or shape[-1] % m:
        last = shape[-1] if len(shape) else None
        raise ValueError(
            f"{name or 'weight'} of shape {tuple(shape)}: last (input) dim {last} "
            f"is not a multiple of M={m}, "
            f"so it cannot be split into {m}-wide groups; exclude this layer (sparsity.layers) or pad it"
        )


def nm_mask(
    weight: torch.Tensor, n: int, m: int, *, name: str = "", scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep the n largest-|weight| (or largest `scores`) of every m consecutive entries of the last dim.

    Ties are broken by topk (deterministic for a given tensor). Returns a bool mask of weight's shape.
    """
    if not 0 < n < m:
        raise ValueError(f"N:M pattern {n}:{m} needs 0 < N < M")
    _check_groups(weight.shape, m, name)
    s = (weight.detach().abs() if scores is None else scores.detach()).float()
    groups = s.reshape(-1, m)  # [numel/m, m]
    keep = groups.topk(n, dim=1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(1, keep, True)
    return mask.reshape(weight.shape)


def is_nm(mask: torch.Tensor, n: int, m: int) -> bool:
    """True when every m-group along the last dim has exactly n kept entries."""
    if mask.dim() < 1 or mask.shape[-1] % m:
        return False
    return bool((mask.reshape(-1, m).sum(1) == n).all())


def topk_mask(
    weight: torch.Tensor, sparsity: float, *, scores: torch.Tensor | None = None, groups: int = 1
) -> torch.Tensor:
    """Unstructured mask keeping exactly keep_count(numel/groups, sparsity) largest-|weight| entries
    in each of `groups` equal slices along dim 0 (groups=E gives every stacked expert its own budget).
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity {sparsity} must be in [0, 1]")
    if weight.numel() % groups:
        raise ValueError(f"cannot split {weight.numel()} weights into {groups} equal mask groups")
    s = (weight.detach().abs() if scores is None else scores.detach()).float().reshape(groups, -1)
    keep = keep_count(s.shape[1], sparsity)
    mask = torch.zeros_like(s, dtype=torch.bool)
    if keep:
        mask.scatter_(1, s.topk(keep, dim=1, sorted=False).indices, True)
    return mask.reshape(weight.shape)


def keep_count(numel: int, sparsity: float) -> int:
    """Number of kept entries for a sparsity; one rounding rule used everywhere so counts agree."""
    return int(round((1.0 - sparsity) * numel))


def density(mask: torch.Tensor) -> float:
    """Fraction of kept entries."""
    return float(mask.sum()) / max(mask.numel(), 1)


def sparsity(mask: torch.Tensor) -> float:
    """Fraction of zeroed entries."""
    return 1.0 - density(mask)


def flip_count(old: torch.Tensor, new: torch.Tensor) -> int:
    """Number of mask entries that changed (kept<->dropped)."""
    if old.shape != new.shape:
        raise ValueError(f"flip rate needs equal shapes, got {tuple(old.shape)} and {tuple(new.shape)}")
    return int((old.bool() != new.bool()).sum())


def flip_rate(old: torch.Tensor, new: torch.Tensor) -> float:
    """Fraction of mask entries that changed between two masks."""
    return flip_count(old, new) / max(old.numel(), 1)
