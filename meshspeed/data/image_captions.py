"""Image-caption records from a JSON-lines file, for a vision-language run (`data.path` a .jsonl):

    {"image": "images/0001.png", "caption": "a red square above a blue circle"}

one object per line; a relative image path is read from the file's directory. Images go through
Pillow (RGB, resized to the model's image_size, scaled to [-1, 1]); the records are
data/shapes.py's (placeholders first, the caption's bytes, its end token, labels on the caption
only). The last tenth of the lines (at least one) is held out, in file order.
"""

from __future__ import annotations

import json
import os

import numpy as np

from meshspeed.data.corpus import DataError
from meshspeed.data.shapes import _pack


def _image(path: str, size: int, where: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("image-caption data needs Pillow: pip install pillow") from None
    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: image {path!r} cannot be read ({e}); give a PNG or JPEG") from None
    return (np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0).transpose(2, 0, 1)


def load_caption_jsonl(
    path: str, image_size: int, n_image_tokens: int, image_token_id: int, seq_len: int | None = None
) -> tuple[dict, dict]:
    """(train, held-out) records of a JSON-lines image-caption file (see the module docstring)."""
    base = os.path.dirname(os.path.abspath(path))
    images, captions = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where} is not JSON ({e})") from None
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("image"), str)
                or not isinstance(row.get("caption"), str)
            ):
                raise DataError(f'{where}: each line needs {{"image": "path.png", "caption": "text"}}')
            images.append(_image(os.path.join(base, row["image"]), image_size, where))
            captions.append(row["caption"])
    if len(captions) < 2:
        raise DataError(
            f"{path} holds {len(captions)} image-caption lines; give at least 2 (one is held out)"
        )
    cut = len(captions) - max(1, len(captions) // 10)
    arr = np.stack(images)
    return (
        _pack(arr[:cut], captions[:cut], n_image_tokens, image_token_id, seq_len),
        _pack(arr[cut:], captions[cut:], n_image_tokens, image_token_id, seq_len),
    )
