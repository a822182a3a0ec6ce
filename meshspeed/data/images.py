"""Images with class labels or captions, as record tensors a diffusion trainer splits like tokens.

Sources (`load_image_records(spec)`):
- "digits": scikit-learn's 1,797 8 × 8 digits (values 0..16), inside the wheel, no download;
- a directory of class folders `DIR/<label>/*.png|jpg` (labels: the sorted folder names), or a
  directory holding `captions.jsonl` (`{"image": path relative to DIR, "caption": text}` a line);
- an array file `.npz` with `images` ([N,H,W], [N,H,W,C] or [N,C,H,W]) and optional `labels`;
- a file written by `meshspeed data prepare --images` (safetensors; see prepare_images).

Records: {"images": [N,C,H,W] float32 in [-1, 1], "labels": [N] int64 (-1: none)} and, for
captions, "captions_utf8": [N, L] uint8 (zero-padded UTF-8, one row per image, so the loader's
row split carries captions with their images; decode_captions reads them back). Everything is
a tensor of N rows: nothing here is pickled, and the split is the same for every key.

The held-out split is fixed: a permutation from a constant seed (not the run's), so every run,
layout and `prepare` of the same source validates on the same images.
"""

from __future__ import annotations

import json
import math
import os

import torch

from meshspeed.data.corpus import DataError

VAL_FRACTION = 0.1  # digits: 180 of 1,797 held out, enough for a classifier accuracy to 2 points
SPLIT_SEED = 1234  # the split's own seed: changing the run seed must not move the held-out set
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CAPTIONS_FILE = "captions.jsonl"
FORMAT = "meshspeed-images-1"  # the prepared file's metadata "format"
WHAT_WORKS = (
    "give 'digits', a directory of class folders (DIR/<label>/*.png) or with captions.jsonl, "
    "an .npz with 'images' (and 'labels'), or a file from `meshspeed data prepare --images`"
)


def _digits() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    from sklearn.datasets import load_digits  # here: scikit-learn costs ~1 s to import

    d = load_digits()
    # 0..16 → [-1, 1]; the 17 levels map exactly (x / 8 − 1)
    x = torch.from_numpy(d.images).float().div(8.0).sub(1.0).unsqueeze(1)  # [1797, 1, 8, 8]
    return x, torch.from_numpy(d.target).long(), [str(i) for i in range(10)]


def _to_unit(x: torch.Tensor, path: str) -> torch.Tensor:
    """Pixel values → [-1, 1] float32: integers are 0..255; floats in [0, 1] are scaled,
    floats already in [-1, 1] kept (what a model's own samples are)."""
    if not x.is_floating_point():
        if x.min() < 0 or x.max() > 255:
            raise DataError(f"{path!r}: integer pixels must lie in 0..255; save uint8 images")
        return x.float().div(127.5).sub(1.0)
    x = x.float()
    if not torch.isfinite(x).all():
        raise DataError(f"{path!r}: pixels hold NaN or inf; save finite values in [0, 1] or 0..255")
    lo, hi = x.min().item(), x.max().item()
    if lo >= 0 and hi <= 1:
        return x.mul(2.0).sub(1.0)
    if lo >= -1 and hi <= 1:
        return x
    raise DataError(f"{path!r}: float pixels span [{lo:g}, {hi:g}]; save them in [0, 1] or uint8 0..255")


def _read_image(path: str) -> torch.Tensor:
    """One image file → [C, H, W] uint8 (C = 1 for grey, 3 for colour; alpha dropped)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("L") if im.mode in ("1", "L", "I", "I;16", "F") else im.convert("RGB")
            data = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            w, h = im.size
            c = 1 if im.mode == "L" else 3
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(
            f"{path!r} cannot be read as an image ({type(e).__name__}); give PNG or JPEG files"
        ) from None
    return data.view(h, w, c).permute(2, 0, 1).contiguous()


def _stack(images: list[torch.Tensor], paths: list[str], where: str) -> torch.Tensor:
    """[C,H,W] uint8 images → [N,C,H,W] in [-1, 1]; grey is widened to RGB when any is colour,
    a size differing from the first image's is refused naming both files."""
    h, w = images[0].shape[1:]
    for im, p in zip(images, paths, strict=True):
        if im.shape[1:] != (h, w):
            raise DataError(
                f"{where}: {p!r} is {im.shape[2]}×{im.shape[1]} but {paths[0]!r} is {w}×{h}; "
                "resize every image to one size"
            )
    c = max(im.shape[0] for im in images)
    return _to_unit(torch.stack([im.expand(c, h, w) for im in images]), where)


