"""The image-caption records of a vision-language run's `data.path`:

- empty or "shapes": the built-in shapes captions (data/shapes.py: 8,000 training records from
  seed 0, 500 held out from seed 1); "digits": scikit-learn's digits, "the digit 7";
- a JSON-lines file (`.jsonl`), one object per line, one of

    {"image": "images/0001.png", "caption": "a red square above a blue circle"}
    {"image": "images/0002.png", "question": "what is above? ", "answer": "a red square"}
    {"image": "images/0003.png", "messages": [{"role": "user", "content": "<image>What is left?"},
                                              {"role": "assistant", "content": "a red square"}]}

  a relative image path read from the file's directory; the last tenth of the lines (at least
  one) held out, in file order;
- a file written by `meshspeed data prepare --images`, or the directory it was prepared from
  (captions.jsonl, or class folders), any source data/images.py reads: their fixed held-out split
  (data/image_sources.py).

Images go through Pillow (RGB, resized to the model's image_size, scaled to [-1, 1]). A caption's
record is data/shapes.py's (placeholders first, the caption's bytes, its end token, labels on the
caption only); a question's: the placeholders, the question's bytes, the answer's and its end
token, labels on the answer only; a conversation's: the byte tokenizer's chat template with the
placeholders where `<image>` stands, labels on the assistant turns (data/image_chat.py). A record
longer than train.seq_len is refused naming its line, never cut.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from meshspeed.data.chat import read_jsonl, shifted_labels
from meshspeed.data.corpus import DataError
from meshspeed.data.image_chat import conversation_sequence
from meshspeed.data.shapes import EOT

SHAPES_TRAIN, SHAPES_HELD_OUT = 8000, 500  # the built-in shapes: training (seed 0), held out (seed 1)
BUILT_IN = ("", "shapes", "digits")
FORMS = (("image", "caption"), ("image", "question", "answer"), ("image", "messages"))
LINE_FORMS = (
    '{"image": "a.png", "caption": "..."}, {"image": "a.png", "question": "...", "answer": "..."} or '
    '{"image": "a.png", "messages": [{"role": "user", "content": "<image>..."}, '
    '{"role": "assistant", "content": "..."}]}'
)


def read_rgb(path: str, size: int, where: str) -> np.ndarray:
    """[3, size, size] float32 in [-1, 1] from an image file through Pillow (RGB, resized): what
    training records and `generate --image` both feed the model. `where` names the input."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"{where}: images need Pillow: pip install pillow") from None
    try:
        with Image.open(path) as im:
            return resize_rgb(im, size)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: {path!r} cannot be read as an image ({e}); give a PNG or JPEG") from None


def resize_rgb(im, size: int) -> np.ndarray:
    """A Pillow image → [3, size, size] float32 in [-1, 1] (RGB, bilinear): the one resize every
    source of vlm records goes through, so a PNG read from a .jsonl and the same image read from
    a prepared file are the same pixels."""
    from PIL import Image

    rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
    return (np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0).transpose(2, 0, 1)


def text_sequence(prompt: str, answer: str, n_image_tokens: int, image_token_id: int):
    """(ids, labels) of a caption (empty prompt) or a question and its answer: the placeholders,
    the prompt's bytes, the answer's, the end token; labels on the answer and its end only."""
    p, a = prompt.encode("utf-8"), answer.encode("utf-8")
    ids = [image_token_id] * n_image_tokens + list(p) + list(a) + [EOT]
    return ids, shifted_labels(ids, [False] * (n_image_tokens + len(p)) + [True] * (len(a) + 1))


