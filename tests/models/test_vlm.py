"""Family `vlm`: the image-token scatter, patch order, M-RoPE positions, the decoder reused from
Qwen2, config errors, presets, and tensor parallelism (world size 2) equal to one device,
forward and gradients. The Hugging Face oracle is tests/interop/test_hf_vlm.py."""

from __future__ import annotations

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad, sharding_of
from meshspeed.models import (
    ModelConfig,
    Qwen2,
    build_model,
    cross_entropy_loss,
    get_preset,
    param_count,
    recipe_for,
)
from meshspeed.models.vlm import grid_positions, mrope_positions, patchify, scatter_image_features
from meshspeed.models.vlm_config import image_tokens
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import loss_fn, parallelize
from tests import harness

TINY = dict(
    family="vlm",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    ffn_hidden=64,
    max_seq_len=48,
    image_size=16,
    patch_size=4,
    vision_dim=32,
    vision_layers=2,
    vision_heads=4,
)


def batch(config: ModelConfig, b: int = 2, seq: int = 20, start: int = 3):
    """Random text with one image's placeholders at `start`, images, next-token labels."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 200, (b, seq), generator=gen)
    tokens[:, start : start + image_tokens(config)] = config.image_token_id
    images = torch.rand(b, 3, config.image_size, config.image_size, generator=gen) * 2 - 1
    labels = torch.randint(0, 200, (b, seq), generator=gen)
    labels[:, : start + 2] = -100
    return tokens, images, labels


def test_scatter_puts_feature_k_at_placeholder_k():
    h = torch.zeros(2, 6, 3)
    is_img = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    feats = torch.arange(5 * 3, dtype=torch.float32).view(1, 5, 3) + 1
    out = scatter_image_features(h, is_img, feats)
    places = [(0, 1), (0, 3), (0, 4), (1, 0), (1, 5)]  # row-major over [batch, seq]
    for k, (b, s) in enumerate(places):
        assert torch.equal(out[b, s], feats[0, k]), (k, b, s)
    assert torch.equal(out[~is_img], torch.zeros(6 - 1 + 6 - 4, 3))  # text rows untouched
    with pytest.raises(ValueError, match="4 features"):
        scatter_image_features(h, is_img, feats[:, :4])


def test_patchify_is_merge_window_order():
    # pixel value = 100 * patch row + patch col, so each patch names where it came from
    side, p, m = 8, 2, 2
    g = side // p
    rows = torch.arange(side)[:, None] // p
    cols = torch.arange(side)[None, :] // p
    img = (100 * rows + cols).float().expand(1, 3, side, side)
    patches = patchify(img, p, m)[0]  # [n_patch, 3 * p * p]
    r, c = grid_positions(g, m)
    assert torch.equal(patches[:, 0], (100 * r + c).float())
    assert torch.equal(patches.min(1).values, patches.max(1).values)  # one patch, one value
    # the first merge window is patches (0,0), (0,1), (1,0), (1,1)
    assert (r[:4].tolist(), c[:4].tolist()) == ([0, 0, 1, 1], [0, 1, 0, 1])


def test_mrope_positions_follow_qwen2_vl():
    config = ModelConfig(**TINY)  # 16 x 16 image, patch 4, merge 2: a 2 x 2 grid of image tokens
    i = config.image_token_id
    tokens = torch.tensor([[7, 8, i, i, i, i, 9, 10, i, i, i, i, 11]])
    pos = mrope_positions(tokens, config)[:, 0].tolist()
    t = [0, 1, 2, 2, 2, 2, 4, 5, 6, 6, 6, 6, 8]
    h = [0, 1, 2, 2, 3, 3, 4, 5, 6, 6, 7, 7, 8]
    w = [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 6, 7, 8]
    assert pos == [t, h, w]


def test_image_reaches_only_positions_after_its_placeholders():
    config = ModelConfig(**TINY)
    model = build_model(config, seed=1)
    tokens, images, _ = batch(config)
    a, b = model(tokens, images), model(tokens, images.flip(-1))
    assert torch.equal(a[:, :3], b[:, :3])  # causal: text before the image cannot see it
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_text_only_is_the_qwen2_decoder():
    config = ModelConfig(**TINY)
    model = build_model(config, seed=1)
    text = Qwen2(ModelConfig(**{**TINY, "family": "qwen2"}))
    state = {k.replace("embed.tok_embeddings", "tok_embeddings"): v for k, v in model.state_dict().items()}
    text.load_state_dict({k: v for k, v in state.items() if not k.startswith("embed.")})
    tokens = torch.randint(0, 200, (2, 12))
    assert torch.equal(model(tokens), text(tokens))


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(image_size=20), "image_size=20 is not a multiple of patch_size"),
        (dict(vision_heads=16), "vision_heads=16"),
        (dict(image_token_id=256), "image_token_id=256 is outside the vocabulary"),
        (dict(mrope_section=(1, 1, 1)), "mrope_section=.* summing to head_dim / 2 = 4"),
        (dict(max_seq_len=4), "max_seq_len=4 leaves no room"),
        (dict(patch_size=0), "patch_size=0 is invalid"),
    ],
)
def test_config_errors_name_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**TINY, **override})


def test_vision_fields_leave_text_families_alone():
    # a bad vision value is not read by a text family
    assert ModelConfig(image_size=7).qkv_bias is False


def test_presets_build_and_count():
    tiny = get_preset("vlm-tiny")
    model = build_model(tiny)
    assert param_count(tiny) == sum(p.numel() for p in model.parameters())
    # transformers' Qwen2-VL-7B count (8,291,375,616) less the Conv3d's second time tap
    assert param_count(get_preset("qwen2-vl-7b")) == 8_291_375_616 - 3 * 14 * 14 * 1280


# --- tensor parallelism at world size 2 ------------------------------------------------------


def job_tp(ctx, overrides: dict) -> list[str]:
    """Mismatches between the tp model and the single-device one (forward and gradients), and
    between the born-sharded model and the sliced single-device init."""
    g = ctx.world
    config = ModelConfig(**{**TINY, **overrides})
    recipe = recipe_for(config)
    mesh = comm.ParallelDims(tp=g.size).build(ctx)
    sliced = parallelize(build_model(config, seed=3), mesh, recipe)
    born = build_parallel_model(recipe, mesh, seed=3)
    bad = [
        f"born-sharded {n} differs"
        for (n, p), (m, q) in zip(sliced.named_parameters(), born.named_parameters())
        if n != m or not torch.equal(p, q)
    ]
    # Every value random (biases and norms start at 0 and 1, where a bias added once per rank
    # or a norm weight dropped would not show).
    ref = build_model(config, seed=3)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model = parallelize(copy.deepcopy(ref), mesh, recipe)
    tokens, images, labels = batch(config)
    ref_loss = cross_entropy_loss(ref(tokens, images), labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    loss = loss_fn(model)(model(tokens, images), labels)
    loss.backward()
    if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
        bad.append(f"loss {loss} != {ref_loss}")
    params = dict(model.named_parameters())
    if set(params) != set(ref_grads):
        bad.append(f"names differ: {sorted(set(params) ^ set(ref_grads))}")
    sharded = [n for n, p in params.items() if sharding_of(p) is not None]
    for want in ("vision.layers.0.attention.wq", "projector.w1", "layers.0.attention.wq", "tok_embeddings"):
        if not any(want in n for n in sharded):
            bad.append(f"{want} is not sharded")
    for name, p in params.items():
        got = full_grad(p, {"tp": g}) if sharding_of(p) is not None else p.grad
        if not torch.allclose(got, ref_grads[name], rtol=1e-4, atol=1e-6):
            bad.append(f"grad {name} differs by {(got - ref_grads[name]).abs().max():.2e}")
    return bad


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_matches_single_device(tied):
    assert harness.run(2, job_tp, dict(tie_embeddings=tied)) == [[], []]


def test_pipeline_units_split_equals_whole():
    """Stage 0 holds the recipe's embedding unit (token embedding, ViT and projector) and the
    first block; stage 1 the rest, fed hidden states and the M-RoPE positions; equal to one
    model. The positions reach stage 1's blocks through the recipe's layer_args."""
    config = ModelConfig(**TINY)
    recipe = recipe_for(config)
    model = build_model(config, seed=2)
    tokens, images, _ = batch(config)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    units = recipe.pipeline
    for name in units.head:
        setattr(first, name, None)
    del first.layers["1"]
    setattr(second, units.embedding, None)
    del second.layers["0"]
    positions = mrope_positions(tokens, config)
    hidden = first(tokens, images)
    assert torch.equal(second(hidden, positions=positions), model(tokens, images))
    cos, sin = units.layer_args(model, positions)
    assert cos.shape == (2, tokens.shape[1], config.head_dim // 2)
    with pytest.raises(ValueError, match="pass positions"):
        second(hidden)
