"""Hugging Face model directories out: what `transformers.AutoModelForCausalLM.from_pretrained`
loads as is, from a live model under any layout or from a meshspeed checkpoint.

    out/config.json                               models/hf.py's config_to_hf
    out/model-0000k-of-0000n.safetensors          shards of at most `max_shard_bytes` each
    out/model.safetensors.index.json              {"metadata": {"total_size"}, "weight_map"}
    out/tokenizer.json ...                        when the run used a Hugging Face tokenizer

(one shard: `model.safetensors` and no index, as transformers writes it). Weights are what the
model computes with: sparse weights are multiplied by their masks. Each pipeline stage's first
rank gathers its stage's weights one shard at a time over tp and writes them, so no rank ever
holds more than one shard; shard numbers are agreed up front from the (known) full shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil

import torch

from meshspeed import comm
from meshspeed.checkpoint.dirs import agree, fsync_write
from meshspeed.checkpoint.safetensors_io import read_safetensors_header, write_safetensors
from meshspeed.comm import outputs, placement
from meshspeed.comm.errors import ConfigError
from meshspeed.data.tokenizer import HF_TOKENIZER_FILES
from meshspeed.interop.model_source import checkpoint_model_config, checkpoint_state
from meshspeed.models import ModelConfig
from meshspeed.models.hf import config_to_hf, hf_tensors, to_hf

DEFAULT_SHARD_BYTES = 2 * 1024**3
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _plan(params: dict, fqns: list[str], dtype: torch.dtype | None, limit: int) -> list[list[str]]:
    """Consecutive groups of parameters, each at most `limit` bytes once full (one larger
    parameter gets a shard of its own)."""
    shards, size = [[]], 0
    for fqn in fqns:
        p = params[fqn]
        sh = placement.sharding_of(p)
        n = torch.Size(sh.full_shape if sh is not None else p.shape).numel()
        nbytes = n * (dtype or p.dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(fqn)
        size += nbytes
    return [s for s in shards if s]


def export_hf(
    model,
    mesh,
    out: str,
    config: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    tokenizer_files: tuple[str, ...] | list[str] = (),
    hf_extra: dict | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    masks: dict | None = None,
    overwrite: bool = False,
    setting: str = "checkpoint.export_hf",
) -> list[str]:
    """Collective over the world: write `model` (this rank's pieces, any tp/pp/dp layout) as a
    Hugging Face directory `out`; returns the files written. `dtype` casts floating weights
    (default: as trained). `hf_extra`: an imported config.json whose token ids are kept.
    `masks`: {weight FQN: sparsity mask}, default the model's sparse layers' own. `out` is
    written whole or not at all, and never over a file meshspeed did not write; one holding
    such files is refused unless `overwrite` (`setting` names the option in the refusal)."""
    sources = hf_tensors(config)
    config_json = config_to_hf(config, dtype or next(model.parameters()).dtype, hf_extra)  # refuses early
    params = dict(model.named_parameters())
    unknown = [f for f in params if f not in sources]
    if unknown:
        raise ConfigError(f"parameter {unknown[0]} has no Hugging Face counterpart ({config.family} family)")
    c, lead = mesh.coords, mesh.ctx.rank == 0
    writer = c["dp"] == 0 and c["cp"] == 0  # one copy per stage: its tp line gathers
    shards = _plan(params, list(params), dtype, max_shard_bytes)
    counts = comm.all_gather(torch.tensor([len(shards)], device=mesh.ctx.device), mesh["pp"]).tolist()
    first, total = sum(counts[: c["pp"]]), sum(counts)
    names = [
        SINGLE if total == 1 else f"model-{first + k + 1:05d}-of-{total:05d}.safetensors"
        for k in range(len(shards))
    ]
    # Written whole into a sibling and moved into place at the end (comm/outputs.py): a
    # failure anywhere leaves `out` as it was, and nothing meshspeed did not write is touched.
    err, stage = None, staging_dir(mesh, out)
    if lead:
        try:
            outputs.check_target_dir(out, setting, overwrite, is_export_name)
            outputs.clean_orphans(out)
            os.makedirs(stage)
        except Exception as e:  # reported on every rank by agree
            err = e
    agree(mesh, err, f"preparing {out} for the Hugging Face export")
    try:
        _write(model, mesh, config, stage, names, shards, params, sources, dtype, masks, writer)
        written = None
        if lead:
            try:
                body = json.dumps(config_json, indent=2, sort_keys=True).encode()
                fsync_write(os.path.join(stage, "config.json"), body)
                written = ["config.json"] + _index(stage, total)
                for f in tokenizer_files:
                    shutil.copyfile(f, os.path.join(stage, os.path.basename(f)))
                    written.append(os.path.basename(f))
                outputs.commit_dir(stage, out, written)
            except Exception as e:  # reported on every rank by agree
                err = outputs.disk_error(e, stage) or e
        agree(mesh, err, f"writing the Hugging Face export {out}")
    except BaseException:
        if lead:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    return [os.path.join(out, n) for n in written] if lead else [os.path.join(out, "config.json")]


def is_export_name(name: str) -> bool:
    """A name a Hugging Face export writes (config.json, weights, index, tokenizer files)."""
    return name in (SINGLE, INDEX, "config.json", *HF_TOKENIZER_FILES) or bool(_SHARD_RE.match(name))


def staging_dir(mesh, out: str) -> str:
    """The temporary sibling of `out` every rank writes into: rank 0's name for it."""
    mine = [int(outputs.host_tag(), 16), os.getpid(), secrets.randbits(32)]
    t = torch.tensor(mine if mesh.ctx.rank == 0 else [0, 0, 0], dtype=torch.int64, device=mesh.ctx.device)
    comm.broadcast(t, mesh["world"], src=0)
    host, pid, nonce = t.tolist()
    return outputs.sibling(out, host=f"{host:08x}", pid=pid, nonce=f"{nonce:08x}")


def _write(model, mesh, config, stage, names, shards, params, sources, dtype, masks, writer) -> None:
    """Every stage's weights into `stage`, one shard at a time (collective over tp)."""
    from meshspeed.checkpoint.export import weight_masks  # masks as the safetensors export finds them

    c, err = mesh.coords, None
    masks = weight_masks(model) if masks is None else masks
    if writer:
        for name, shard in zip(names, shards):
            tensors = {}
            for fqn in shard:
                p = params[fqn]
                local = p.detach() * masks[fqn] if fqn in masks else p.detach()  # masks are sharded like p
                full = placement.full_tensor(local, mesh, placement.sharding_of(p))
                if dtype is not None and full.is_floating_point():
                    full = full.to(dtype)
                tensors.update(to_hf(fqn, full, sources[fqn]))
            if c["tp"] == 0 and err is None:
                try:
                    write_safetensors(os.path.join(stage, name), tensors, {"format": "pt"})
                except Exception as e:  # noqa: BLE001 - reported on every rank by agree
                    err = outputs.disk_error(e, os.path.join(stage, name)) or e
            del tensors
    agree(mesh, err, f"exporting the Hugging Face model ({config.family})")


def _index(out: str, total: int) -> list[str]:
    """Shard names, plus the index when there are several (read back from the shards' headers)."""
    if total == 1:
        return [SINGLE]
    shards = [os.path.join(out, f"model-{k:05d}-of-{total:05d}.safetensors") for k in range(1, total + 1)]
    weight_map, size = {}, 0
    for f in shards:
        header = read_safetensors_header(f)
        weight_map.update({k: os.path.basename(f) for k in header})
        size += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    fsync_write(os.path.join(out, INDEX), json.dumps(index, indent=2).encode())
    return [os.path.basename(f) for f in shards] + [INDEX]


# --- from a meshspeed checkpoint ------------------------------------------------------------


def source_hf_config(path: str) -> dict | None:
    """The config.json a model came from (model.init_from: a Hugging Face directory, or a
    checkpoint that convert recorded it in), so an export keeps its token ids and model type."""
    if not path:
        return None
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    try:
        extra = checkpoint_state(path)[1].get("extra") or {}
    except Exception:  # noqa: BLE001 - only a nicety: the export is complete without it
        return None
    return json.loads(extra["hf_config"]) if extra.get("hf_config") else None


def export_checkpoint(
    path: str,
    out: str,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str = "",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> list[str]:
    """`meshspeed convert --checkpoint DIR --to-hf OUT`, in one process: build the model with no
    init (its values come from the checkpoint), load weights and sparsity masks, export. `OUT`
    is checked first (export_hf's rules), so a refused target costs no loading."""
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.comm.checkpoint_io import saved_tensors
    from meshspeed.data.tokenizer import load_tokenizer
    from meshspeed.models import recipe_for
    from meshspeed.parallel.materialize import build_parallel_model

    outputs.check_target_dir(out, "--to-hf", overwrite, is_export_name)
    config = checkpoint_model_config(path)
    resolved, state = checkpoint_state(path)
    extra = state.get("extra") or {}
    run_cfg = extra.get("config") or {}
    tokenizer = tokenizer or (run_cfg.get("data") or {}).get("tokenizer", "")
    tok_files = load_tokenizer(tokenizer).files() if tokenizer not in ("", "bytes") else []
    recipe = dataclasses.replace(recipe_for(config), init=lambda fqn, shape, seed: torch.empty(shape))
    ctx = comm.init(device="cpu")  # files in, files out: the GPU stays untouched
    try:
        mesh = comm.ParallelDims().build(ctx)
        model = build_parallel_model(recipe, mesh)
        masks = _add_mask_buffers(model, saved_tensors(resolved))
        load_checkpoint(resolved, model, None, mesh, strict=False, restore_rng=False)
        hf_extra = json.loads(extra["hf_config"]) if extra.get("hf_config") else None
        return export_hf(
            model,
            mesh,
            out,
            config,
            dtype=dtype,
            tokenizer_files=tok_files,
            hf_extra=hf_extra,
            max_shard_bytes=max_shard_bytes,
            masks=masks,
            overwrite=overwrite,
            setting="--to-hf",
        )
    finally:
        ctx.close()


def _add_mask_buffers(model, saved: dict) -> dict[str, torch.Tensor]:
    """Give `model` a bool buffer for every sparsity mask in the checkpoint (so loading fills
    it), named as the sparse layers name them: `<module>.mask` for a linear weight,
    `<module>.<param>_mask` for a raw parameter. Returns {weight FQN: mask}."""
    params, masks = dict(model.named_parameters()), {}
    for key, (shape, dtype) in saved.items():
        fqn = key.removeprefix("model.")
        if not key.startswith("model.") or dtype != torch.bool or fqn in params:
            continue
        mod_name, _, buf = fqn.rpartition(".")
        pname = "weight" if buf == "mask" else buf.removesuffix("_mask")
        weight = f"{mod_name}.{pname}" if mod_name else pname
        if weight in params and list(params[weight].shape) == list(shape):
            mod = model.get_submodule(mod_name)
            mod.register_buffer(buf, torch.ones(shape, dtype=torch.bool))
            masks[weight] = getattr(mod, buf)
    return masks
