"""Export the full (unsharded) model to safetensors, from any parallel layout.

Beside dcp.py: it shares the checkpoint's parameter specs and its all-ranks-agree
error handling, but it is a one-way export for other tools (Hugging Face style), not resume
state.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from meshspeed.checkpoint.dirs import agree, fsync_write
from meshspeed.checkpoint.safetensors_io import (
    SafetensorsError,
    read_safetensors_header,
    read_safetensors_metadata,
    write_safetensors,
)
from meshspeed.comm import outputs, placement
from meshspeed.sparse.linear import SparseLinear
from meshspeed.sparse.params import REGISTRY_ATTR


def weight_masks(model) -> dict[str, torch.Tensor]:
    """{parameter FQN: its sparsity mask} for every masked weight: SparseLinear layers and
    masks attached to raw parameters (SparseParam). Each mask is laid out like its weight."""
    out = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, SparseLinear):
            out[prefix + "weight"] = mod.mask
        for pname, sp in mod.__dict__.get(REGISTRY_ATTR, {}).items():
            out[prefix + pname] = getattr(mod, sp.mask_name)
    return out


def export_safetensors(
    model,
    mesh,
    path: str,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
) -> list[str]:
    """Collective over the world: write the full (unsharded) model as safetensors; returns the files.

    One file at `path` when pp=1. With pipeline stages, each stage's first rank writes
    `<stem>-0000s-of-0000P.safetensors` and rank 0 adds the Hugging Face index
    `<path>.index.json` ({"weight_map": {name: file}}). `dtype` casts floating tensors.
    Sparse weights are exported masked: what the model computes with, not the dense values
    the optimizer keeps under the mask. Each file is written whole or not at all, and an
    existing file meshspeed's export did not write (no `meshspeed_layout` in its metadata) is
    refused unless `overwrite`.
    """
    params = dict(model.named_parameters())  # this rank's pieces; each carries its Sharding
    c, pp = mesh.coords, mesh.dims.pp
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    files = [path] if pp == 1 else [f"{stem}-{s + 1:05d}-of-{pp:05d}.safetensors" for s in range(pp)]
    err = None
    if c["dp"] == 0 and c["cp"] == 0:  # one copy per stage is enough: its tp line gathers
        full, masks = {}, weight_masks(model)
        for name, p in params.items():
            local = p.detach() * masks[name] if name in masks else p.detach()  # the mask is sharded like p
            t = placement.full_tensor(local, mesh, placement.sharding_of(p))
            full[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        if c["tp"] == 0:
            try:
                meta = {"format": "pt", "meshspeed_layout": json.dumps(dataclasses.asdict(mesh.dims))}
                meta.update(metadata or {})
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                _check_ours(files[c["pp"]], overwrite)
                if pp > 1 and c["pp"] == 0:
                    _check_ours(f"{stem}.safetensors.index.json", overwrite, index=True)
                write_safetensors(files[c["pp"]], full, meta)
            except Exception as e:  # noqa: BLE001
                err = e
    agree(mesh, err, f"exporting safetensors to {path}")
    if pp > 1:
        if mesh.ctx.rank == 0:
            try:
                weight_map, total = {}, 0
                for f in files:
                    header = read_safetensors_header(f)
                    weight_map.update({k: os.path.basename(f) for k in header})
                    total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
                # "meshspeed": its mark, so that a later export knows the file is its own
                index = {"metadata": {"total_size": total, "meshspeed": True}, "weight_map": weight_map}
                index_path = f"{stem}.safetensors.index.json"
                body = json.dumps(index, indent=1)
                tmp = outputs.sibling(index_path)
                fsync_write(tmp, body.encode())
                outputs.commit_file(tmp, index_path)
            except Exception as e:  # noqa: BLE001
                err = e
        agree(mesh, err, f"writing the safetensors index for {path}")
        files = files + [f"{stem}.safetensors.index.json"]
    return files


def _check_ours(path: str, overwrite: bool, index: bool = False) -> None:
    """Refuse to replace `path` when meshspeed's export did not write it (unless `overwrite`)."""
    if overwrite or not os.path.lexists(path):
        return
    try:
        if index:
            with open(path) as f:
                ours = json.load(f)["metadata"]["meshspeed"] is True
        else:
            ours = "meshspeed_layout" in read_safetensors_metadata(path)
    except (OSError, ValueError, KeyError, TypeError, SafetensorsError):
        ours = False
    if not ours:
        raise outputs.OutputError(
            f"{path} exists and meshspeed's export did not write it; move it away or export elsewhere "
            f"(the export replaces only its own files)"
        )
