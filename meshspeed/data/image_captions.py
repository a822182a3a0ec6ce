"""The image-caption records of a vision-language run's `data.path`: empty or "shapes" (the
built-in shapes captions, data/shapes.py: 8,000 training records from seed 0, 500 held out from
seed 1), "digits" (scikit-learn's digits, "the digit 7"), or a JSON-lines file:

    {"image": "images/0001.png", "caption": "a red square above a blue circle"}
    {"image": "images/0002.png", "question": "what is above? ", "answer": "a red square"}

one object per line; a relative image path is read from the file's directory. Images go through
Pillow (RGB, resized to the model's image_size, scaled to [-1, 1]). A caption's record is
data/shapes.py's (placeholders first, the caption's bytes, its end token, labels on the caption
only); a question's: the placeholders, the question's bytes, the answer's and its end token,
labels on the answer only. The last tenth of the lines (at least one) is held out, in file order.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import torch

from meshspeed.data.corpus import DataError
from meshspeed.data.shapes import EOT

SHAPES_TRAIN, SHAPES_HELD_OUT = 8000, 500  # the built-in shapes: training (seed 0), held out (seed 1)


def read_rgb(path: str, size: int, where: str) -> np.ndarray:
    """[3, size, size] float32 in [-1, 1] from an image file through Pillow (RGB, resized): what
    training records and `generate --image` both feed the model. `where` names the input."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"{where}: images need Pillow: pip install pillow") from None
    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: {path!r} cannot be read as an image ({e}); give a PNG or JPEG") from None
    return (np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0).transpose(2, 0, 1)


def pack_answers(
    images: np.ndarray,
    prompts: list[str],
    answers: list[str],
    n_image_tokens: int,
    image_token_id: int,
    seq_len: int | None,
) -> dict:
    """Records of (image, prompt, answer): the placeholders, the prompt's bytes, the answer's, the
    end token, padding; labels on the answer and its end only (an empty prompt: a caption, the
    records data/shapes.pack_captions writes)."""
    pairs = [(p.encode("utf-8"), a.encode("utf-8")) for p, a in zip(prompts, answers, strict=True)]
    need = n_image_tokens + max(len(p) + len(a) for p, a in pairs) + 1
    seq = need if seq_len is None else seq_len
    if seq < need:
        raise ValueError(f"seq_len={seq_len} is too short: the longest record needs {need} tokens")
    tokens = np.full((len(pairs), seq), EOT, dtype=np.int64)
    labels = np.full((len(pairs), seq), -100, dtype=np.int64)
    tokens[:, :n_image_tokens] = image_token_id
    for i, (p, a) in enumerate(pairs):
        start = n_image_tokens + len(p)  # the answer's first token
        tokens[i, n_image_tokens:start] = np.frombuffer(p, dtype=np.uint8)
        tokens[i, start : start + len(a)] = np.frombuffer(a, dtype=np.uint8)
        labels[i, start - 1 : start + len(a)] = tokens[i, start : start + len(a) + 1]  # ... and EOT
    return {
        "images": torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)),
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
    }


def load_caption_jsonl(
    path: str, image_size: int, n_image_tokens: int, image_token_id: int, seq_len: int | None = None
) -> tuple[dict, dict]:
    """(train, held-out) records of a JSON-lines file of captions or questions about images (see
    the module docstring)."""
    base = os.path.dirname(os.path.abspath(path))
    images, prompts, answers = [], [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where} is not JSON ({e})") from None
            row = row if isinstance(row, dict) else {}
            prompt, answer = (
                ("", row.get("caption")) if "caption" in row else (row.get("question"), row.get("answer"))
            )
            if (
                not isinstance(row.get("image"), str)
                or not isinstance(prompt, str)
                or not isinstance(answer, str)
            ):
                raise DataError(
                    f'{where}: each line needs {{"image": "path.png", "caption": "text"}} or '
                    '{"image": "path.png", "question": "text", "answer": "text"}'
                )
            images.append(read_rgb(os.path.join(base, row["image"]), image_size, where))
            prompts.append(prompt)
            answers.append(answer)
    if len(answers) < 2:
        raise DataError(f"{path} holds {len(answers)} image lines; give at least 2 (one is held out)")
    cut = len(answers) - max(1, len(answers) // 10)
    arr, args = np.stack(images), (n_image_tokens, image_token_id, seq_len)
    return (
        pack_answers(arr[:cut], prompts[:cut], answers[:cut], *args),
        pack_answers(arr[cut:], prompts[cut:], answers[cut:], *args),
    )


def caption_splits(
    path: str, image_size: int, n_img: int, token_id: int, seq_len: int, splits=("train", "val")
):
    """The `splits` records ("train", "val": held out) of `data.path` (see the module docstring)."""
    return tuple(_split(path, image_size, n_img, token_id, seq_len, s) for s in splits)


@functools.lru_cache(maxsize=4)  # a pooled worker builds many trainers on the same records
def _split(path: str, image_size: int, n_img: int, token_id: int, seq_len: int, split: str) -> dict:
    from meshspeed.data import shapes

    kw = dict(image_size=image_size, n_image_tokens=n_img, image_token_id=token_id, seq_len=seq_len)
    train = split == "train"
    try:
        if path in ("", "shapes"):  # held out: another seed
            return shapes.shapes_task(SHAPES_TRAIN if train else SHAPES_HELD_OUT, seed=int(not train), **kw)
        if path == "digits":
            return shapes.digits_task("train" if train else "heldout", **kw)
        return load_caption_jsonl(path, **kw)[int(not train)]
    except ValueError as e:  # e.g. a caption longer than train.seq_len leaves room for
        raise DataError(f"data.path={path or 'shapes'!r}: {e} (train.seq_len={seq_len})") from None
