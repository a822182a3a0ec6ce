"""Hugging Face model directories in: config.json + safetensors shards as a born-sharded init source.

A model is built the usual way (meta device -> split -> materialise, parallel/materialize.py);
only the recipe's `init` changes. Instead of drawing a parameter's full value it returns a
`LazyParam` (safetensors_dir.py): a tensor-shaped handle on that parameter in the Hugging Face files, which
materialize narrows to this rank's piece exactly as it narrows a real tensor, and which reads
just that window (safetensors' memory-mapped `get_slice`) when it is finally converted with
`.to()`. So under tp, pp or ep each rank reads only its own slices and never holds a full
weight; one process with no split reads everything once (`meshspeed convert --from-hf`).
The name and layout mapping (rotary permutation, stacked experts) is models/hf.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from meshspeed.checkpoint.safetensors_io import read_safetensors_header
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.recipe import Recipe
from meshspeed.interop.hf_config import read_config_json
from meshspeed.interop.model_source import checkpoint_model_config
from meshspeed.interop.safetensors_dir import INDEX, SINGLE, LazyParam, SafetensorsFiles
from meshspeed.models import ModelConfig, recipe_for
from meshspeed.models.hf import config_from_hf, hf_tensors
from meshspeed.models.init import canonical_name

# SafetensorsFiles and LazyParam live in safetensors_dir.py (diffusers_io.py shares them without
# importing this module, which dispatches to it); importers of them from here keep working.
__all__ = ["INDEX", "SINGLE", "HFCheckpoint", "LazyParam", "SafetensorsFiles", "hf_recipe", "init_from"]


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


class HFCheckpoint(SafetensorsFiles):
    """A Hugging Face model directory opened for reading: its config.json (as a ModelConfig too)
    and, per tensor name, the safetensors file holding it."""

    def __init__(self, path: str, setting: str = "--from-hf"):
        self.path = path
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ConfigError(
                f"{setting}={path!r} has no config.json; give a Hugging Face model directory "
                f"(config.json + model.safetensors or {INDEX})"
            )
        self.hf_config = read_config_json(cfg_file)  # every key typed and in range, or one line
        try:
            self.config = config_from_hf(self.hf_config)
        except ConfigError as e:
            raise ConfigError(f"{cfg_file}: {e}") from None
        except ValueError as e:  # ModelConfig's own checks
            raise ConfigError(f"{cfg_file}: {e}") from None
        SafetensorsFiles.__init__(self, path, setting)
        for f in sorted(set(self.files.values())):  # every shard's header checked before any read
            read_safetensors_header(f)
        self.sources = hf_tensors(self.config)
        self._check(setting)

    def _check(self, setting: str) -> None:
        wanted = {n for s in self.sources.values() for n in s.names}
        missing = sorted(wanted - set(self.files))
        if missing:
            raise ConfigError(
                f"{setting}={self.path!r} lacks {missing[0]} ({len(missing)} tensors missing) that "
                f"its config.json implies; is the checkpoint complete?"
            )
        # Old checkpoints carry RoPE tables as buffers; a tied lm_head may be written anyway.
        extra = sorted(
            n
            for n in set(self.files) - wanted
            if not n.endswith("rotary_emb.inv_freq")
            and not (n == "lm_head.weight" and self.config.tie_embeddings)
        )
        if extra:
            raise ConfigError(
                f"{setting}={self.path!r} holds {extra[0]} ({len(extra)} tensors) that meshspeed's "
                f"{self.config.family} model has no place for; is config.json for these weights?"
            )


class HFInit:
    """A recipe `init` reading from a Hugging Face checkpoint (the seed is not used)."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt

    def __call__(self, fqn: str, shape: torch.Size, seed: int) -> LazyParam:
        name = canonical_name(fqn, self.ckpt.config)
        source = self.ckpt.sources.get(name)
        if source is None:
            raise ConfigError(f"parameter {fqn} has no Hugging Face counterpart in {self.ckpt.path}")
        want, have = list(shape[1:] if source.stacked else shape), self.ckpt.shape(source.names[0])
        if have != want:
            raise ConfigError(
                f"{source.names[0]} in {self.ckpt.path} has shape {have} but its config.json "
                f"implies {want} (meshspeed's {fqn})"
            )
        return LazyParam(self.ckpt, fqn, source, torch.Size(shape))


def hf_recipe(ckpt: HFCheckpoint, config: ModelConfig | None = None) -> Recipe:
    """The family's recipe for the checkpoint's model, its init reading from the files."""
    return dataclasses.replace(recipe_for(config or ckpt.config), init=HFInit(ckpt))


