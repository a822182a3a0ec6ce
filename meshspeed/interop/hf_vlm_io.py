"""A transformers Qwen2-VL directory (save_pretrained of Qwen2VLForConditionalGeneration) in and
out of meshspeed's family 'vlm': `--model.init_from DIR`, `meshspeed convert --from-hf DIR` and
`--to-hf` of a vlm checkpoint. The tensors' mapping is interop/hf_vlm.py's.

Reading loads the whole state dict once per process and converts it (the fused qkv cut, the
Conv3d's time taps summed, q/k rows permuted); the recipe's init then hands each parameter's
full value to the materializer, which keeps this rank's tp slice. That suits the CPU-sized
models this is for; a 7B vlm would want the text families' lazy per-slice reads (hf_import).

Qwen2-VL takes any resolution; meshspeed's ViT one `image_size`. The export writes it into
config.json as `meshspeed_image_size` (transformers keeps unknown keys), and a directory without
it gets 4 merged tokens a side (image_size = 4 · patch_size · merge_size).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import torch

from meshspeed.comm.errors import ConfigError
from meshspeed.interop import hf_vlm

IMAGE_SIZE_KEY = "meshspeed_image_size"


def is_qwen2_vl_dir(path: str) -> bool:
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return False
    try:
        with open(cfg) as f:
            return json.load(f).get("model_type") == "qwen2_vl"
    except (OSError, ValueError):
        return False


def _hf_names(state: dict) -> dict:
    """Qwen2-VL's current names: checkpoints saved by transformers < 4.52 say `visual.*` and
    `model.*` where the model now holds `model.visual.*` and `model.language_model.*`."""
    out = {}
    for k, v in state.items():
        if k.startswith("visual."):
            k = "model." + k
        elif k.startswith("model.") and not k.startswith(("model.visual.", "model.language_model.")):
            k = "model.language_model." + k[len("model.") :]
        out[k] = v
    return out


class Qwen2VLCheckpoint:
    """A Qwen2-VL directory opened for reading: `config` (a vlm ModelConfig), `hf_config`, and
    the converted weights by meshspeed FQN."""

    def __init__(self, path: str, setting: str = "model.init_from"):
        from safetensors.torch import load_file

        self.path = path
        with open(os.path.join(path, "config.json")) as f:
            self.hf_config = json.load(f)
        vision = self.hf_config.get("vision_config") or {}
        cell = int(vision.get("patch_size", 14)) * int(vision.get("spatial_merge_size", 2))
        image_size = int(self.hf_config.get(IMAGE_SIZE_KEY) or 4 * cell)
        try:
            self.config = hf_vlm.config_from_hf(self.hf_config, image_size=image_size)
        except (ConfigError, ValueError, KeyError) as e:
            raise ConfigError(f"{setting}={path!r}: config.json: {e}") from None
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ConfigError(f"{setting}={path!r} has config.json but no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        try:
            self.state = hf_vlm.state_from_hf(_hf_names(state), self.config)
        except ConfigError as e:
            raise ConfigError(f"{setting}={path!r}: {e}") from None

    def init(self, fqn: str, shape: torch.Size, seed: int) -> torch.Tensor:
        value = self.state.get(fqn)
        if value is None or tuple(value.shape) != tuple(shape):
            have = None if value is None else list(value.shape)
            raise ConfigError(
                f"{self.path}: meshspeed's {fqn} {list(shape)} has no counterpart of that shape ({have})"
            )
        return value

    def recipe(self, config=None):
        from meshspeed.models import recipe_for

        return dataclasses.replace(recipe_for(config or self.config), init=self.init)


def export_vlm_checkpoint(path: str, out: str, dtype=None, overwrite: bool = False) -> list[str]:
    """`meshspeed convert --checkpoint DIR --to-hf OUT` of a vlm checkpoint, in one process: the
    model built, the checkpoint loaded, written as a transformers Qwen2-VL directory (config.json
    with meshspeed_image_size, model.safetensors). Returns the files written."""
    from safetensors.torch import save_file

    from meshspeed import comm
    from meshspeed.checkpoint.dcp import load_checkpoint
    from meshspeed.comm import outputs
    from meshspeed.interop.hf_export import is_export_name
    from meshspeed.interop.model_source import checkpoint_model_config, checkpoint_state
    from meshspeed.models import recipe_for
    from meshspeed.parallel.materialize import build_parallel_model

    outputs.check_target_dir(out, "--to-hf", overwrite, is_export_name)
    config = checkpoint_model_config(path)
    resolved, _ = checkpoint_state(path)
    recipe = dataclasses.replace(recipe_for(config), init=lambda fqn, shape, seed: torch.empty(shape))
    ctx = comm.init(device="cpu")  # files in, files out
    try:
        mesh = comm.ParallelDims().build(ctx)
        model = build_parallel_model(recipe, mesh)
        load_checkpoint(resolved, model, None, mesh, strict=False, restore_rng=False)
        state = {k: v.detach() for k, v in model.state_dict().items()}
    finally:
        ctx.close()
    hf_state = hf_vlm.state_to_hf(state, config)
    if dtype is not None:
        hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
    cfg = {**hf_vlm.config_to_hf(config), IMAGE_SIZE_KEY: config.image_size}
    cfg["architectures"] = ["Qwen2VLForConditionalGeneration"]
    os.makedirs(out, exist_ok=True)
    files = [os.path.join(out, "model.safetensors"), os.path.join(out, "config.json")]
    save_file({k: v.contiguous() for k, v in hf_state.items()}, files[0], metadata={"format": "pt"})
    with open(files[1], "w") as f:
        json.dump(cfg, f, indent=1)
    return files
