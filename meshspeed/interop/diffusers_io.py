"""diffusers `DiTTransformer2DModel` directories in and out of the `dit` family, as files.

    DIR/config.json                              {"_class_name": "DiTTransformer2DModel", ...}
    DIR/diffusion_pytorch_model.safetensors      (or shards + diffusion_pytorch_model.safetensors.index.json)

In: `--model.init_from DIR` and `meshspeed convert --from-hf DIR` open it as a
`DiffusersCheckpoint`, whose recipe init hands materialize a `LazyParam` per dit parameter
(interop/hf_import.py), so under tp each rank reads only its own rows or columns of each weight
through safetensors' `get_slice`. Two parameters are read whole-row: the patch embedding (the
Conv2d's [dim, C, p, p] rows flattened; tp runs it whole anyway) and the shared conditioning
embedder, whose window is read from every block's copy to check they are equal (dit shares one;
interop/diffusers_dit.py), small tensors read n_layers times.

Out: `meshspeed convert --checkpoint RUN --to-hf OUT` on a dit checkpoint writes what
`DiTTransformer2DModel.from_pretrained(OUT)` loads: the EMA of the weights when the checkpoint
holds one (what `meshspeed sample` uses), the trained weights with `ema=False` (--no-ema).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from meshspeed.checkpoint.dirs import fsync_write
from meshspeed.checkpoint.safetensors_io import read_safetensors_header, write_safetensors
from meshspeed.comm import outputs
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import Recipe
from meshspeed.interop.diffusers_dit import (
    config_from_diffusers,
    config_to_diffusers,
    diffusers_sources,
    to_diffusers,
)
from meshspeed.interop.model_source import checkpoint_model_config, checkpoint_state
from meshspeed.interop.safetensors_dir import LazyParam, SafetensorsFiles
from meshspeed.models import ModelConfig, recipe_for
from meshspeed.models.hf import HFTensor

CLASS = "DiTTransformer2DModel"
WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"
WORKS = f"give a diffusers {CLASS} directory (save_pretrained's: config.json + {WEIGHTS})"


def diffusers_class(path: str) -> str | None:
    """The `_class_name` of DIR/config.json (diffusers writes it; transformers does not), or None."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None  # transformers' reader names what is wrong with it
    name = data.get("_class_name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def is_diffusers_dir(path: str) -> bool:
    return diffusers_class(path) is not None


class DiffusersCheckpoint(SafetensorsFiles):
    """A DiTTransformer2DModel directory opened for reading: its config (as a dit ModelConfig),
    per tensor name the file holding it, and reads of dit parameters by their own names."""

    SINGLE, INDEX = WEIGHTS, WEIGHTS_INDEX

    def __init__(self, path: str, setting: str = "--from-hf"):
        cls = diffusers_class(path)
        if cls != CLASS:
            sub = os.path.join(path, "transformer")
            hint = f"; a pipeline's transformer is in {sub!r}" if diffusers_class(sub) == CLASS else ""
            raise ConfigError(f"{setting}={path!r} is a diffusers {cls} directory; {WORKS}{hint}")
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            self.diffusers_config = json.load(f)
        try:
            self.config = config_from_diffusers(self.diffusers_config)
        except (TypeError, ValueError) as e:  # ModelConfig's and the converter's checks
            raise ConfigError(f"{cfg_file}: {e}") from None
        SafetensorsFiles.__init__(self, path, setting)
        self.shapes = {}
        for f in sorted(set(self.files.values())):  # every shard's header checked before any read
            for name, entry in read_safetensors_header(f).items():
                if name != "__metadata__":
                    self.shapes[name] = list(entry["shape"])
        self.sources = diffusers_sources(self.config)
        wanted = {n for names in self.sources.values() for n in names}
        missing, extra = sorted(wanted - set(self.files)), sorted(set(self.files) - wanted)
        for names, what in ((missing, "lacks"), (extra, "holds")):
            if names:
                raise ConfigError(
                    f"{setting}={path!r} {what} {names[0]} ({len(names)} tensors) against what its "
                    f"config.json implies for the dit family; is config.json for these weights?"
                )

    def param_shape(self, fqn: str) -> list[int]:
        """The dit parameter's full shape as the files hold it."""
        shape = self.shapes[self.sources[fqn][0]]
        return [shape[0], int(torch.Size(shape[1:]).numel())] if fqn == "x_embedder.proj.weight" else shape

    def read(self, name: str, window: list[tuple[int, int]]) -> torch.Tensor:
        """dit parameter `name` restricted to `window` (LazyParam's call)."""
        names, raw = self.sources[name], lambda n, w: SafetensorsFiles.read(self, n, w)
        if name == "x_embedder.proj.weight":  # whole rows of the conv weight, flattened, then columns
            (a, b), (c, d) = window
            conv = self.shapes[names[0]]
            return raw(names[0], [(a, b)] + [(0, n) for n in conv[1:]]).reshape(b - a, -1)[:, c:d]
        first = raw(names[0], window)
        for other in names[1:]:
            if not torch.equal(raw(other, window), first):
                raise ConfigError(
                    f"{self.path!r}: {other} differs from {names[0]}: the dit family shares one "
                    "conditioning embedder (as DiT's checkpoints do); copy block 0's norm1.emb into "
                    "every block first"
                )
        return first


class DiffusersInit:
    """A recipe `init` reading from a diffusers directory (the seed is not used)."""

    def __init__(self, ckpt: DiffusersCheckpoint):
        self.ckpt = ckpt

    def __call__(self, fqn: str, shape: torch.Size, seed: int) -> LazyParam:
        if fqn not in self.ckpt.sources:
            raise ConfigError(f"parameter {fqn} has no counterpart in the diffusers DiT {self.ckpt.path}")
        have = self.ckpt.param_shape(fqn)
        if have != list(shape):
            raise ConfigError(
                f"{self.ckpt.sources[fqn][0]} in {self.ckpt.path} gives {fqn} the shape {have} but its "
                f"config.json implies {list(shape)}"
            )
        return LazyParam(self.ckpt, fqn, HFTensor((fqn,)), torch.Size(shape))


def diffusers_recipe(ckpt: DiffusersCheckpoint, config: ModelConfig | None = None) -> Recipe:
    """The dit recipe for the directory's model, its init reading from the files."""
    return dataclasses.replace(recipe_for(config or ckpt.config), init=DiffusersInit(ckpt))


# --- out ------------------------------------------------------------------------------------


def is_export_name(name: str) -> bool:
    return name in ("config.json", WEIGHTS, WEIGHTS_INDEX)


def export_diffusers(
    path: str, out: str, *, dtype: torch.dtype | None = None, ema: bool = True, overwrite: bool = False
) -> list[str]:
    """`meshspeed convert --checkpoint DIR --to-hf OUT` for a dit checkpoint, in one process:
    OUT/config.json + OUT/diffusion_pytorch_model.safetensors (one file: diffusers' own default
    shard size, 10 GB, is past any dit preset). Returns the files written."""
    from meshspeed import comm
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.parallel.materialize import build_parallel_model

    outputs.check_target_dir(out, "--to-hf", overwrite, is_export_name)
    config = checkpoint_model_config(path)
    try:
        kwargs = config_to_diffusers(config)
    except ValueError as e:
        raise ConfigError(f"--checkpoint={path!r}: {e}") from None
    resolved, state = checkpoint_state(path)
    extra = state.get("extra") or {}
    recipe = dataclasses.replace(recipe_for(config), init=lambda fqn, shape, seed: torch.empty(shape))
    ctx = comm.init(device="cpu")  # files in, files out: the GPU stays untouched
    try:
        mesh = comm.ParallelDims().build(ctx)
        model = build_parallel_model(recipe, mesh)
        load_checkpoint(resolved, model, None, mesh, strict=False, restore_rng=False)
    finally:
        ctx.close()
    weights = {n: p.detach() for n, p in model.named_parameters()}
    saved = extra.get("ema")
    if ema and saved is not None:  # a flow run's EMA (train/flow_run.py): whole tensors by name
        if set(saved["weights"]) != set(weights):
            odd = sorted(set(saved["weights"]) ^ set(weights))[0]
            raise ConfigError(
                f"--checkpoint={path!r}: its EMA does not match the model ({odd}); add --no-ema"
            )
        weights = {n: saved["weights"][n].to(weights[n]) for n in weights}
    tensors = to_diffusers(weights, config)
    tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in tensors.items()}
    # the imported config.json's other fields (its diffusers version) kept; the shape is ours
    recorded = json.loads(extra["diffusers_config"]) if extra.get("diffusers_config") else {}
    body = {**recorded, **kwargs, "_class_name": CLASS}
    body.setdefault("_diffusers_version", "0.30.0")  # the oldest whose DiTTransformer2DModel matches
    stage = outputs.sibling(out)
    try:
        outputs.clean_orphans(out)
        os.makedirs(stage)
        write_safetensors(os.path.join(stage, WEIGHTS), tensors, {"format": "pt"})
        fsync_write(os.path.join(stage, "config.json"), json.dumps(body, indent=2, sort_keys=True).encode())
        outputs.commit_dir(stage, out, ["config.json", WEIGHTS])
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, OSError):
            raise (outputs.disk_error(e, stage) or e) from None
        raise
    return [os.path.join(out, "config.json"), os.path.join(out, WEIGHTS)]


def weights_note(path: str, ema: bool) -> str:
    """Which weights an export of `path` holds, for the command's line."""
    saved = (checkpoint_state(path)[1].get("extra") or {}).get("ema")
    if saved is None:
        return "the trained weights (the checkpoint holds no EMA)"
    if not ema:
        return "the trained weights (--no-ema)"
    return f"the EMA of the weights (decay {saved['decay']:g}, {saved['updates']} updates)"
