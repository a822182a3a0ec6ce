"""Layer-wise sparsity budgets: ERK distribution, per-layer adapters, and the solver that keeps the
parameter-weighted mean of layer sparsities equal to the global target.

Solver: each layer i gets s_i = clamp(c * r_i, 0, max), where r_i >= 0 says how prunable the layer
is relative to the others (uniform: 1, ERK: its ERK sparsity, adapters: times a statistic ratio).
The weighted mean is monotone in c, so a bisection on c meets the budget exactly (up to float
precision) while every layer respects the clamp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


def erk_sparsities(
    shapes: Mapping[str, Sequence[int]], sparsity: float, *, dense_names: Sequence[str] = ()
) -> dict[str, float]:
    """Erdos-Renyi-Kernel per-layer sparsities for a global unstructured `sparsity` (RigL paper).

    Layer density is proportional to (sum of dims) / (product of dims) of its matrix, scaled by one
    epsilon so the total kept count matches the global density. Layers whose density would exceed 1
    are made dense and epsilon is re-solved over the rest (the RigL reference loop), so the budget
    still holds. For stacked expert weights [E, out, in] the last two dims define the shape term
    (each expert is its own matrix) while all E*out*in parameters count towards the budget.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"ERK needs a global sparsity in [0, 1), got {sparsity}")
    numels = {k: math.prod(v) for k, v in shapes.items()}
    raw = {k: sum(v[-2:]) / math.prod(v[-2:]) for k, v in shapes.items()}
    dense = set(dense_names)
    while True:
        # kept budget available to non-dense layers: global kept count minus the dense layers' size
        rhs = sum(numels[k] * (1 - sparsity) for k in shapes if k not in dense)
        rhs -= sum(numels[k] * sparsity for k in dense)
        divisor = sum(raw[k] * numels[k] for k in shapes if k not in dense)
        if divisor <= 0:
            break
        eps = rhs / divisor
        free = [k for k in shapes if k not in dense]
        worst = max(raw[k] for k in free)
        if worst * eps <= 1.0:
            break
        dense.update(k for k in free if raw[k] == worst)
        if len(dense) == len(shapes):
            break
    out = {}
    for k in shapes:
        out[k] = 0.0 if k in dense else max(0.0, 1.0 - eps * raw[k])
    return out


def solve_budget(
    numels: Mapping[str, int],
    ratios: Mapping[str, float],
    target: float,
    *,
    max_sparsity: float = 1.0,
    iters: int = 100,
) -> dict[str, float]:
    """Per-layer sparsities s_i = clamp(c * r_i, 0, max_sparsity) with sum(n_i s_i) = target * sum(n_i)."""
    names = list(numels)
    total = sum(numels[k] for k in names)
    if target <= 0 or total == 0:
        return {k: 0.0 for k in names}
    capacity = sum(numels[k] for k in names if ratios[k] > 0) * max_sparsity
    if capacity < target * total - 1e-9 * total:
        raise ValueError(
            f"sparsity budget {target:.4f} cannot be met: with max_layer_sparsity={max_sparsity} and "
            f"{sum(1 for k in names if ratios[k] <= 0)} layers held dense the most reachable is "
            f"{capacity / total:.4f}; "
            "raise sparsity.max_layer_sparsity or lower sparsity.target"
        )

    def mean(c: float) -> float:
        return sum(numels[k] * min(max(c * ratios[k], 0.0), max_sparsity) for k in names) / total

    lo, hi = 0.0, 1.0
    while mean(hi) < target and hi < 1e12:
        hi *= 2.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    return {k: min(max(hi * ratios[k], 0.0), max_sparsity) for k in names}


def layer_score(weight: torch.Tensor, kind: str) -> float | None:
    """Statistic of one layer for an adapter; None when it is unavailable (no gradient yet).

    Higher score = more important = gets less sparsity.
    """
    w = weight.detach()
    if kind == "magnitude":
        return float(w.abs().float().mean())
    grad = weight.grad
    if grad is None:
        return None
    if kind == "gradient":
        return float(grad.detach().abs().float().mean())
    if kind == "sensitivity":
        # first-order Taylor estimate of the loss change from removing each weight (SNIP-like)
        return float((w.float() * grad.detach().float()).abs().mean())
    raise ValueError(
        f"sparsity.adapter={kind!r} is not valid; expected none, magnitude, gradient or sensitivity"
    )


def adapter_ratios(scores: Mapping[str, float | None], numels: Mapping[str, int]) -> dict[str, float]:
    """Prunability ratio per layer: parameter-weighted mean score / own score (1.0 where unknown)."""
    known = {k: v for k, v in scores.items() if v is not None and v > 0}
    if not known:
        return {k: 1.0 for k in scores}
    total = sum(numels[k] for k in known)
    mean = sum(numels[k] * known[k] for k in known) / total
    return {k: (mean / known[k] if k in known else 1.0) for k in scores}
