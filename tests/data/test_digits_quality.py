"""The digit classifier behind the sample-quality figure: ≥ 90% on real held-out digits, about
10% on pure noise with balanced labels, deterministic from its seed and cached; FID of real
digits against the held-out ones is far below that of noise."""

from __future__ import annotations

import os

import pytest
import torch

from meshspeed.comm.errors import ConfigError
from meshspeed.data.digits_quality import (
    DigitsScorer,
    frechet_distance,
    load_classifier,
    train_classifier,
    weights_digest,
)
from meshspeed.data.images import load_image_records


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    return DigitsScorer(cache_dir=str(tmp_path_factory.mktemp("cache")))


def test_real_digits_are_recognised_and_noise_is_chance(scorer):
    val = scorer.val
    assert val["images"].shape[0] == 180
    assert scorer.accuracy(val["images"], val["labels"]) >= 0.90
    # the score is of the labels asked for: the wrong class for every image scores near 0
    assert scorer.accuracy(val["images"], (val["labels"] + 1) % 10) < 0.05
    labels = torch.arange(10).repeat_interleave(50)
    noise = torch.randn(500, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    assert 0.05 <= scorer.accuracy(noise, labels) <= 0.15


def test_fid_orders_real_and_noise(scorer):
    train, _ = load_image_records("digits")
    real = scorer.fid(train["images"])
    noise = scorer.fid(torch.randn(500, 1, 8, 8, generator=torch.Generator().manual_seed(2)))
    assert real * 20 < noise, (real, noise)
    # a blurred copy of the digits lies between
    blurred = torch.nn.functional.avg_pool2d(train["images"], 3, 1, 1)
    assert real < scorer.fid(blurred) < noise


def test_frechet_distance_of_gaussians():
    # N(0, I) against N(m, 4I) in 3-d: ‖m‖² + 3·(1 + 4 − 2·2) = ‖m‖² + 3
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200_000, 3, generator=g)
    b = torch.randn(200_000, 3, generator=g) * 2 + torch.tensor([1.0, 2.0, 0.0])
    assert frechet_distance(a, b) == pytest.approx(5 + 3, rel=0.02)
    assert frechet_distance(a, a) == pytest.approx(0, abs=1e-6)


def test_training_is_deterministic_and_cached(tmp_path):
    first = load_classifier(str(tmp_path), seed=0)  # trains and caches
    (cached,) = os.listdir(tmp_path)
    assert cached.endswith(".safetensors")
    assert weights_digest(train_classifier(seed=0)) == weights_digest(first)
    assert weights_digest(load_classifier(str(tmp_path), seed=0)) == weights_digest(first)


def test_wrong_shape_is_one_line(scorer):
    with pytest.raises(ConfigError, match=r"^images has shape \[2, 3, 8, 8\]; the digit classifier"):
        scorer.accuracy(torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))
