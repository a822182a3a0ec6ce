"""Expert parallelism decided before any worker starts: the run plan's checks, the [moe] settings
applied to the model config, and the swap of every MoE layer for the expert-parallel one (applied
to the meta model by the run plan to count per-rank bytes, and by the trainer to build it).

The layer and its communication are meshspeed.parallel.expert / expert_tp; what the trainer does
with experts each step (routing bias, load) is meshspeed.train.experts.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from meshspeed.comm import ConfigError, ParallelDims
from meshspeed.models import ModelConfig
from meshspeed.parallel.expert import expert_parallel
from meshspeed.parallel.expert_replicate import setting_problem
from meshspeed.parallel.expert_tp import expert_tensor_parallel

__all__ = [
    "apply_expert_parallel",
    "check_experts",
    "expert_tp_mode",
    "moe_modules",
    "with_moe_settings",
]


def with_moe_settings(cfg, config: ModelConfig) -> ModelConfig:
    """The model config with [moe]'s balancing and loss coefficients (a negative coefficient keeps
    the preset's, except that balance=bias or none turns the auxiliary loss off by default)."""
    m = cfg.moe
    if not config.n_experts:
        return config
    changes = {}
    if m.balance != "aux":
        changes["aux_loss_coef"] = 0.0
    if m.balance == "bias":
        changes["router_bias_rate"] = m.bias_update_rate
    changes.update({k: v for k in ("aux_loss_coef", "z_loss_coef") if (v := getattr(m, k)) >= 0})
    return dataclasses.replace(config, **changes) if changes else config


def expert_tp_mode(cfg) -> str:
    """How tp ranks hold experts (parallel/expert_tp.py): split (etp = tp), tokens (etp = 1) or
    fold (moe.tp_extend_ep); 'split' when tp = 1. The mesh's rule (ParallelDims.expert_tp)."""
    p = cfg.parallel
    return ParallelDims(tp=p.tp, etp=p.etp, tp_extend_ep=cfg.moe.tp_extend_ep).expert_tp


def expert_ranks(cfg) -> int:
    """Ranks the routed experts are split over: ep, or ep × tp with moe.tp_extend_ep."""
    return cfg.parallel.ep * (cfg.parallel.tp if expert_tp_mode(cfg) == "fold" else 1)


def uses_expert_layer(cfg) -> bool:
    """Whether MoE layers are replaced by the expert-parallel layer (ep > 1, capacity routing, or
    tp ranks holding whole experts); tp > 1 with ep = 1 and etp = tp stays TensorParallelMoE."""
    return cfg.parallel.ep > 1 or cfg.moe.capacity_factor > 0 or expert_tp_mode(cfg) != "split"


def check_experts(cfg, config: ModelConfig) -> None:
    """One line for each expert setting that cannot work with this model and layout."""
    p, m = cfg.parallel, cfg.moe
    if m.balance == "bias" and not m.bias_update_rate > 0:
        raise ConfigError(f"moe.bias_update_rate={m.bias_update_rate:g} must be > 0 with moe.balance=bias")
    if m.capacity_factor < 0:
        raise ConfigError(f"moe.capacity_factor={m.capacity_factor:g} must be > 0, or 0 for dropless")
    ranks = expert_ranks(cfg) if uses_expert_layer(cfg) else 1
    if problem := setting_problem(m.replicate_hot, ranks, m.capacity_factor, m.dispatcher, p.tp):
        raise ConfigError(problem)
    if not uses_expert_layer(cfg):
        return
    mode = expert_tp_mode(cfg)
    what = (
        f"parallel.ep={p.ep}"
        if p.ep > 1
        else f"moe.capacity_factor={m.capacity_factor:g}"
        if m.capacity_factor > 0
        else "moe.tp_extend_ep=true"
        if mode == "fold"
        else "parallel.etp=1"
    )
    if not config.n_experts:
        raise ConfigError(f"{what} needs a mixture-of-experts model; this one is dense (use e.g. tiny-moe)")
    ranks = expert_ranks(cfg)
    if config.n_experts % ranks:
        good = [d for d in range(1, config.n_experts + 1) if config.n_experts % d == 0]
        who = (
            f"parallel.ep={p.ep} × parallel.tp={p.tp} (moe.tp_extend_ep)"
            if mode == "fold"
            else f"parallel.ep={p.ep}"
        )
        raise ConfigError(
            f"{who} does not divide the model's {config.n_experts} experts; "
            f"use {'ep × tp ' if mode == 'fold' else ''}one of {', '.join(map(str, good))}"
        )
    if m.capacity_factor > 0 and mode != "split":
        raise ConfigError(
            f"moe.capacity_factor={m.capacity_factor:g} with parallel.tp={p.tp} needs each expert split "
            "over tp (parallel.etp=tp, moe.tp_extend_ep=false): capacity counts a rank's own slots"
        )
    if m.capacity_factor > 0 and m.dispatcher != "alltoall":
        raise ConfigError(
            f"moe.capacity_factor={m.capacity_factor:g} needs moe.dispatcher=alltoall (the allgather "
            "dispatcher is dropless only)"
        )


def apply_expert_parallel(model: nn.Module, mesh, cfg) -> None:
    """Replace the MoE layers of `model` (a whole model or a pipeline stage) by the expert-parallel
    layer over mesh["ep"]: this rank keeps its block of experts and exchanges tokens with the
    other ep members. Before the data-parallel buckets are built: the expert weights are sliced."""
    if uses_expert_layer(cfg):
        m, p = cfg.moe, cfg.parallel
        if p.tp > 1:  # the tp ranks split each expert, or the tokens, or join ep (expert_tp.py)
            mode, sp = expert_tp_mode(cfg), p.sequence_parallel
            expert_tensor_parallel(
                model, mesh["ep"], mesh["tp"], mode, sp, m.dispatcher, m.capacity_factor or None
            )
        else:
            expert_parallel(model, mesh["ep"], m.dispatcher, m.capacity_factor or None)
        for layer in moe_modules(model):
            layer.overlap_shared = m.overlap_shared
            layer.replicate_hot = m.replicate_hot


def moe_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "tokens_per_expert")]
