"""A checkpoint's tensors: the model and optimizer state of one rank mapped to the named,
sharded tensors DCP writes and reads ("model.<fqn>", "optim.<fqn>.<name>"), and the checks
that a checkpoint's tensors fit the model loading it. dcp.py holds the
protocol around them (atomic directories, manifests, RNG, plain-data state).

Shapes are compared as full (unsplit) shapes: the Sharding tag of a split tensor
(comm.placement) gives it, so any layout loads any other's checkpoint.
"""

from __future__ import annotations

import torch

from meshspeed.checkpoint.dirs import CheckpointError
from meshspeed.comm import placement
from meshspeed.comm.placement import Sharding


def param_specs(model, mesh) -> tuple[dict, dict[str, Sharding]]:
    """This rank's parameters by FQN and the Sharding of each split one (comm.placement)."""
    params = dict(model.named_parameters())
    specs = {name: sh for name, p in params.items() if (sh := placement.sharding_of(p)) is not None}
    return params, specs


def buffer_specs(model) -> tuple[dict, dict[str, Sharding]]:
    """This rank's persistent buffers by FQN (sparsity masks, ...) and the Sharding of each
    split one: a buffer laid out like a sharded parameter carries the same tag."""
    buffers, specs = {}, {}
    for mod_name, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            buffers[fqn] = b
            if (sh := placement.sharding_of(b)) is not None:
                specs[fqn] = sh
    return buffers, specs


def check_buffers(saved: dict, buffers: dict, specs: dict, path: str, strict: bool) -> dict:
    """The buffers to load: those in the checkpoint (all of them when strict)."""
    out = {}
    for fqn, b in buffers.items():
        key = f"model.{fqn}"
        if key not in saved:
            if strict:
                raise CheckpointError(
                    f"model buffer {fqn} is not in checkpoint {path}; it was saved from a model "
                    f"without it (e.g. a dense run, where this one has sparsity masks); pass "
                    f"strict=False to keep this model's values"
                )
            continue
        want, have = full_shape(b, specs.get(fqn)), list(saved[key][0])
        if want != have:
            raise CheckpointError(
                f"buffer {fqn} has shape {have} in checkpoint {path} but {want} in the model; "
                f"the model config differs from the one that saved it"
            )
        out[fqn] = b
    return out


def full_shape(p, spec: Sharding | None) -> list[int]:
    return list(spec.full_shape if spec is not None else p.shape)


def optimizer_tensors(per: dict, params: dict, specs: dict):
    """Split contract-2 state into DCP tensors (+ specs) and the top-level scalars ("__step__").

    A state tensor of a sharded parameter is sharded like it (contract 2: local shape); a
    0-dim one is replicated."""
    tensors, tspecs, scalars = {}, {}, {}
    for fqn, value in per.items():
        if not isinstance(value, dict):
            scalars[fqn] = value  # the same on every rank
            continue
        if fqn not in params:
            raise CheckpointError(f"optimizer state names {fqn!r}, which is not a parameter of the model")
        p, spec = params[fqn], specs.get(fqn)
        for name, v in value.items():
            if not torch.is_tensor(v):
                raise CheckpointError(
                    f"optimizer state {fqn}.{name} is a {type(v).__name__}; per-parameter "
                    f"state holds tensors (contract 2), scalars go at the top level"
                )
            if spec is not None and v.dim() > 0 and v.shape != p.shape:
                raise CheckpointError(
                    f"optimizer state {fqn}.{name} has shape {list(v.shape)} but the parameter's "
                    f"local shard is {list(p.shape)}; contract 2 wants state in the local shape"
                )
            key = f"optim.{fqn}.{name}"
            tensors[key] = v
            if spec is not None and v.dim() > 0:
                tspecs[key] = spec
    return tensors, tspecs, scalars


def check_params(
    saved: dict, params: dict, specs: dict, path: str, strict: bool, pp: int, buffers: dict | None = None
) -> None:
    saved = {
        k[len("model.") :]: v
        for k, v in saved.items()
        if k.startswith("model.") and k[6:] not in (buffers or {})
    }
    for fqn, p in params.items():
        if fqn not in saved:
            raise CheckpointError(
                f"model parameter {fqn} is not in checkpoint {path} "
                f"({len(saved)} parameters saved); was it saved from a different model?"
            )
        want, have = full_shape(p, specs.get(fqn)), list(saved[fqn][0])
        if want != have:
            raise CheckpointError(
                f"parameter {fqn} has shape {have} in checkpoint {path} but {want} in the model; "
                f"the model config differs from the one that saved it"
            )
    if strict and pp == 1:  # a pipeline stage holds only some of the parameters
        unused = [k for k in saved if k not in params]
        if unused:
            raise CheckpointError(
                f"checkpoint {path} holds {len(unused)} parameter(s) the model lacks, e.g. "
                f"{unused[0]}; pass strict=False to ignore them"
            )


def optimizer_buffers(saved: dict, params: dict, specs: dict, path: str):
    """Empty local buffers, in the current layout, for every saved optimizer tensor of our params.

    A state tensor with the parameter's full shape was sharded like it (contract 2) and is
    sharded like the parameter is now; any other (0-dim) is replicated."""
    tensors, tspecs, where = {}, {}, {}
    for fqn, p in params.items():
        prefix = f"optim.{fqn}."
        full = full_shape(p, specs.get(fqn))
        for key, (shape, dtype) in saved.items():
            name = key[len(prefix) :]
            if not key.startswith(prefix) or "." in name:  # "." : a longer FQN sharing the prefix
                continue
            sharded = list(shape) == full and len(full) > 0
            if not sharded and len(shape) > 0:
                raise CheckpointError(
                    f"optimizer state {fqn}.{name} has shape {list(shape)} in checkpoint {path} "
                    f"but the parameter is {full}"
                )
            where[key] = (fqn, name)
            tensors[key] = torch.empty(p.shape if sharded else shape, dtype=dtype, device=p.device)
            if sharded and fqn in specs:
                tspecs[key] = specs[fqn]
    return tensors, tspecs, where
