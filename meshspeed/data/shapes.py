"""Built-in image-captioning tasks, generated without a download: coloured shapes, and the
scikit-learn digits. Deterministic from a seed; the records are a batch dict:

    {"images": [N, 3, H, W] float32 in [-1, 1],
     "tokens": [N, S] int64   n_image_tokens placeholders, then the caption's bytes, EOT, padding,
     "labels": [N, S] int64   the next token where it is a caption byte or the EOT, else -100}

So the loss and the exact-match count only the caption (the placeholders, the padding and the
position before the first placeholder carry -100), and the position of the last placeholder
predicts the caption's first byte: without the image it can only guess. Captions are bytes (the
byte tokenizer, data/tokenizer.py); the placeholder id defaults to 255, which no ASCII byte is.
The caller passes n_image_tokens (models/vlm_config.image_tokens): data/ does not import models/.

Shapes: two objects, "<colour> <shape> <relation> <colour> <shape>", e.g. "red square above
blue circle" (the first word's chance is 1/4, a whole caption's 1/288). Digits: sklearn's 8 x 8
digits scaled up, "the digit 7" (chance 1/10); held out: the last fifth of the 1797 images.
"""

from __future__ import annotations

import numpy as np
import torch

COLOURS = {
    "red": (1.0, -1.0, -1.0),
    "green": (-1.0, 1.0, -1.0),
    "blue": (-1.0, -1.0, 1.0),
    "yellow": (1.0, 1.0, -1.0),
}
SHAPES = ("square", "circle", "triangle")
RELATIONS = ("above", "left of")
EOT = 0  # ByteTokenizer.eot: ends the caption (and pads)
IMAGE_TOKEN_ID = 255
DIGITS_HELD_OUT_FROM = 1437  # the last fifth of load_digits()'s 1797 images


def _mask(shape: str, size: int, image_size: int, cy: int, cx: int) -> np.ndarray:
    """[H, W] bool: a filled `shape` of side `size` centred at (cy, cx)."""
    y, x = np.mgrid[0:image_size, 0:image_size]
    r = size / 2
    if shape == "square":
        return (np.abs(y - cy) <= r - 0.5) & (np.abs(x - cx) <= r - 0.5)
    if shape == "circle":
        return (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    # triangle pointing up: width grows linearly from the apex row to the base row
    top, bottom = cy - r, cy + r
    half = (y - top) / (bottom - top) * r
    return (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half)


def pack_captions(
    images: np.ndarray, captions: list[str], n_image_tokens: int, image_token_id: int, seq_len: int | None
) -> dict[str, torch.Tensor]:
    texts = [c.encode("utf-8") for c in captions]
    need = n_image_tokens + max(len(t) for t in texts) + 1  # placeholders, caption, EOT
    seq = need if seq_len is None else seq_len
    if seq < need:
        raise ValueError(f"seq_len={seq_len} is too short: the longest record needs {need} tokens")
    tokens = np.full((len(texts), seq), EOT, dtype=np.int64)
    labels = np.full((len(texts), seq), -100, dtype=np.int64)
    tokens[:, :n_image_tokens] = image_token_id
    for i, t in enumerate(texts):
        end = n_image_tokens + len(t)
        tokens[i, n_image_tokens:end] = np.frombuffer(t, dtype=np.uint8)
        # position p predicts token p + 1: from the last placeholder up to the caption's last byte
        labels[i, n_image_tokens - 1 : end] = tokens[i, n_image_tokens : end + 1]
    return {
        "images": torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)),
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
    }


def shape_captions(n: int, seed: int = 0, image_size: int = 32) -> tuple[np.ndarray, list[str]]:
    """n images [n, 3, H, W] in [-1, 1] (black background) and their captions."""
    if image_size < 16:
        raise ValueError(f"image_size={image_size} is too small for two shapes; use 16 or more")
    rng = np.random.default_rng(seed)
    names, shapes = list(COLOURS), list(SHAPES)
    size = max(5, int(image_size * 0.375))  # 12 px at 32: big enough that corners tell the shapes apart
    lo, hi = size // 2 + 1, image_size - size // 2 - 1  # centres keep the whole shape inside
    images = np.full((n, 3, image_size, image_size), -1.0, dtype=np.float32)
    captions = []
    for i in range(n):
        colour = rng.integers(len(names), size=2)
        shape = rng.integers(len(shapes), size=2)
        relation = RELATIONS[rng.integers(len(RELATIONS))]
        # The first object in the top (above) or left (left of) half, the second in the other,
        # both near one column (above) or row (left of): otherwise "red square above blue
        # circle" could also be "... left of ...", and no image would settle it.
        near = rng.integers(lo, image_size // 2 - size // 2 + 1, size=2)
        far = image_size - 1 - rng.integers(lo, image_size // 2 - size // 2 + 1, size=2)
        across = np.clip(rng.integers(lo, hi + 1) + rng.integers(-2, 3, size=2), lo, hi)
        for k, along in enumerate((near[0], far[1])):
            cy, cx = (along, across[k]) if relation == "above" else (across[k], along)
            m = _mask(shapes[shape[k]], size, image_size, cy, cx)
            images[i][:, m] = np.array(COLOURS[names[colour[k]]], dtype=np.float32)[:, None]
        captions.append(
            f"{names[colour[0]]} {shapes[shape[0]]} {relation} {names[colour[1]]} {shapes[shape[1]]}"
        )
    return images, captions


def shapes_task(
    n: int,
    seed: int = 0,
    image_size: int = 32,
    n_image_tokens: int = 16,
    image_token_id: int = IMAGE_TOKEN_ID,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """n shape-captioning records from `seed` (a held-out split: another seed)."""
    images, captions = shape_captions(n, seed, image_size)
    return pack_captions(images, captions, n_image_tokens, image_token_id, seq_len)


def digits_task(
    split: str = "train",
    image_size: int = 32,
    n_image_tokens: int = 16,
    image_token_id: int = IMAGE_TOKEN_ID,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """scikit-learn's digits (shipped with it, no download) as "the digit 7" records; split
    'train' (the first 1437) or 'heldout' (the last 360)."""
    from sklearn.datasets import load_digits

    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} is invalid; choose 'train' or 'heldout'")
    if image_size % 8:
        raise ValueError(f"image_size={image_size} is not a multiple of 8 (the digits are 8 x 8)")
    digits = load_digits()
    part = slice(0, DIGITS_HELD_OUT_FROM) if split == "train" else slice(DIGITS_HELD_OUT_FROM, None)
    pixels, target = digits.images[part], digits.target[part]  # [n, 8, 8] in 0..16
    scale = image_size // 8
    grey = np.kron(pixels, np.ones((scale, scale))) / 8.0 - 1.0  # nearest-neighbour upscale
    images = np.repeat(grey[:, None], 3, axis=1)
    return pack_captions(images, [f"the digit {d}" for d in target], n_image_tokens, image_token_id, seq_len)


def caption_of(tokens: torch.Tensor, image_token_id: int = IMAGE_TOKEN_ID) -> str:
    """The caption of one record's tokens [S]: the bytes after the placeholders, up to EOT."""
    text = [t for t in tokens.tolist() if t != image_token_id]
    return bytes(text[: text.index(EOT)] if EOT in text else text).decode("utf-8", errors="replace")
