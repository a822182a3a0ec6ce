"""Image records: digits, class folders, captions, .npz and prepared files all give [N,C,H,W]
float32 in [-1, 1] with int64 labels and the same fixed held-out split; bad input is one line
naming the path and what would work; `meshspeed data prepare --images` round-trips exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshspeed.cli import main
from meshspeed.data.corpus import DataError
from meshspeed.data.images import decode_captions, grid, load_image_records, read_images, split


def _png(path, arr):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_digits_records_and_split():
    train, val = load_image_records("digits")
    assert train["images"].shape == (1617, 1, 8, 8) and val["images"].shape == (180, 1, 8, 8)
    assert train["images"].dtype == torch.float32 and train["labels"].dtype == torch.int64
    x = torch.cat([train["images"], val["images"]])
    assert x.min() == -1 and x.max() == 1
    # 0..16 maps to the 17 levels x/8 − 1 exactly
    assert torch.equal(torch.unique(x), torch.arange(17.0) / 8 - 1)
    # the split is a fixed partition of the 1,797 images, every class in the held-out part
    assert set(val["labels"].tolist()) == set(range(10))
    _, val2 = load_image_records("digits")
    assert torch.equal(val["images"], val2["images"])
    from sklearn.datasets import load_digits

    ref = torch.from_numpy(load_digits().images).float()
    assert torch.equal(torch.cat([train["images"], val["images"]]).sum(), ref.div(8).sub(1).sum())


def test_folder_classes_and_values(tmp_path):
    a = np.zeros((4, 5), np.uint8)
    b = np.full((4, 5), 255, np.uint8)
    _png(tmp_path / "cat" / "0.png", a)
    _png(tmp_path / "cat" / "1.png", b)
    _png(tmp_path / "dog" / "0.png", b)
    _png(tmp_path / "dog" / "1.jpg", b)  # JPEG too (white survives its compression exactly)
    (tmp_path / "dog" / "notes.txt").write_text("not an image, not read")
    recs, names = read_images(str(tmp_path))
    assert names == ["cat", "dog"] and recs["labels"].tolist() == [0, 0, 1, 1]
    assert recs["images"].shape == (4, 1, 4, 5)  # [N, C, H, W]: H=4 rows, W=5 columns
    assert recs["images"][0].max() == -1 and recs["images"][1].min() == 1 and recs["images"][3].min() == 1
    train, val = split(recs, 0.34)
    assert train["images"].shape[0] == 2 and val["images"].shape[0] == 2


def test_colour_and_grey_mix_to_rgb(tmp_path):
    _png(tmp_path / "a" / "0.png", np.zeros((3, 3), np.uint8))
    _png(tmp_path / "a" / "1.png", np.full((3, 3, 3), 255, np.uint8))
    recs, _ = read_images(str(tmp_path))
    assert recs["images"].shape == (2, 3, 3, 3)


def test_captions(tmp_path):
    _png(tmp_path / "x.png", np.zeros((2, 2, 3), np.uint8))
    _png(tmp_path / "y.png", np.full((2, 2, 3), 255, np.uint8))
    lines = [{"image": "x.png", "caption": "a black square"}, {"image": "y.png", "caption": "blanc é"}]
    (tmp_path / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    recs, _ = read_images(str(tmp_path))
    assert recs["labels"].tolist() == [-1, -1] and recs["images"].shape == (2, 3, 2, 2)
    assert decode_captions(recs["captions_utf8"]) == ["a black square", "blanc é"]


@pytest.mark.parametrize(
    "images,shape",
    [
        (np.zeros((6, 4, 4), np.uint8), (6, 1, 4, 4)),
        (np.zeros((6, 4, 4, 3), np.uint8), (6, 3, 4, 4)),
        (np.zeros((6, 3, 4, 4), np.float32) + 0.5, (6, 3, 4, 4)),
    ],
)
def test_npz(tmp_path, images, shape):
    p = str(tmp_path / "a.npz")
    np.savez(p, images=images, labels=np.arange(6))
    recs, _ = read_images(p)
    assert recs["images"].shape == shape and recs["labels"].tolist() == list(range(6))
    if images.dtype == np.float32:
        assert torch.allclose(recs["images"], torch.zeros(shape))  # [0, 1] floats: 0.5 → 0
    else:
        assert (recs["images"] == -1).all()


def _bad_cases(tmp_path):
    _png(tmp_path / "mixed" / "a" / "0.png", np.zeros((4, 4), np.uint8))
    _png(tmp_path / "mixed" / "a" / "1.png", np.zeros((4, 5), np.uint8))
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk" / "a").mkdir(parents=True)
    (tmp_path / "junk" / "a" / "0.png").write_bytes(b"not a png")
    np.savez(tmp_path / "nolab.npz", pixels=np.zeros((2, 2)))
    np.savez(tmp_path / "count.npz", images=np.zeros((3, 2, 2)), labels=np.zeros(2))
    (tmp_path / "rand.bin").write_bytes(b"\x00" * 30)
    return {
        "mixed": "resize every image to one size",
        "empty": "holds no images in class folders",
        "junk": "cannot be read as an image",
        "nolab.npz": "has no 'images' array",
        "count.npz": "2 labels for 3 images",
        "rand.bin": "is not a prepared image file",
        "missing": "does not exist",
    }


def test_bad_input_is_one_line_naming_the_path(tmp_path):
    for name, needle in _bad_cases(tmp_path).items():
        with pytest.raises(DataError) as e:
            load_image_records(str(tmp_path / name))
        msg = str(e.value)
        assert needle in msg and name in msg and "\n" not in msg, msg


def test_prepare_command_round_trip(tmp_path, capsys):
    out = str(tmp_path / "digits.safetensors")
    assert main(["data", "prepare", "--images", "digits", "--out", out]) == 0
    assert "1,797 images 1×8×8 (10 classes)" in capsys.readouterr().out
    got, want = load_image_records(out), load_image_records("digits")
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)
    # the file holds plain tensors: safetensors, no pickle anywhere
    assert open(out, "rb").read(8) != b"\x80\x04\x95" and b"meshspeed-images-1" in open(out, "rb").read(4096)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--images", "nowhere"], "--images='nowhere' does not exist"),
        (["--images", "digits", "--input", "x"], "--images and --input cannot be combined"),
        (["--images", "digits", "--val-fraction", "1"], "--val-fraction=1.0 must be"),
    ],
)
def test_prepare_command_errors_are_one_line(tmp_path, capsys, extra, needle):
    assert main(["data", "prepare", "--out", str(tmp_path / "o.st"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_grid_layout():
    x = torch.stack([torch.full((1, 2, 2), v) for v in (-1.0, 1.0, 1.0)])
    g = grid(x, cols=2, pad=1, scale=2)
    assert g.shape == (2 * 5 + 1, 2 * 5 + 1, 1)
    assert g[1:5, 1:5].max() == 0 and (g[1:5, 6:10] == 255).all() and (g[6:10, 1:5] == 255).all()
    assert g[0].max() == 0 and g[6:10, 6:10].max() == 0  # padding and the empty fourth tile
