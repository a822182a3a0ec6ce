"""Dynamic sparse training: N:M / transposable 2:4 / unstructured masks, STE + SR-STE linear layers
with 2:4 sparse tensor-core kernels on CUDA, global schedules with per-layer adapters, RigL/SET.

    cfg = SparsityConfig(pattern="2:4", method="sr-ste", schedule="cubic", ramp_steps=2000)
    sparsify(model, cfg)                      # nn.Linear -> SparseLinear (same Parameters)
    ctl = MaskController(model, opt, cfg)
    for step in ...: loss.backward(); opt.step(); ctl.step(step); opt.zero_grad()
    print(report(model))                      # per-layer sparsity and matmul path (and why)
"""

from meshspeed.sparse.budget import adapter_ratios, erk_sparsities, layer_score, solve_budget
from meshspeed.sparse.config import SparsityConfig, parse_pattern
from meshspeed.sparse.controller import LayerUpdate, MaskController, UpdateRecord
from meshspeed.sparse.convert import (
    mask_for,
    report,
    report_rows,
    sparsify,
    sparsify_params,
    targets,
    unsparsify,
)
from meshspeed.sparse.cuda import PathDecision, decide_path
from meshspeed.sparse.linear import SparseLinear, SparseLinearFunction
from meshspeed.sparse.masks import (
    density,
    flip_count,
    flip_rate,
    is_nm,
    keep_count,
    nm_mask,
    sparsity,
    topk_mask,
)
from meshspeed.sparse.params import MaskedWeightSTE, SparseParam
from meshspeed.sparse.rigl import drop_grow, reset_regrown
from meshspeed.sparse.schedule import SparsitySchedule, cosine_anneal
from meshspeed.sparse.shard import check_shardable
from meshspeed.sparse.transposable import is_transposable_nm, transposable_2to4_mask, transposable_patterns

__all__ = [
    "LayerUpdate",
    "MaskController",
    "MaskedWeightSTE",
    "PathDecision",
    "SparseLinear",
    "SparseLinearFunction",
    "SparseParam",
    "SparsityConfig",
    "SparsitySchedule",
    "UpdateRecord",
    "adapter_ratios",
    "check_shardable",
    "cosine_anneal",
    "decide_path",
    "density",
    "drop_grow",
    "erk_sparsities",
    "flip_count",
    "flip_rate",
    "is_nm",
    "is_transposable_nm",
    "keep_count",
    "layer_score",
    "mask_for",
    "nm_mask",
    "parse_pattern",
    "report",
    "report_rows",
    "reset_regrown",
    "solve_budget",
    "sparsify",
    "sparsify_params",
    "sparsity",
    "targets",
    "topk_mask",
    "transposable_2to4_mask",
    "transposable_patterns",
    "unsparsify",
]