def _encode_captions(captions: list[str]) -> torch.Tensor:
    raw = [c.encode() for c in captions]
    out = torch.zeros(len(raw), max(1, max(map(len, raw))), dtype=torch.uint8)
    for i, b in enumerate(raw):
        if b:  # frombuffer refuses an empty buffer
            out[i, : len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return out


def decode_captions(t: torch.Tensor) -> list[str]:
    """captions_utf8 rows → strings (the zero padding dropped)."""
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in t]


def _folder(root: str) -> tuple[dict, list[str]]:
    captions = os.path.join(root, CAPTIONS_FILE)
    if os.path.isfile(captions):
        paths, texts = [], []
        with open(captions, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    paths.append(os.path.join(root, rec["image"]))
                    texts.append(str(rec["caption"]))
                except (ValueError, KeyError, TypeError):
                    raise DataError(
                        f"{captions!r} line {n}: not a JSON object with 'image' and 'caption'; write "
                        '{"image": "a.png", "caption": "..."} per line'
                    ) from None
        if not paths:
            raise DataError(f"{captions!r} lists no images; write one JSON line per image")
        images = _stack([_read_image(p) for p in paths], paths, root)
        labels = torch.full((len(paths),), -1, dtype=torch.long)
        return {"images": images, "labels": labels, "captions_utf8": _encode_captions(texts)}, []
    classes = sorted(
        d for d in os.listdir(root) if not d.startswith(".") and os.path.isdir(os.path.join(root, d))
    )
    paths, labels = [], []
    for k, name in enumerate(classes):
        files = sorted(
            f for f in os.listdir(os.path.join(root, name))
            if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith(".")
        )  # fmt: skip
        paths += [os.path.join(root, name, f) for f in files]
        labels += [k] * len(files)
    if not paths:
        raise DataError(f"{root!r} holds no images in class folders; {WHAT_WORKS}")
    images = _stack([_read_image(p) for p in paths], paths, root)
    return {"images": images, "labels": torch.tensor(labels, dtype=torch.long)}, classes


def _npz(path: str) -> tuple[dict, list[str]]:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:  # object arrays would need pickle: refused
            if "images" not in f:
                raise DataError(f"{path!r} has no 'images' array (it has {sorted(f.files)}); {WHAT_WORKS}")
            x = torch.from_numpy(np.ascontiguousarray(f["images"]))
            y = torch.from_numpy(np.asarray(f["labels"])).long() if "labels" in f else None
    except (OSError, ValueError) as e:
        raise DataError(f"{path!r} cannot be read as an .npz array file ({e}); {WHAT_WORKS}") from None
    if x.dim() == 3:
        x = x.unsqueeze(1)
    elif x.dim() == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.permute(0, 3, 1, 2)  # channels last → [N, C, H, W]
    if x.dim() != 4 or x.shape[0] == 0:
        raise DataError(f"{path!r}: 'images' has shape {list(x.shape)}; save [N,H,W], [N,H,W,C] or [N,C,H,W]")
    y = torch.full((x.shape[0],), -1, dtype=torch.long) if y is None else y.reshape(-1)
    if y.numel() != x.shape[0]:
        raise DataError(f"{path!r}: {y.numel()} labels for {x.shape[0]} images; save one label per image")
    return {"images": _to_unit(x.contiguous(), path), "labels": y}, []


def split(records: dict, val_fraction: float = VAL_FRACTION) -> tuple[dict, dict]:
    """(train, val): the last ⌈val_fraction·N⌉ of a fixed permutation validate (at least one
    image and never all of them, when N ≥ 2)."""
    n = records["images"].shape[0]
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction!r} must be in [0, 1), e.g. {VAL_FRACTION}")
    k = 0 if val_fraction == 0 or n < 2 else min(n - 1, max(1, math.ceil(val_fraction * n)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, val = perm[: n - k].sort().values, perm[n - k :].sort().values  # source order kept
    return {k_: v[train] for k_, v in records.items()}, {k_: v[val] for k_, v in records.items()}


def read_images(spec: str, setting: str = "images") -> tuple[dict, list[str]]:
    """All records of a source (before the split) and its class names ([] when unnamed).
    `setting`: the flag or key errors name (--images, data.path)."""
    if spec == "digits":
        x, y, names = _digits()
        return {"images": x, "labels": y}, names
    if not os.path.exists(spec):
        raise DataError(f"{setting}={spec!r} does not exist; {WHAT_WORKS}")
    if os.path.isdir(spec):
        return _folder(spec)
    if spec.endswith(".npz"):
        return _npz(spec)
    records, names, _, _ = _read_prepared(spec)
    return records, names


def load_image_records(
    spec: str, val_fraction: float = VAL_FRACTION, setting: str = "data.path"
) -> tuple[dict, dict]:
    """(train, val) records of `spec`: "digits", a directory, an .npz or a prepared file. A
    prepared file keeps the split it was written with (val_fraction is not applied again)."""
    return image_source(spec, val_fraction, setting)[:2]


def image_source(
    spec: str, val_fraction: float = VAL_FRACTION, setting: str = "data.path"
) -> tuple[dict, dict, list[str], str]:
    """(train, val, class names, source): load_image_records' splits, the class names ([] when
    unnamed) and what the images came from (a prepared file: the source it was prepared from)."""
    if os.path.isfile(spec) and not spec.endswith(".npz"):
        recs, names, n_val, source = _read_prepared(spec)
        n = recs["images"].shape[0]
        train = {k: v[: n - n_val] for k, v in recs.items()}
        return train, {k: v[n - n_val :] for k, v in recs.items()}, names, source
    records, names = read_images(spec, setting)
    return (*split(records, val_fraction), names, spec)


def prepared_text(path: str) -> tuple[torch.Tensor | None, torch.Tensor, list[str], str]:
    """(captions_utf8 or None, labels, class names, source) of a prepared file, its images left
    unread: what a run plan can afford to check of a large file."""
    recs, names, _, source = _read_prepared(path, ("captions_utf8", "labels"))
    return recs.get("captions_utf8"), recs["labels"], names, source


def _read_prepared(path: str, keys=None) -> tuple[dict, list[str], int, str]:
    """(records, class names, held-out count, source) of a file prepare_images wrote; `keys`:
    only those tensors (None: all)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            stored = list(f.keys())  # noqa: SIM118 - safe_open has no iter
            tensors = {k: f.get_tensor(k) for k in stored if keys is None or k in keys}
    except (OSError, SafetensorError) as e:
        raise DataError(f"{path!r} is not a prepared image file ({type(e).__name__}); {WHAT_WORKS}") from None
    if meta.get("format") != FORMAT or "images" not in stored:
        raise DataError(f"{path!r} was not written by `meshspeed data prepare --images`; {WHAT_WORKS}")
    names = json.loads(meta.get("class_names", "[]"))
    return tensors, names, int(meta.get("n_val", 0)), meta.get("source", path)


def prepare_images(spec: str, out: str, val_fraction: float = VAL_FRACTION, overwrite: bool = False) -> dict:
    """Write `spec`'s records to `out` (safetensors: train rows first, then the held-out ones,
    the count in the metadata) and return a summary. Written to a temporary name, then renamed."""
    from safetensors.torch import save_file

    if not out:
        raise DataError("--out is required: the image file to write, e.g. data/digits.safetensors")
    if os.path.isdir(out):
        raise DataError(f"--out={out!r} is a directory; name a file to write")
    if os.path.exists(out) and not overwrite:
        try:
            _read_prepared(out, ())  # the header alone says whether prepare wrote it
        except DataError:
            raise DataError(
                f"--out={out!r} exists and was not written by `meshspeed data prepare --images`; "
                "choose another path or pass --overwrite"
            ) from None
    records, names = read_images(spec, "--images")
    train, val = split(records, val_fraction)
    tensors = {k: torch.cat([train[k], val[k]]).contiguous() for k in records}
    meta = {
        "format": FORMAT,
        "source": spec,
        "n_val": str(val["images"].shape[0]),
        "class_names": json.dumps(names),
    }
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, out)
    n, c, h, w = records["images"].shape
    labels = records["labels"]
    return {
        "images": n, "channels": c, "height": h, "width": w, "val": int(meta["n_val"]),
        "classes": int(labels.max().item()) + 1 if (labels >= 0).any() else 0,
        "class_names": names, "captions": "captions_utf8" in records,
    }  # fmt: skip


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] float → [N, H, W, C] uint8, rounded the same way everywhere (PNG bytes depend on it)."""
    return images.detach().float().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8).permute(0, 2, 3, 1)


def save_png(image_hwc: torch.Tensor, path) -> None:
    """One [H, W, C] uint8 image as PNG (grey for C = 1) to a path or a binary file object."""
    from PIL import Image

    arr = image_hwc.cpu().numpy()
    Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr).save(path, format="PNG")


def grid(images: torch.Tensor, cols: int | None = None, pad: int = 1, scale: int = 1) -> torch.Tensor:
    """[N, C, H, W] in [-1, 1] → one [H', W', C] uint8 image, row-major, `pad` pixels of black
    between tiles, each pixel repeated `scale` times (8 × 8 digits are unreadable at 1×)."""
    n, c, h, w = images.shape
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    tiles = to_uint8(images)
    if scale > 1:
        tiles = tiles.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
        h, w = h * scale, w * scale
    out = torch.zeros(rows * (h + pad) + pad, cols * (w + pad) + pad, c, dtype=torch.uint8)
    for i in range(n):
        r, q = divmod(i, cols)
        top, left = pad + r * (h + pad), pad + q * (w + pad)
        out[top : top + h, left : left + w] = tiles[i]
    return out
