"""The config's transformations of a built (born-sharded) model or pipeline stage, in the order
they compose. Each one swaps modules or attention cores from outside; the model code stays
single-device."""

from __future__ import annotations

from torch import nn

from meshspeed.comm import ConfigError
from meshspeed.kernels.fused import triton_usable
from meshspeed.memory import apply_recompute, apply_swap_activations
from meshspeed.models.layers import set_fused_kernels
from meshspeed.parallel.context import apply_context_parallel
from meshspeed.parallel.tensor import set_tp_overlap


def apply_model_features(model: nn.Module, cfg, mesh, recipe, device, cp=None) -> None:
    """After expert parallelism (applied on meta, while building: the expert weights are born
    sharded) and before the data-parallel buckets are built. cp: the context-parallel core
    (parallel/context.py) when parallel.cp > 1."""
    p, t, m = cfg.parallel, cfg.train, cfg.memory
    if p.tp_overlap:  # plan/config checked sequence_parallel; 0 chunks = the cost model's K per layer
        set_tp_overlap(model, True, p.tp_overlap_chunks or None)
    if t.fused_kernels:
        usable, why = triton_usable(device)
        if not usable:
            raise ConfigError(f"train.fused_kernels=true on {device}: {why}; set it to false")
        set_fused_kernels(model, True)
    if cp is not None:
        apply_context_parallel(model, cp)
    # after the cp core is in: selective recompute wraps whichever attention core runs
    apply_recompute(model, m.recompute, m.recompute_layers or None, recipe.pipeline.layers)
    if m.swap_activations:  # the attention cores' saved tensors to host memory (memory/swap.py)
        apply_swap_activations(model, device, m.swap_layers or None, recipe.pipeline.layers)
