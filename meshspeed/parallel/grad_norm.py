"""The global gradient norm and clipping over DataParallel's buckets (or plain parameters).

Gradient norm: the norm of the logical (single-device) model's gradient. Each rank sums the
squares it is responsible for and one all-reduce over the world adds them: tensor-parallel
shards (CONTRACTS.md §1) count on every tp rank, replicated parameters only on tp rank 0;
DataParallel's buckets count only this rank's 1/dp slice (disjoint; under zero=2 that is all it
holds); pipeline stages all count (their parameters differ); context-parallel replicas only once.
clip_grad_norm_ scales the gradients in place; with ZeroAdamW, grad_norm and
step(clip_coef=clip_coefficient(norm, max_norm)) apply the same factor inside the optimizer's
kernel, without a pass of its own.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm import placement
from meshspeed.parallel.buckets import segments
from meshspeed.parallel.data import DataParallel


def tp_sharded(p: torch.Tensor) -> bool:
    """True for a tensor-parallel piece (comm.placement). An "ep" split is the bucket's business
    (expert buckets are sharded over edp, so ranks hold disjoint pieces); other axes are unknown."""
    sharding = placement.sharding_of(p)
    if sharding is None:
        return False
    others = [d for d, _ in sharding.axes if d not in ("tp", "ep")]
    if others:
        raise comm.ConfigError(
            f"parameter split over {', '.join(others)} ({sharding}): gradient-norm "
            "accounting knows tensor- and expert-parallel splits only; extend "
            "meshspeed.parallel.grad_norm.tp_sharded"
        )
    return any(d == "tp" for d, _ in sharding.axes)


def norm_segments(dp: DataParallel) -> list[tuple[torch.Tensor, bool]]:
    """(reduced gradient piece, distinct over tp) covering this rank's dp slice of every bucket:
    a tp-split parameter's, or any expert bucket's when ep or edp spans tp."""
    if dp._norm_plan is None:
        dp._norm_plan = []
        for i, spec in enumerate(dp.specs):
            lo, hi = dp.dp_shard(i)
            spans = dp._experts_vary_over_tp and spec.kind == "expert"
            for tp in (False, True):
                keep = lambda s, tp=tp: (spans or tp_sharded(dp.params[s.name])) == tp  # noqa: E731
                dp._norm_plan += [(i, lo + a, lo + e, tp) for a, e in segments(spec, lo, hi, keep)]
    return [(dp.reduced_grad(i, a, e), tp) for i, a, e, tp in dp._norm_plan]


def _owner(mesh, dims: tuple[str, ...]) -> bool:
    return all(mesh.coords[d] == 0 for d in dims)


def grad_norm(target, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Norm of the logical model's gradient (fp32 scalar, the same on every rank); collective
    over the world. target: a DataParallel, ZeroAdamW, nn.Module or iterable of parameters
    (plain parameters: .main_grad if present, else .grad, taken as reduced over dp); or an
    object with `parts`, [(target, mesh)] of modules in layouts of their own ([modules]: an
    encoder's DataParallel on its ModuleMesh beside the decoder's), summed into one norm."""
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise comm.ConfigError(f"norm_type={norm_type!r} must be > 0 (2.0, or inf for the max norm)")
    inf = math.isinf(norm_type)
    local = None
    for part, part_mesh in getattr(target, "parts", None) or [(target, mesh)]:
        s = _local_power(part, part_mesh, norm_type)
        if s is not None:
            local = s if local is None else (torch.maximum(local, s) if inf else local + s)
    if local is None:
        local = torch.zeros((), dtype=torch.float64, device=torch.device(mesh.ctx.device))
    total = comm.all_reduce(local.reshape(1), mesh["world"], "max" if inf else "sum")[0]
    return (total if inf else total ** (1.0 / norm_type)).float()


