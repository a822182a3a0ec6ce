"""Caption records from what data/images.py reads: a file written by `meshspeed data prepare
--images`, or the source it is prepared from (a directory with captions.jsonl or class folders,
an .npz), for a vision-language run's `data.path`.

The split is data/images.py's fixed one (a prepared file's own), so a directory and the file
prepared from it give the same records. Each image goes through image_captions.resize_rgb, the
resize a .jsonl's PNGs get; stored pixels are [-1, 1] floats of 8-bit images, so they are turned
back into those 8 bits first, exactly.

Captions: the source's own (captions.jsonl). A source with class labels only is captioned with
the class name ("cat" for DIR/cat/*.png), or "the digit 7" for scikit-learn's digits, the
built-in `data.path=digits` task's words, so a prepared digits file trains what that task does.
A source with neither is refused in one line.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from meshspeed.data.chat import read_jsonl
from meshspeed.data.corpus import DataError
from meshspeed.data.image_captions import (
    SHAPES_HELD_OUT,
    SHAPES_TRAIN,
    check_lengths,
    load_caption_jsonl,
    pack_rows,
    resize_rgb,
    scan_jsonl,
    text_sequence,
)
from meshspeed.data.images import CAPTIONS_FILE, decode_captions, image_source, prepared_text, to_uint8


def label_captions(labels: torch.Tensor, names: list[str], source: str, where: str) -> list[str]:
    """Captions of class-labelled images (module docstring); unlabelled ones are refused."""
    if bool((labels < 0).any()):
        raise DataError(
            f"data.path={where!r} holds images without captions or class labels, nothing to train a "
            f"caption on; prepare a directory with {CAPTIONS_FILE} or class folders, or give a .jsonl"
        )
    words = [names[k] if k < len(names) else str(k) for k in labels.tolist()]
    return [f"the digit {w}" for w in words] if source == "digits" else words


def _resized(images: torch.Tensor, size: int) -> np.ndarray:
    """[N, C, H, W] in [-1, 1] → [N, 3, size, size] float32 through Pillow."""
    from PIL import Image

    pixels = to_uint8(images).numpy()  # [N, H, W, C]
    out = [resize_rgb(Image.fromarray(p[..., 0] if p.shape[-1] == 1 else p), size) for p in pixels]
    return np.stack(out) if out else np.zeros((0, 3, size, size), dtype=np.float32)


def _captions(recs: dict, names: list[str], source: str, path: str) -> list[str]:
    if "captions_utf8" in recs:
        return decode_captions(recs["captions_utf8"])
    return label_captions(recs["labels"], names, source, path)


def load_source_captions(
    path: str, image_size: int, n_image_tokens: int, image_token_id: int, seq_len: int | None = None
) -> tuple[dict, dict]:
    """(train, held-out) caption records of a prepared file or a source data/images.py reads."""
    if os.path.isdir(path):
        check_caption_folder(path, n_image_tokens, image_token_id, seq_len)
    train, val, names, source = image_source(path)
    texts = [_captions(r, names, source, path) for r in (train, val)]
    args = (n_image_tokens, image_token_id)
    seqs = [[text_sequence("", c, *args) for c in part] for part in texts]
    _check_caption_lengths(texts[0] + texts[1], n_image_tokens, seq_len, path)
    if not seqs[0] or not seqs[1]:
        raise DataError(
            f"data.path={path!r} leaves {len(seqs[0])} training and {len(seqs[1])} held-out images; "
            "give at least 2 images (one is held out)"
        )
    return tuple(
        pack_rows(_resized(r["images"], image_size), s, seq_len)
        for r, s in zip((train, val), seqs, strict=True)
    )


def _check_caption_lengths(captions: list[str], n_image_tokens: int, seq_len: int | None, path: str) -> None:
    lengths = [n_image_tokens + len(c.encode("utf-8")) + 1 for c in captions]
    check_lengths(lengths, lambda k: f"data.path={path!r}: the caption {captions[k][:40]!r}", seq_len, path)


def check_caption_folder(path: str, n_image_tokens: int, image_token_id: int, seq_len: int | None) -> None:
    """A directory's captions.jsonl: captions only (data/images.py reads no other form), no other
    key, each image present, each record within seq_len."""
    captions = os.path.join(path, CAPTIONS_FILE)
    if not os.path.isfile(captions):
        return
    for n, row in read_jsonl(captions):
        if "caption" not in row:
            raise DataError(
                f"{captions} line {n}: a directory's {CAPTIONS_FILE} holds captions only "
                '({"image": "a.png", "caption": "..."}); give the .jsonl itself as data.path for '
                "questions and conversations"
            )
    _check_records(scan_jsonl(captions, n_image_tokens, image_token_id), seq_len, captions)


def _check_records(recs, seq_len: int | None, source: str) -> None:
    for where, image, _, _ in recs:
        if not os.path.isfile(image):
            raise DataError(
                f"{where}: image {image!r} does not exist; give a path relative to the .jsonl's "
                "directory (or absolute) of a PNG or JPEG"
            )
    check_lengths([len(r[2]) for r in recs], lambda k: recs[k][0], seq_len, source)


def check_caption_data(
    path: str, n_image_tokens: int, image_token_id: int, seq_len: int, limit: int | None = None
) -> None:
    """What a run plan checks of a vlm `data.path` before any worker starts, without opening an
    image: every record's form and keys, its image file's existence and its length against
    seq_len (a .jsonl: its first `limit` records; the loader checks the rest when it reads them)."""
    if path.endswith(".jsonl"):
        return _check_records(scan_jsonl(path, n_image_tokens, image_token_id, limit), seq_len, path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, CAPTIONS_FILE)):
            return check_caption_folder(path, n_image_tokens, image_token_id, seq_len)
        names = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        return _check_caption_lengths(names, n_image_tokens, seq_len, path)
    if path.endswith(".npz"):
        return None  # its labels have no names: the captions are the label numbers, short
    captions, labels, names, source = prepared_text(path)
    if captions is None:
        return _check_caption_lengths(
            label_captions(labels, names, source, path), n_image_tokens, seq_len, path
        )
    lengths = (captions != 0).sum(1) + n_image_tokens + 1  # UTF-8 holds no NUL: each text's bytes

    def where(k: int) -> str:
        return f"data.path={path!r}: the caption {decode_captions(captions[k : k + 1])[0][:40]!r}"

    return check_lengths(lengths, where, seq_len, path)


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
    except ValueError as e:  # e.g. a caption longer than train.seq_len leaves room for
        raise DataError(f"data.path={path or 'shapes'!r}: {e} (train.seq_len={seq_len})") from None
    if path.endswith(".jsonl"):
        return load_caption_jsonl(path, **kw)[int(not train)]
    return load_source_captions(path, **kw)[int(not train)]
