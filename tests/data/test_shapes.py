"""The built-in captioning tasks (data/shapes.py): deterministic records of the documented keys,
shapes and ranges; labels that put the loss on the caption only; captions that describe the
pixels (so the held-out split needs the image); the digits variant."""

from __future__ import annotations

import torch

from meshspeed.data.shapes import COLOURS, EOT, caption_of, digits_task, shapes_task
from meshspeed.kernels.loss import cross_entropy_loss

N_IMG = 16


def test_records_have_the_documented_layout():
    r = shapes_task(8, seed=3, image_size=32, n_image_tokens=N_IMG, seq_len=64)
    assert set(r) == {"images", "tokens", "labels"}
    assert r["images"].shape == (8, 3, 32, 32) and r["images"].dtype == torch.float32
    assert r["images"].min() >= -1 and r["images"].max() <= 1
    assert r["tokens"].shape == r["labels"].shape == (8, 64)
    assert r["tokens"].dtype == r["labels"].dtype == torch.int64
    assert (r["tokens"][:, :N_IMG] == 255).all() and (r["tokens"][:, N_IMG:] != 255).all()


def test_labels_are_next_caption_tokens_and_ignored_elsewhere():
    r = shapes_task(8, seed=3, n_image_tokens=N_IMG)
    for tokens, labels in zip(r["tokens"], r["labels"]):
        n = len(caption_of(tokens).encode())
        answer = torch.arange(N_IMG - 1, N_IMG + n)  # last placeholder .. last caption byte
        assert torch.equal(labels[answer], tokens[answer + 1])  # the caption's bytes, then EOT
        assert labels[answer[-1]] == EOT
        rest = torch.ones_like(labels, dtype=torch.bool)
        rest[answer] = False
        assert (labels[rest] == -100).all()


def test_loss_counts_only_answer_tokens():
    """The loss reaches exactly the positions that predict a caption byte or its end: from the
    last placeholder to the caption's last byte (counted from the caption text, not the labels)."""
    r = shapes_task(4, seed=0, n_image_tokens=N_IMG, seq_len=60)
    logits = torch.randn(*r["labels"].shape, 256, generator=torch.Generator().manual_seed(0))
    logits.requires_grad_(True)
    cross_entropy_loss(logits, r["labels"]).backward()
    touched = logits.grad.abs().sum(-1) > 0
    want = torch.zeros_like(touched)
    for i, tokens in enumerate(r["tokens"]):
        want[i, N_IMG - 1 : N_IMG + len(caption_of(tokens))] = True
    assert torch.equal(touched, want)


def test_deterministic_from_the_seed():
    a, b, c = shapes_task(6, seed=1), shapes_task(6, seed=1), shapes_task(6, seed=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["images"], c["images"])


def test_captions_describe_the_pixels():
    """The first object's colour fills the top (above) or left (left of) half, the second's the
    other: the caption is a function of the image, so the held-out split needs the image."""
    r = shapes_task(40, seed=7, n_image_tokens=N_IMG)
    for img, tokens in zip(r["images"], r["tokens"]):
        words = caption_of(tokens).split()
        first, second = COLOURS[words[0]], COLOURS[words[-2]]
        near, far = (img[:, :16], img[:, 16:]) if words[2] == "above" else (img[:, :, :16], img[:, :, 16:])
        for half, colour in ((near, first), (far, second)):
            hit = (half == torch.tensor(colour)[:, None, None]).all(0)
            assert hit.sum() >= 9, (words, colour)


def test_held_out_seed_gives_other_images_and_every_colour():
    train, held = shapes_task(200, seed=0), shapes_task(100, seed=1)
    flat_train = train["images"].flatten(1)
    assert not (held["images"].flatten(1)[:, None] == flat_train[None]).all(-1).any()
    firsts = {caption_of(t).split()[0] for t in held["tokens"]}
    assert firsts == set(COLOURS)


def test_digits_variant():
    train, held = digits_task("train", n_image_tokens=N_IMG), digits_task("heldout", n_image_tokens=N_IMG)
    assert train["images"].shape == (1437, 3, 32, 32) and held["images"].shape == (360, 3, 32, 32)
    assert held["images"].min() == -1 and held["images"].max() == 1
    captions = [caption_of(t) for t in held["tokens"][:20]]
    assert all(c.startswith("the digit ") and c[-1].isdigit() for c in captions)
    assert len({caption_of(t) for t in held["tokens"]}) == 10