def _local_power(target, mesh, norm_type: float) -> torch.Tensor | None:
    """This rank's share of sum |g|^p (max |g| for inf): each replicated gradient counted on
    one rank only. None: no gradient here."""
    target = getattr(target, "dp", target)  # a ZeroAdamW: its DataParallel
    if target is None:  # a module this rank does not run
        return None
    if isinstance(target, DataParallel):
        target.finish_grad_sync()
        segs = norm_segments(target)
        replicated = ("cp",) if target.group_name == "dp" else ()  # the dp slices are disjoint
        device = target.buckets[0].grad.device if target.buckets else None
    else:
        params = target.parameters() if isinstance(target, nn.Module) else target
        segs = []
        for p in params:
            g = getattr(p, "main_grad", None)
            g = g if g is not None else p.grad
            if g is not None:
                segs.append((g, tp_sharded(p)))
        replicated = ("dp", "cp")
        device = segs[0][0].device if segs else None
    keep = {True: _owner(mesh, replicated), False: _owner(mesh, replicated + ("tp",))}
    inf = math.isinf(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=device) if inf and device is not None else None
    for g, tp in segs:
        if not g.numel() or not (inf or keep[tp]):
            continue
        if inf:
            local = torch.maximum(local, torch.linalg.vector_norm(g, norm_type).to(torch.float64))
        else:  # the first sum as it is (0.0 + s is s): no zeros and no add kernel of its own
            s = _power_sum(g, norm_type)
            local = s if local is None else local + s
    return local


ROW = 1 << 11  # elements per float32 partial sum in _power_sum


def _power_sum(g: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |g|^p as a float64 scalar, read in one pass over g. A float32 norm over a whole flat
    bucket of millions of elements is off by up to ~1e-5 relative (enough for layouts, whose
    buckets differ, to report visibly different norms); `vector_norm(g, dtype=float64)` is
    exact but casts the whole bucket
    to float64 first: on a GPU that pass and the float64 reduction cost ~10 ms a step at 1.92B
    parameters (an H200 profile, 12 ms of a 105 ms step), most of the optimizer's own update. So:
    float32 norms of rows of ROW elements, their p-th powers summed in float64: within 1e-6
    relative of the exact sum (measured ~1e-7 at p = 2), whatever the bucket's length."""
    g = g.reshape(-1)
    dtype = torch.float32 if g.dtype in (torch.float16, torch.bfloat16, torch.float32) else g.dtype
    rows = g.numel() // ROW
    total = None  # sums of non-negative powers: 0.0 + s is s, so the first is taken as it is
    if rows:
        part = torch.linalg.vector_norm(g[: rows * ROW].view(rows, ROW), norm_type, dim=1, dtype=dtype)
        total = part.to(torch.float64).pow_(norm_type).sum()
    if g.numel() > rows * ROW:  # the tail: under one row, cheap in float64
        tail = torch.linalg.vector_norm(g[rows * ROW :], norm_type, dtype=torch.float64) ** norm_type
        total = tail if total is None else total + tail
    return total if total is not None else torch.zeros((), dtype=torch.float64, device=g.device)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping factor for a gradient of norm `total`: max_norm / (norm + 1e-6), at
    most 1 (a 0-d tensor; ZeroAdamW.step(clip_coef=...) applies it inside its kernel)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_grad_norm_(target, max_norm: float, mesh, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most max_norm (torch's rule:
    coef = max_norm / (norm + 1e-6), clamped to 1). Returns the norm before clipping. With a
    ZeroAdamW, grad_norm + step(clip_coef=clip_coefficient(norm, max_norm)) does the same
    without a pass of its own over the gradients."""
    target = getattr(target, "dp", target)  # a ZeroAdamW: its DataParallel
    if not isinstance(target, (DataParallel, nn.Module)):
        target = list(target)  # read twice: once for the norm, once to scale
    total = grad_norm(target, mesh, norm_type)
    coef = clip_coefficient(total, max_norm)
    if coef.item() < 1.0:
        if isinstance(target, DataParallel):
            target.scale_grads_(coef)
        else:
            params = target.parameters() if isinstance(target, nn.Module) else target
            with torch.no_grad():
                for p in params:
                    g = getattr(p, "main_grad", None)
                    g = g if g is not None else p.grad
                    if g is not None:
                        g.mul_(coef.to(g.device))
    return total
