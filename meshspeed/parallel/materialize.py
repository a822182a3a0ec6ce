"""Parameters born sharded: build a model on the meta device, split it, then give each rank
real memory for only what it owns.

    model = build_parallel_model(recipe, mesh, seed=0, device="cuda", sequence_parallel=True)

The order is the point: the single-device model is constructed on the meta device (no
memory), a pipeline rank drops the blocks other stages hold, tensor parallelism swaps modules
and cuts meta parameters into tagged meta pieces (comm.placement), and only then does
`materialize` allocate each local piece and fill it with its slice of the family's own
(seed, FQN) initial value. So every rank holds exactly the values it would have sliced from
the full single-device model — every parity test holds — while the transient memory is one
full parameter at a time (the full value is drawn on the CPU, sliced and dropped).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.comm.placement import local_piece, sharding_of, tag
from meshspeed.comm.recipe import Recipe, build_on_meta, tie
from meshspeed.parallel.tensor import parallelize


def _fqn_by_param(model: nn.Module) -> dict[int, str]:
    # named_parameters lists a tied Parameter once, under its first name (the owner).
    return {id(p): name for name, p in model.named_parameters()}


@torch.no_grad()
def materialize(
    model: nn.Module,
    recipe: Recipe,
    mesh,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Replace every meta parameter of `model` by a real one holding this rank's piece of the
    recipe's initial value (tags kept), allocate meta buffers, re-tie, and let the recipe
    recompute derived buffers. `mesh` maps mesh dim -> Group (for ranks and sizes)."""
    names = _fqn_by_param(model)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                done[id(p)] = _real(p, names[id(p)], recipe, mesh, seed, device, dtype)
            module._parameters[key] = done[id(p)]
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                # Derived buffers (RoPE tables) are refilled by the recipe; state buffers (an MoE
                # router's balancing bias) start at zero, as built on a real device: never
                # torch.empty's leftover memory.
                module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    tie(model, recipe)
    recipe.finish(model)
    return model


def _real(p: nn.Parameter, fqn: str, recipe: Recipe, mesh, seed: int, device, dtype) -> nn.Parameter:
    sharding = sharding_of(p)
    full_shape = sharding.full_shape if sharding is not None else p.shape
    value = recipe.init(fqn, torch.Size(full_shape), seed)  # the full value, on the CPU
    if sharding is not None:
        for dim, placement in sharding.axes:
            g = mesh[dim]
            value = local_piece(value, placement, g.rank, g.size)
    if tuple(value.shape) != tuple(p.shape):
        raise RuntimeError(
            f"materialize: {fqn} piece has shape {list(value.shape)}, the module expects "
            f"{list(p.shape)} (sharding {sharding})"
        )
    local = value.to(device=device, dtype=dtype or p.dtype)  # a lazy init (a file slice) reads here
    # `.to()` is a no-op on the same device and dtype, and a Shard(0) piece of a contiguous
    # tensor is already contiguous: without this copy the Parameter would be a view keeping the
    # whole full value alive. A piece that already owns exactly its bytes is kept as is.
    if local.untyped_storage().nbytes() != local.numel() * local.element_size():
        local = local.clone(memory_format=torch.contiguous_format)
    out = nn.Parameter(local, requires_grad=p.requires_grad)
    del value, local  # the full value goes now, before the next parameter is drawn
    for k, v in p.__dict__.items():  # tags (sharding, sparsity marks) travel with the parameter
        setattr(out, k, v)
    return tag(out, sharding)


def build_parallel_model(
    recipe: Recipe,
    mesh,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    plan=None,
    keep=None,
    transform=None,
) -> nn.Module:
    """This rank's model: built on meta, `keep(model)` applied (a pipeline stage drops what it
    does not hold), tensor parallel over mesh["tp"], `transform(model)` applied (expert
    parallelism: the expert weights are cut on meta too), then materialised. Without a process
    group (one device) it is the single-device model."""
    model = build_on_meta(recipe)
    if keep is not None:
        keep(model)
    parallelize(model, mesh, recipe, sequence_parallel=sequence_parallel, plan=plan)
    if transform is not None:
        transform(model)
    return materialize(model, recipe, mesh, seed=seed, device=device, dtype=dtype)