def open_model_dir(path: str, setting: str):
    """A Hugging Face directory opened for reading: a diffusers DiTTransformer2DModel (its
    config.json names a `_class_name`) or a transformers causal LM."""
    from meshspeed.interop.diffusers_io import DiffusersCheckpoint, is_diffusers_dir
    from meshspeed.interop.hf_vlm_io import Qwen2VLCheckpoint, is_qwen2_vl_dir

    if is_qwen2_vl_dir(path):  # a vision-language model (family vlm)
        return Qwen2VLCheckpoint(path, setting)
    return DiffusersCheckpoint(path, setting) if is_diffusers_dir(path) else HFCheckpoint(path, setting)


def source_recipe(ckpt, config: ModelConfig | None = None) -> Recipe:
    """The recipe whose init reads `ckpt` (open_model_dir's, or a directory path for it)."""
    from meshspeed.interop.diffusers_io import DiffusersCheckpoint, diffusers_recipe

    if isinstance(ckpt, str):
        ckpt = open_model_dir(ckpt, "model.init_from")
    if isinstance(ckpt, DiffusersCheckpoint):
        return diffusers_recipe(ckpt, config)
    if hasattr(ckpt, "state"):  # a Qwen2-VL directory (hf_vlm_io.Qwen2VLCheckpoint): converted whole
        return ckpt.recipe(config)
    return hf_recipe(ckpt, config)


def init_from(cfg, setting: str = "model.init_from") -> tuple[ModelConfig, Recipe, str | None]:
    """What the trainer builds for `model.init_from`: (model config, recipe, meshspeed checkpoint
    to load weights from after building, or None when the recipe's init reads them itself).

    A Hugging Face directory: the config comes from its config.json and each rank's init reads
    its slices. A meshspeed checkpoint (e.g. from `meshspeed convert --from-hf`): the config it
    recorded, weights loaded (resharded) once the model is built."""
    path = cfg.model.init_from
    if sizes := cfg.model.overrides():
        k, v = next(iter(sizes.items()))
        raise ConfigError(f"model.{k}={v} cannot change a model loaded with {setting}={path!r}; drop it")
    if is_hf_dir(path):
        ckpt = open_model_dir(path, setting)
        config, recipe, weights = ckpt.config, source_recipe(ckpt), None
    else:
        weights = path
        config = checkpoint_model_config(path, setting)
        recipe = recipe_for(config)
    if cfg.train.seq_len > config.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds the {setting} model's longest sequence "
            f"{config.max_seq_len} (max_position_embeddings or sliding_window); use ≤ {config.max_seq_len}"
        )
    return config, recipe, weights


def convert_from_hf(path: str, out: str, dtype: torch.dtype = torch.float32, overwrite: bool = False) -> str:
    """`meshspeed convert --from-hf`: read a Hugging Face directory in one process (through the
    same init source as training) and save it as meshspeed checkpoint `out/step-000000`, with
    the model config and the original config.json recorded. Returns the checkpoint's path.

    `out` is locked like a run directory while it is written, and a checkpoint already there is
    replaced only with `overwrite` (the save swaps the whole step directory in, so an
    interruption leaves the old one)."""
    from meshspeed import comm
    from meshspeed.checkpoint.dcp import save_checkpoint
    from meshspeed.checkpoint.dirs import step_dirs
    from meshspeed.checkpoint.lock import RunDirLock
    from meshspeed.parallel.materialize import build_parallel_model

    ckpt = open_model_dir(path, "--from-hf")
    with RunDirLock(out, "--out", "meshspeed convert"):
        found = step_dirs(out)
        if found and not overwrite:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ConfigError(
                f"--out={out!r} already holds the checkpoint {found[0]}{more}; add --overwrite to "
                f"replace it, or choose another --out"
            )
        ctx = comm.init(device="cpu")  # files in, files out: the GPU stays untouched
        try:
            mesh = comm.ParallelDims().build(ctx)
            model = build_parallel_model(source_recipe(ckpt), mesh, dtype=dtype)
            extra = {"model_config": dataclasses.asdict(ckpt.config)}
            if hasattr(ckpt, "diffusers_config"):  # kept for the export back (diffusers_io.py)
                extra["diffusers_config"] = json.dumps(ckpt.diffusers_config)
            else:
                extra["hf_config"] = json.dumps(ckpt.hf_config)
            return save_checkpoint(out, 0, model, None, mesh, extra=extra, keep=None)
        finally:
            ctx.close()
