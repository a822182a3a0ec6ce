"""Validation and derived sizes of the vision fields of ModelConfig (family 'vlm').

Kept beside config.py, not in it, so the text families' config stays as it was; config.py calls
`check_vision` only for family 'vlm'. Nothing here imports config.py (it imports us).
"""

from __future__ import annotations


def default_mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's split of the head_dim / 2 rotary frequencies over (time, height, width):
    1/8 of the head dim to time, the rest halved (head_dim 128 -> 16, 24, 24)."""
    half = head_dim // 2
    t = head_dim // 8
    h = (half - t) // 2
    return (t, h, half - t - h)


def mrope_section(config) -> tuple[int, ...]:
    return (
        tuple(config.mrope_section)
        if config.mrope_section is not None
        else default_mrope_section(config.head_dim)
    )


def vision_ffn_dim(config) -> int:
    return 4 * config.vision_dim if config.vision_ffn_hidden is None else config.vision_ffn_hidden


def image_tokens(config) -> int:
    """Placeholder tokens one image takes in the text: (image_size / patch / merge)^2."""
    return (config.image_size // (config.patch_size * config.merge_size)) ** 2


def _int(config, name: str, minimum: int = 1) -> int:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ModelConfig.{name}={value!r} is invalid; use an integer >= {minimum}")
    return value


def check_vision(config) -> None:
    """One-line errors naming the field, the value and what would be valid."""
    for name in ("image_size", "patch_size", "vision_dim", "vision_layers", "vision_heads", "merge_size"):
        _int(config, name)
    if config.vision_ffn_hidden is not None:
        _int(config, "vision_ffn_hidden")
    _int(config, "image_token_id", 0)
    if config.image_token_id >= config.vocab_size:
        raise ValueError(
            f"ModelConfig.image_token_id={config.image_token_id} is outside the vocabulary "
            f"(vocab_size={config.vocab_size}); choose 0..{config.vocab_size - 1}"
        )
    cell = config.patch_size * config.merge_size
    if config.image_size % cell:
        raise ValueError(
            f"ModelConfig.image_size={config.image_size} is not a multiple of patch_size * merge_size"
            f" = {cell}; choose e.g. {max(cell, config.image_size // cell * cell)}"
        )
    if config.vision_dim % config.vision_heads or (config.vision_dim // config.vision_heads) % 4:
        raise ValueError(
            f"ModelConfig.vision_heads={config.vision_heads} with vision_dim={config.vision_dim} gives a "
            "head dim that is not a multiple of 4 (2D RoPE rotates height and width pairs); choose "
            "vision_heads so that vision_dim / vision_heads is a multiple of 4"
        )
    section = mrope_section(config)
    if (
        len(section) != 3
        or any(not isinstance(s, int) or s < 0 for s in section)
        or sum(section) != config.head_dim // 2
    ):
        raise ValueError(
            f"ModelConfig.mrope_section={config.mrope_section!r} is invalid; use three integers >= 0 "
            f"summing to head_dim / 2 = {config.head_dim // 2}, e.g. "
            f"{list(default_mrope_section(config.head_dim))}"
        )
    if image_tokens(config) >= config.max_seq_len:
        raise ValueError(
            f"ModelConfig.max_seq_len={config.max_seq_len} leaves no room for text after the "
            f"{image_tokens(config)} image tokens; raise max_seq_len or shrink image_size"
        )


def vision_params(config) -> int:
    """Parameters of the ViT and the projector (family 'vlm'), biases and LayerNorms included."""
    d, f, wide = config.vision_dim, vision_ffn_dim(config), config.vision_dim * config.merge_size**2
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # q, k, v, o (+ biases), MLP, 2 LayerNorms
    projector = 2 * d + wide * wide + wide + wide * config.dim + config.dim
    return 3 * config.patch_size**2 * d + config.vision_layers * block + projector


def vision_flops_per_image(config) -> int:
    """Training FLOPs (forward + backward) of the ViT and projector on one image: 6 per matmul
    parameter per patch (per merged token for the projector), plus 12 * layers * width * n^2
    for the full attention's score and value matmuls over n patches (as flops_per_token)."""
    d, f, wide = config.vision_dim, vision_ffn_dim(config), config.vision_dim * config.merge_size**2
    n = (config.image_size // config.patch_size) ** 2
    per_patch = 3 * config.patch_size**2 * d + config.vision_layers * (4 * d * d + 2 * d * f)
    projector = (wide * wide + wide * config.dim) * image_tokens(config)
    return 6 * (per_patch * n + projector) + 12 * config.vision_layers * d * n * n
