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


def dit_params(c) -> int:
    """Parameters of a dit model (models/dit.py), counted from its config."""
    d, f, out = c.dim, ffn_dim(c), c.patch_size**2 * out_channels(c)
    total = (c.in_channels * c.patch_size**2 + 1) * d  # patch projection
    total += (FREQ_DIM + 1) * d + (d + 1) * d  # timestep MLP
    total += (c.n_classes + 1) * d if c.n_classes else 0  # class table with its null row
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 6 * (d * d + d)
    if c.text_dim:
        block += 2 * (d * d + d) + 2 * (c.text_dim * d + d)
    return total + c.n_layers * block + 2 * (d * d + d) + (d + 1) * out


def dit_macs(c, text_len: int = 0) -> tuple[int, int]:
    """Forward multiply-adds of one sample: (every Linear at its rows: image tokens, text tokens,
    or once per sample for the conditioning path and the adaLN modulations; the attention score
    and value matmuls, full attention: nothing skipped)."""
    d, f, n, L = c.dim, ffn_dim(c), n_tokens(c), c.n_layers
    t = text_len if c.text_dim else 0
    per_token = (
        c.in_channels * c.patch_size**2 * d
        + L * (4 * d * d + 2 * d * f)
        + d * c.patch_size**2 * out_channels(c)
    )
    per_sample = FREQ_DIM * d + d * d + L * 6 * d * d + 2 * d * d
    linear = n * per_token + per_sample
    attn = 2 * L * d * n * n
    if t:
        linear += L * (
            n * 2 * d * d + t * 2 * c.text_dim * d
        )  # cross q, o per image token; k, v per text token
        attn += 2 * L * d * n * t
    return linear, attn


def dit_flops_per_sample(c, text_len: int = 0) -> int:
    """Training FLOPs of one sample: 3 forward costs (forward + backward) at 2 FLOPs per
    multiply-add (DiT-XL/2: 6 x 118.6 G, the paper's forward count)."""
    return 6 * sum(dit_macs(c, text_len))
