"""Model transformations: sparsify / unsparsify by fully-qualified-name patterns, and the report.

A target is anything with a mask: a SparseLinear module or a SparseParam (stacked expert weight).
Both expose name, weight, mask, nm, transposable, sr_ste_lambda, groups, set_mask, path, path_reason.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from typing import Union

import torch
from torch import nn

from meshspeed.sparse.budget import erk_sparsities, solve_budget
from meshspeed.sparse.config import SparsityConfig
from meshspeed.sparse.linear import SparseLinear
from meshspeed.sparse.masks import nm_mask, topk_mask
from meshspeed.sparse.params import SparseParam, sparse_params_of
from meshspeed.sparse.transposable import transposable_2to4_mask

Filter = Union[str, "re.Pattern[str]", Callable[[str, nn.Module], bool], None]
Target = SparseLinear | SparseParam


def _matcher(filter: Filter, default: str) -> Callable[[str, object], bool]:
    if filter is None:
        filter = default
    if callable(filter) and not isinstance(filter, (str, re.Pattern)):
        return filter
    if isinstance(filter, re.Pattern):
        return lambda name, _: filter.search(name) is not None
    if filter.startswith("re:"):
        regex = re.compile(filter[3:])
        return lambda name, _: regex.search(name) is not None
    return lambda name, _: fnmatch.fnmatchcase(name, filter)


def targets(model: nn.Module) -> list[tuple[str, Target]]:
    """All masked weights of a model in module order, as (name, target)."""
    out: list[tuple[str, Target]] = []
    for fqn, module in model.named_modules():
        if isinstance(module, SparseLinear):
            out.append((fqn, module))
        for pname, sp in sparse_params_of(module).items():
            out.append((f"{fqn}.{pname}" if fqn else pname, sp))
    return out


def mask_for(target: Target, sparsity: float, *, scores: torch.Tensor | None = None) -> torch.Tensor:
    """The magnitude (or `scores`) mask of a target: its N:M pattern, or unstructured at `sparsity`.

    For N:M targets `sparsity` only switches the layer: 0 -> all ones (dense), otherwise N:M.
    """
    w = target.weight
    if target.nm is None:
        return topk_mask(w, sparsity, scores=scores, groups=target.groups)
    if sparsity <= 0:
        return torch.ones(w.shape, dtype=torch.bool, device=w.device)
    if target.transposable:
        return transposable_2to4_mask(w, name=target.name, scores=scores)
    return nm_mask(w, *target.nm, name=target.name, scores=scores)


def static_sparsities(
    named: list[tuple[str, Target]], config: SparsityConfig, sparsity: float
) -> dict[str, float]:
    """Per-target sparsity from the config's distribution alone (no adapter statistics)."""
    numels = {n: t.weight.numel() for n, t in named}
    if config.distribution == "erk":
        base = erk_sparsities({n: tuple(t.weight.shape) for n, t in named}, sparsity)
    else:
        base = {n: 1.0 for n in numels}
    return solve_budget(numels, base, sparsity, max_sparsity=config.max_layer_sparsity)


def sparsify(model: nn.Module, config: SparsityConfig, filter: Filter = None) -> list[str]:
    """Swap matching nn.Linear modules for SparseLinear in place, reusing their Parameters.

    `filter`: an fnmatch glob over FQNs, 're:<regex>', a compiled regex, or predicate(fqn, module);
    default config.layers. Masks start at config.target (static sparsity); a MaskController then
    drives them over training. Returns the FQNs swapped.
    """
    match = _matcher(filter, config.layers)
    chosen = [
        (fqn, mod) for fqn, mod in model.named_modules() if type(mod) is nn.Linear and fqn and match(fqn, mod)
    ]
    if not chosen and isinstance(model, nn.Linear):
        raise ValueError("sparsify swaps submodules; wrap a bare nn.Linear in a container first")
    swapped = []
    for fqn, linear in chosen:
        layer = SparseLinear.from_linear(
            linear,
            nm=config.nm,
            transposable=config.use_transposable,
            sr_ste_lambda=config.sr_ste_lambda,
            use_sparse_kernels=config.use_sparse_kernels,
        )
        layer.name = fqn
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        swapped.append((fqn, layer))
    _initial_masks(swapped, config)
    return [fqn for fqn, _ in swapped]


def sparsify_params(model: nn.Module, config: SparsityConfig, filter: Filter) -> list[str]:
    """Attach per-expert masks to matching >= 2-D parameters (e.g. '*.experts.w1' of shape [E, out, in])."""
    match = _matcher(filter, config.layers)
    attached = []
    for fqn, param in list(model.named_parameters()):
        if param.dim() < 2 or not match(fqn, param):
            continue
        parent_name, _, pname = fqn.rpartition(".")
        module = model.get_submodule(parent_name)
        if isinstance(module, SparseLinear) or pname in sparse_params_of(module):
            continue
        sp = SparseParam(
            module,
            pname,
            nm=config.nm,
            transposable=config.use_transposable,
            sr_ste_lambda=config.sr_ste_lambda,
            name=fqn,
        )
        attached.append((fqn, sp))
    _initial_masks(attached, config)
    return [fqn for fqn, _ in attached]


def _initial_masks(named: list[tuple[str, Target]], config: SparsityConfig) -> None:
    if not named:
        return
    levels = static_sparsities(named, config, float(config.target))
    for fqn, target in named:
        target.set_mask(mask_for(target, levels[fqn]))


def unsparsify(model: nn.Module, *, bake: bool = True) -> nn.Module:
    """Back to plain nn.Linear / plain parameters, reusing the Parameters.

    bake=True multiplies the mask into the weight in place (the model computes exactly what the
    sparse one did); bake=False keeps the dense weight (the STE-trained values under the mask).
    """
    for fqn, target in targets(model):
        if isinstance(target, SparseParam):
            target.remove(bake=bake)
            continue
        if not fqn:
            raise ValueError(
                "unsparsify swaps submodules, but the model itself is a SparseLinear; wrap it in a container"
            )
        linear = nn.Linear(
            target.in_features, target.out_features, bias=target.bias is not None, device="meta"
        )
        linear.weight, linear.bias = target.weight, target.bias
        if bake:
            with torch.no_grad():
                linear.weight.mul_(target.mask)
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
    return model


def report_rows(model: nn.Module) -> list[dict]:
    """One dict per masked weight: name, shape, pattern, sparsity, path, reason."""
    rows = []
    for name, t in targets(model):
        pattern = "unstructured" if t.nm is None else f"{t.nm[0]}:{t.nm[1]}" + ("T" if t.transposable else "")
        rows.append(
            dict(
                name=name,
                shape="x".join(map(str, t.weight.shape)),
                pattern=pattern,
                sparsity=1.0 - float(t.mask.sum()) / t.mask.numel(),
                path=t.path,
                reason=t.path_reason,
            )
        )
    return rows


def report(model: nn.Module) -> str:
    """A printable table of every masked weight, its sparsity and its matmul path (and why)."""
    rows = report_rows(model)
    if not rows:
        return "no sparse layers"
    headers = ["name", "shape", "pattern", "sparsity", "path", "reason"]
    cells = [
        [r["name"], r["shape"], r["pattern"], f"{r['sparsity']:.3f}", r["path"], r["reason"]] for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*c) for c in cells]
    return "\n".join(lines)
