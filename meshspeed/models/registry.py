"""Model families: `ModelConfig.family` -> the family's recipe (model class, init, how it may be
split). Adding a family is a model file with a `recipe(config)` and one line here."""

from __future__ import annotations

import torch

from meshspeed.comm.recipe import Recipe, build_on_meta

from . import dit_recipe, llama, qwen2, vlm
from .config import FAMILIES, ModelConfig
from .init import init_weights

_RECIPES = {"llama": llama.recipe, "qwen2": qwen2.recipe, "vlm": vlm.recipe, "dit": dit_recipe.recipe}
assert set(_RECIPES) == set(FAMILIES), "config.FAMILIES and the registry must list the same families"


def recipe_for(config: ModelConfig) -> Recipe:
    """The recipe of `config`'s family, for this config (plans depend on it: MoE, tied...)."""
    return _RECIPES[config.family](config)


def build_model(
    config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """The whole single-device model: constructed on the meta device (no memory, no wasted
    default init), materialised on `device`, then the seeded init. RoPE tables stay float32
    whatever `dtype`. (meshspeed.parallel.materialize builds a rank's shards instead.)"""
    model = build_on_meta(recipe_for(config))
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    if config.family == "dit":  # DiT's own init (adaLN-Zero), not the decoders' init.py
        dit_recipe.init_weights(model, seed)
    else:
        init_weights(model, seed)
    return model