def line_sequence(row: dict, where: str, n_image_tokens: int, image_token_id: int):
    """(image path as written, ids, labels) of one .jsonl record; a record that is none of the
    three forms, or holds another key, is one line naming `where` and the forms."""
    form = next((f for f in FORMS if f[1] in row), None)
    unknown = sorted(set(row) - set(form or ("image",)))
    if form is None or unknown or any(k not in row for k in form):
        what = f"unknown key(s) {unknown}" if form and unknown else f"keys {sorted(row)[:6]}"
        raise DataError(f"{where}: {what}; each line is one of {LINE_FORMS}")
    if not isinstance(row["image"], str) or not row["image"]:
        raise DataError(f'{where}: "image" must be an image file\'s path (a string); {LINE_FORMS}')
    if form[1] == "messages":
        ids, labels = conversation_sequence(row["messages"], where, n_image_tokens, image_token_id)
    else:
        texts = [row[k] for k in form[1:]]
        if not all(isinstance(t, str) for t in texts):
            raise DataError(f"{where}: {' and '.join(repr(k) for k in form[1:])} must be strings")
        prompt, answer = ("", texts[0]) if form[1] == "caption" else texts
        ids, labels = text_sequence(prompt, answer, n_image_tokens, image_token_id)
    if ids.count(image_token_id) != n_image_tokens:  # a text byte equal to the placeholder id
        raise DataError(
            f"{where}: the text holds byte {image_token_id}, the model's image_token_id, which would "
            "read as part of the image; remove it"
        )
    return row["image"], ids, labels


def scan_jsonl(path: str, n_image_tokens: int, image_token_id: int, limit: int | None = None):
    """[(where, image path, ids, labels)] of the first `limit` records (all: None) of a .jsonl,
    each parsed and rendered (no image is opened)."""
    base = os.path.dirname(os.path.abspath(path))
    out = []
    for n, row in read_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        where = f"{path} line {n}"
        image, ids, labels = line_sequence(row, where, n_image_tokens, image_token_id)
        out.append((where, os.path.join(base, image), ids, labels))
    return out


def check_lengths(lengths, where_of, seq_len: int | None, source: str) -> None:
    """The first record longer than seq_len, in one line naming it (`where_of(index)`) and the
    seq_len that fits every record of `source`. lengths: a list or a 1-D tensor."""
    lengths = torch.as_tensor(lengths)
    if seq_len is None or not len(lengths) or int(lengths.max()) <= seq_len:
        return
    k = int((lengths > seq_len).nonzero()[0])
    raise DataError(
        f"{where_of(k)}: the record takes {int(lengths[k])} tokens (image placeholders, text, end), "
        f"more than train.seq_len={seq_len}; use train.seq_len={int(lengths.max())} (the longest of "
        f"{source}) or shorten it"
    )


def pack_rows(images, seqs: list[tuple[list[int], list[int]]], seq_len: int | None) -> dict:
    """Batch dict of records: images [N, 3, H, W], tokens and labels [N, seq_len] (padding: the
    end token, labels -100). seq_len None: the longest record's length."""
    seq = seq_len or max(len(ids) for ids, _ in seqs)
    tokens = torch.full((len(seqs), seq), EOT, dtype=torch.int64)
    labels = torch.full((len(seqs), seq), -100, dtype=torch.int64)
    for i, (ids, lab) in enumerate(seqs):
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        labels[i, : len(lab)] = torch.tensor(lab, dtype=torch.int64)
    return {
        "images": torch.as_tensor(np.ascontiguousarray(images, dtype=np.float32)),
        "tokens": tokens,
        "labels": labels,
    }


def load_caption_jsonl(
    path: str, image_size: int, n_image_tokens: int, image_token_id: int, seq_len: int | None = None
) -> tuple[dict, dict]:
    """(train, held-out) records of a JSON-lines file of captions, questions or conversations about
    images (see the module docstring)."""
    recs = scan_jsonl(path, n_image_tokens, image_token_id)
    if len(recs) < 2:
        raise DataError(f"{path} holds {len(recs)} image lines; give at least 2 (one is held out)")
    check_lengths([len(r[2]) for r in recs], lambda k: recs[k][0], seq_len, path)
    images = np.stack([read_rgb(image, image_size, where) for where, image, _, _ in recs])
    seqs = [(ids, labels) for _, _, ids, labels in recs]
    cut = len(recs) - max(1, len(recs) // 10)
    return pack_rows(images[:cut], seqs[:cut], seq_len), pack_rows(images[cut:], seqs[cut:], seq_len)
