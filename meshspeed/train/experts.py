"""Experts in the training step: the routing bias moved after each optimizer step and the
per-step expert load. What is decided before the run (checks, the expert-parallel swap) is
meshspeed.plan.experts; the gradient reduction of expert weights over the expert-data-parallel
group is DataParallel's (expert buckets, parallel/data.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.plan.experts import moe_modules

__all__ = ["expert_load", "update_routing_bias"]


def update_routing_bias(model: nn.Module, group: comm.Group, apply: bool = True) -> None:
    """After the optimizer step: each MoE layer's tokens per expert over the step (all of its
    training forwards), summed over `group` (dp × cp: the whole batch), move the routing bias of
    the layers that balance by bias (`apply`: False for a skipped step). Resets the counts."""
    mods = [m for m in moe_modules(model) if getattr(m, "step_counts", None) is not None]
    counts = [m.step_counts for m in mods]
    for m in mods:
        m.step_counts = None
    biased = [(m, c) for m, c in zip(mods, counts) if getattr(m.router, "bias", None) is not None]
    if not apply or not biased:
        return
    stacked = torch.stack([c.to(torch.float64) for _, c in biased])  # [layers, E]: one collective
    if group.size > 1:
        stacked = comm.all_reduce(stacked, group, "sum")
    for (m, _), c in zip(biased, stacked):
        m.router.update_bias(c)


def expert_load(model: nn.Module, group: comm.Group) -> float | None:
    """max/mean tokens per expert of the last micro-batch, over the whole data-parallel batch
    (counts summed over `group`), for the worst MoE layer on this rank's stage; None when the
    model has no MoE layer here. 1.0 is perfect balance; top_k experts per token count once each."""
    counts = [m.tokens_per_expert for m in moe_modules(model) if m.tokens_per_expert is not None]
    if not counts:
        return None
    stacked = torch.stack([c.to(torch.float64) for c in counts])  # [layers, E]
    if group.size > 1:
        stacked = comm.all_reduce(stacked, group, "sum")
    mean = stacked.mean(dim=1).clamp(min=1.0)
    return float((stacked.max(dim=1).values / mean).max())
