"""A transformers Qwen2-VL directory (save_pretrained of a tiny random
Qwen2VLForConditionalGeneration) through meshspeed's own paths: `--model.init_from DIR` into the
Trainer (one process and tp 2) gives transformers' logits within 1e-5 on images and text, and
`meshspeed convert --from-hf` then `--to-hf` writes a directory transformers loads back with the
same logits."""

from __future__ import annotations

import pytest
import torch

from meshspeed.cli import main
from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.interop.test_hf_vlm import CONFIG, IMG, hf_logits, hf_model, processor

transformers = pytest.importorskip("transformers")
SIDE = 32  # no meshspeed_image_size in a transformers-saved config.json: 4 merged tokens a side


def inputs(b: int = 2):
    """Text, one 32 x 32 image's 16 placeholders, text; the images; transformers' pixel_values."""
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 200, (b, 26), generator=gen)
    tokens[:, 3:19] = IMG
    images = torch.rand(b, 3, SIDE, SIDE, generator=gen) * 2 - 1
    pv = processor()(images=list(images.numpy()), return_tensors="pt", input_data_format="channels_first")
    assert pv["image_grid_thw"].tolist() == [[1, 8, 8]] * b
    return tokens, images, pv["pixel_values"]


def logits_of(hf, tokens, pv):
    return hf_logits(hf, tokens, pv, grid=8)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen2vl"))
    model = hf_model(CONFIG, seed=5)
    model.save_pretrained(d)
    tokens, images, pv = inputs()
    return d, model, (tokens, images, logits_of(model, tokens, pv))


def job_logits(ctx, run_dir: str, init_from: str, tokens, images):
    cfg = config.load(
        None,
        [
            ("model.init_from", init_from),
            ("train.objective", "sft"),
            ("data.path", "digits"),
            ("train.seq_len", "28"),
            ("train.dtype", "float32"),
            ("parallel.tp", str(ctx.world_size)),
            ("run.dir", run_dir),
        ],
    )
    model = Trainer(cfg, ctx).model.eval()
    model.output.gather_output = True  # tp: whole logits on every rank
    with torch.no_grad():
        return model(tokens, images)


@pytest.mark.parametrize("tp", [1, 2])
def test_init_from_qwen2_vl_dir_equals_transformers(hf_dir, tmp_path, tp):
    d, _, (tokens, images, want) = hf_dir
    got = harness.run(tp, job_logits, str(tmp_path), d, tokens, images)
    assert want.abs().max() > 1.0
    for g in got:
        assert (g - want).abs().max() < 1e-5


def test_convert_both_ways_loads_back_into_transformers(hf_dir, tmp_path):
    d, _, (tokens, images, want) = hf_dir
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    assert main(["convert", "--from-hf", d, "--out", run]) == 0
    assert main(["convert", "--checkpoint", run, "--to-hf", out]) == 0
    back = transformers.Qwen2VLForConditionalGeneration.from_pretrained(out).eval()
    _, _, pv = inputs()
    assert (logits_of(back, tokens, pv) - want).abs().max() < 1e-5
