"""Drop-and-grow mask updates (RigL, SET) and the optimizer-state reset for regrown weights.

RigL (Evci et al. 2020): drop the smallest-|W| active weights, grow the inactive weights with the
largest |grad| (the dense gradient, which the STE provides). SET (Mocanu et al. 2018): same drop,
random growth. Regrown weights start at zero with zero optimizer state, so they enter the forward
without a jump and Adam does not apply stale moments from while they were masked.
"""

from __future__ import annotations

import torch


def drop_grow(
    mask: torch.Tensor,
    drop_scores: torch.Tensor,
    grow_scores: torch.Tensor,
    keep: int,
    n_swap: int,
) -> torch.Tensor:
    """New 1-D mask with exactly `keep` entries.

    Keeps the top (keep - n_swap) active entries by drop_scores (fewer if fewer are active), then
    fills up to `keep` with the highest grow_scores among the rest. Entries dropped in this update
    may be regrown (the RigL reference does the same); then they are not "new" and keep their value.
    """
    numel = mask.numel()
    if not 0 <= keep <= numel:
        raise ValueError(f"keep={keep} outside [0, {numel}]")
    active = int(mask.sum())
    k1 = max(min(active, keep - n_swap), 0)
    neg_inf = torch.finfo(torch.float32).min
    survivors = torch.zeros_like(mask)
    if k1:
        scores = drop_scores.float().masked_fill(~mask, neg_inf)
        survivors[scores.topk(k1, sorted=False).indices] = True
    k2 = keep - k1
    new = survivors.clone()
    if k2:
        scores = grow_scores.float().masked_fill(survivors, neg_inf)
        new[scores.topk(k2, sorted=False).indices] = True
    return new


def drop_grow_grouped(
    mask: torch.Tensor,
    weight: torch.Tensor,
    grow_scores: torch.Tensor,
    sparsity: float,
    drop_fraction: float,
    groups: int,
) -> torch.Tensor:
    """drop_grow on each of `groups` equal slices (stacked experts keep separate budgets)."""
    from meshspeed.sparse.masks import keep_count

    m2 = mask.reshape(groups, -1)
    w2 = weight.detach().abs().reshape(groups, -1)
    g2 = grow_scores.reshape(groups, -1)
    keep = keep_count(m2.shape[1], sparsity)
    # RigL drops a fraction of the weights that stay active at this density
    n_swap = int(drop_fraction * keep)
    out = torch.stack([drop_grow(m2[i], w2[i], g2[i], keep, n_swap) for i in range(groups)])
    return out.reshape(mask.shape)


def reset_regrown(
    weight: torch.nn.Parameter, regrown: torch.Tensor, optimizer: torch.optim.Optimizer | None
) -> int:
    """Zero regrown weights and every per-element optimizer state entry at those positions.

    Per-element state is any state tensor shaped like the parameter (Adam exp_avg, exp_avg_sq,
    max_exp_avg_sq; SGD momentum_buffer; ...). Returns the number of regrown weights.
    """
    count = int(regrown.sum())
    if not count:
        return 0
    with torch.no_grad():
        weight.masked_fill_(regrown, 0)
        if optimizer is not None:
            for value in optimizer.state.get(weight, {}).values():
                if torch.is_tensor(value) and value.shape == weight.shape:
                    value.masked_fill_(regrown, 0)
    return count
