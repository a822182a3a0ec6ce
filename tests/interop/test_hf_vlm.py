"""The Hugging Face oracle of family `vlm`: a tiny random transformers Qwen2VLForConditionalGeneration
built from a config (no download), its weights converted into meshspeed's VLM, logits equal within
1e-5 (fp32) on the same tokens and images; the VLM's weights exported back load into transformers
(strict) and give the same logits. Every parameter is drawn at random (biases and norms too), so a
tensor mapped to the wrong place cannot hide behind a zero or a one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshspeed.interop import hf_vlm
from meshspeed.models import ModelConfig, build_model
from meshspeed.models.vlm import patchify

transformers = pytest.importorskip("transformers")

CONFIG = ModelConfig(
    family="vlm",
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_hidden=96,
    norm_eps=1e-6,
    rope_theta=1e6,
    max_seq_len=64,
    image_size=16,
    patch_size=4,
    vision_dim=32,
    vision_layers=2,
    vision_heads=4,
)
IMG = CONFIG.image_token_id


def hf_model(config: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2VLConfig(**hf_vlm.config_to_hf(config))
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def processor():
    """transformers' own Qwen2-VL image processor, with no resize or normalisation: it lays the
    patches out as its model expects, independently of meshspeed's patchify."""
    return transformers.Qwen2VLImageProcessor(
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
    )


def inputs(b: int = 2):
    """Text, then one image's 4 placeholders, then more text; images; HF's pixel_values."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 200, (b, 22), generator=gen)
    tokens[:, 5:9] = IMG
    images = torch.rand(b, 3, 16, 16, generator=gen) * 2 - 1
    out = processor()(images=list(images.numpy()), return_tensors="pt", input_data_format="channels_first")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] * b
    return tokens, images, out["pixel_values"]


def hf_logits(model, tokens, pixel_values, grid: int = 4) -> torch.Tensor:
    """transformers' logits for one still image per row of `grid` × `grid` patches."""
    b = tokens.shape[0]
    with torch.no_grad():
        return model(
            input_ids=tokens,
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor([[1, grid, grid]] * b),
            mm_token_type_ids=(tokens == IMG).int(),
        ).logits


@pytest.fixture(scope="module")
def pair():
    hf = hf_model(CONFIG)
    config = hf_vlm.config_from_hf(hf.config.to_dict(), image_size=16, max_seq_len=64)
    ours = build_model(config)
    ours.load_state_dict(hf_vlm.state_from_hf(hf.state_dict(), config))
    return hf, ours, config


def test_logits_equal_transformers(pair):
    hf, ours, _ = pair
    tokens, images, pv = inputs()
    want = hf_logits(hf, tokens, pv)
    with torch.no_grad():
        got = ours(tokens, images)
    assert want.abs().max() > 1.0  # the comparison is not of near-zero numbers
    assert (got - want).abs().max() < 1e-5


def test_text_only_logits_equal_transformers(pair):
    hf, ours, _ = pair
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - hf(input_ids=tokens).logits).abs().max() < 1e-5


def test_export_loads_back_into_transformers(pair):
    _, ours, config = pair
    back = transformers.Qwen2VLForConditionalGeneration(
        transformers.Qwen2VLConfig(**hf_vlm.config_to_hf(config))
    ).eval()
    back.load_state_dict(hf_vlm.state_to_hf(ours.state_dict(), config), strict=True)
    tokens, images, pv = inputs()
    with torch.no_grad():
        assert (hf_logits(back, tokens, pv) - ours(tokens, images)).abs().max() < 1e-5


def test_patch_order_is_the_processors():
    """patchify lays the patches out as transformers' processor does: the window order the merger
    and the vision positions assume."""
    proc = processor()
    img = np.random.default_rng(0).random((16, 16, 3)).astype(np.float32)
    out = proc(images=[img], return_tensors="pt", input_data_format="channels_last")
    pv = out["pixel_values"].view(-1, 3, 2, 4, 4)[:, :, 0].reshape(-1, 48)
    ours = patchify(torch.from_numpy(img).permute(2, 0, 1)[None], 4, 2)[0]
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert torch.allclose(pv, ours)


def test_tied_embeddings_round_trip():
    config = ModelConfig(**{**CONFIG.__dict__, "tie_embeddings": True})
    hf = hf_model(config, seed=1)
    ours = build_model(config)
    ours.load_state_dict(hf_vlm.state_from_hf(hf.state_dict(), config))
    tokens, images, pv = inputs()
    with torch.no_grad():
        assert (hf_logits(hf, tokens, pv) - ours(tokens, images)).abs().max() < 1e-5
    assert "lm_head.weight" not in hf_vlm.state_to_hf(ours.state_dict(), config)
