"""Experts in the training step: the routing bias moved after each optimizer step, the
per-step expert load and what the hot-expert copies (moe.replicate_hot) balanced and moved.
What is decided before the run (checks, the expert-parallel swap) is meshspeed.plan.experts; the
gradient reduction of expert weights over the expert-data-parallel group is DataParallel's
(expert buckets, parallel/data.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.expert_replicate import METRICS, step_metrics
from meshspeed.plan.experts import moe_modules

__all__ = ["expert_load", "replication_metrics", "update_routing_bias"]


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


def replication_metrics(model: nn.Module, pp_group: comm.Group) -> dict:
    """moe.replicate_hot over the step (parallel/expert_replicate.py), for the metrics row:
    max/mean routed rows per expert rank before and after the copies (worst layer, all the
    step's micro-batches), expert weight bytes moved (the copies out and their gradients back)
    and rows computed on copies, over every pipeline stage (collective over `pp_group`: the
    ratios' max, the counts' sum). Resets the layers' tallies."""
    row = step_metrics(moe_modules(model))
    if pp_group.size > 1:  # each stage holds its own layers
        dev = next(model.parameters()).device
        worst = comm.all_reduce(torch.tensor(row[:2], dtype=torch.float64, device=dev), pp_group, "max")
        total = comm.all_reduce(torch.tensor(row[2:], dtype=torch.float64, device=dev), pp_group, "sum")
        row = worst.tolist() + total.tolist()
    out = dict(zip(METRICS, row))
    out["moe_copy_bytes"], out["moe_rows_kept"] = int(out["moe_copy_bytes"]), int(out["moe_rows_kept"])
    return out
