"""Validation and derived sizes of the image-generation fields of ModelConfig (family 'dit').

Kept beside config.py, not in it (as vlm_config.py is), so the text families' config stays as it
was; config.py calls `check_dit` only for family 'dit'. Nothing here imports config.py.
"""

from __future__ import annotations

FREQ_DIM = 256  # sinusoidal timestep features before the timestep MLP (DiT, diffusers)


def ffn_dim(config) -> int:
    """DiT's MLP width: mlp_ratio 4 unless ffn_hidden says otherwise."""
    return 4 * config.dim if config.ffn_hidden is None else config.ffn_hidden


def out_channels(config) -> int:
    """Channels the model predicts: the velocity, plus DiT's variance channels when learn_sigma."""
    return config.in_channels * (2 if config.learn_sigma else 1)


def grid(config) -> int:
    """Patches along one side of the image."""
    return config.image_size // config.patch_size


def n_tokens(config) -> int:
    """Image tokens (patches) per sample: the sequence the blocks attend over."""
    return grid(config) ** 2


def _int(config, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use an integer >= {minimum}")


def check_dit(config) -> None:
    """One-line errors naming the field, the value and what would be valid."""
    for name, minimum in (("image_size", 1), ("patch_size", 1), ("in_channels", 1), ("n_classes", 0)):
        _int(config, name, minimum)
    _int(config, "text_dim", 0)
    if not isinstance(config.learn_sigma, bool):
        raise ValueError(f"ModelConfig.learn_sigma={config.learn_sigma!r} is invalid; use true or false")
    if config.image_size % config.patch_size:
        ok = [p for p in range(1, min(config.image_size, 16) + 1) if config.image_size % p == 0]
        raise ValueError(
            f"ModelConfig.patch_size={config.patch_size} does not divide image_size={config.image_size}; "
            f"choose patch_size among {', '.join(map(str, ok))}"
        )
    if config.dim % 4:
        # the 2D sincos positions split dim in two halves of sin/cos pairs
        raise ValueError(f"ModelConfig.dim={config.dim} is invalid for family 'dit'; use a multiple of 4")
