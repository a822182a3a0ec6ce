"""The dit family on one device: adaLN-Zero init, conditioning, full attention, the recipe's
data, config errors, preset sizes (the diffusers oracle is tests/interop/test_diffusers_dit.py)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.comm.recipe import build_on_meta
from meshspeed.models import ModelConfig, build_model, get_preset, recipe_for
from meshspeed.models.dit import full_attention
from meshspeed.models.dit_recipe import init_tensor
from meshspeed.models.flops import flops_per_sample, param_count
from meshspeed.parallel.tensor import tp_plan

TINY = dict(
    family="dit", dim=32, n_layers=2, n_heads=4, image_size=8, patch_size=2, in_channels=2, n_classes=5
)


def _inputs(cfg: ModelConfig, n: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen)
    return x, torch.rand(n, generator=gen), torch.randint(0, cfg.n_classes + 1, (n,), generator=gen)


def _live(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter random (the zero-initialised ones too), so every path carries signal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def test_adaln_zero_init_outputs_zero_and_blocks_are_identity():
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, seed=0)
    x, t, y = _inputs(cfg)
    assert torch.equal(model(x, t, y), torch.zeros_like(x))
    h = torch.randn(3, 16, cfg.dim)
    c = model.condition(t, y)
    for block in model.blocks.values():
        assert torch.equal(block(h, c), h)
    # and it is the modulation that does it: the other weights are live
    assert model.blocks["0"].attention.wq.weight.abs().sum() > 0
    assert model.t_embedder.linear_1.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_init_depends_on_seed_and_name_only():
    a, b = (
        init_tensor("blocks.0.mlp.fc1.weight", (64, 32), 3),
        init_tensor("blocks.1.mlp.fc1.weight", (64, 32), 3),
    )
    assert torch.equal(a, init_tensor("blocks.0.mlp.fc1.weight", (64, 32), 3)) and not torch.equal(a, b)
    bound = (6 / (64 + 32)) ** 0.5  # Xavier-uniform
    assert a.abs().max().item() <= bound and a.abs().max().item() > 0.9 * bound
    assert not init_tensor("blocks.0.modulation.weight", (192, 32), 3).any()
    assert not init_tensor("final_layer.linear.weight", (8, 32), 3).any()


def test_conditioning_reaches_the_output():
    cfg = ModelConfig(**TINY)
    model = _live(build_model(cfg))
    x, t, y = _inputs(cfg)
    out = model(x, t, y)
    assert not torch.allclose(out, model(x, t, (y + 1) % (cfg.n_classes + 1)))  # class
    assert not torch.allclose(out, model(x, t.flip(0), y))  # timestep
    with pytest.raises(ValueError, match="pass y"):
        model(x, t)
    text_cfg = ModelConfig(**dict(TINY, n_classes=0, text_dim=6, learn_sigma=True))
    tm = _live(build_model(text_cfg))
    text = torch.randn(3, 5, 6)
    v = tm(x, t, text=text)
    assert v.shape == (3, 4, 8, 8)  # learn_sigma: 2 · in_channels
    assert not torch.allclose(v, tm(x, t, text=text.flip(1).roll(1, 0)))


def test_attention_is_full_not_causal():
    """The first image token's output depends on the last patch's pixels (a causal mask would
    hide them from it)."""
    cfg = ModelConfig(**TINY)
    model = _live(build_model(cfg))
    x, t, y = _inputs(cfg)
    x2 = x.clone()
    x2[:, :, -2:, -2:] += 1.0  # only the last patch changes
    out, out2 = model(x, t, y), model(x2, t, y)
    assert not torch.allclose(out[:, :, :2, :2], out2[:, :, :2, :2])
    assert recipe_for(cfg).causal is False and recipe_for(get_preset("tiny")).causal is True


def test_recipe_plan_claims_every_split_module():
    cfg = ModelConfig(**dict(TINY, text_dim=6))
    recipe = recipe_for(cfg)
    rows = dict(tp_plan(recipe).assign(build_on_meta(recipe)))
    assert rows["blocks.1.modulation"] == "modulation" and rows["final_layer.modulation"] == "modulation"
    assert rows["blocks.0.cross.wk"] == "colwise_context" and rows["blocks.0.mlp.fc2"] == "rowwise"
    assert rows["x_embedder"] == "sequence_split" and rows["final_layer.linear"] == "sequence_gather"
    assert recipe.pipeline.layers == "blocks" and recipe.hidden_size == 32 and recipe.n_layers == 2


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(patch_size=3), "patch_size=3 does not divide image_size=8"),
        (dict(in_channels=0), "in_channels=0"),
        (dict(n_classes=-1), "n_classes=-1"),
        (dict(dim=30, n_heads=3), "multiple of 4"),
    ],
)
def test_bad_config_is_one_line(override, match):
    with pytest.raises(ValueError, match=match) as err:
        ModelConfig(**dict(TINY, **override))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, published", [("dit-s-2", 33e6), ("dit-b-2", 130e6), ("dit-xl-2", 675e6), ("flux-shape", 11.9e9)]
)
def test_preset_sizes(name, published):
    cfg = get_preset(name)
    counted = sum(p.numel() for p in build_on_meta(recipe_for(cfg)).parameters())
    assert counted == param_count(cfg)
    assert abs(counted / published - 1) < 0.02, f"{name}: {counted:,}"


def test_flops_per_sample_counts_every_matmul():
    cfg = get_preset("dit-xl-2")
    # DiT-XL/2's published forward cost is 118.6 GFLOPs (multiply-adds counted once): training
    # is 3 forward costs, at 2 FLOPs per multiply-add
    assert flops_per_sample(cfg) == pytest.approx(3 * 2 * 118.6e9, rel=0.03)
    assert flops_per_sample(get_preset("dit-tiny")) > 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_gradients(mode):
    """memory.recompute over the recipe's blocks (full: whole blocks; selective: the attention
    cores, self and cross) changes no number."""
    from meshspeed.memory.recompute import apply_recompute

    cfg = ModelConfig(**dict(TINY, text_dim=6))
    x, t, y = _inputs(cfg)
    text = torch.randn(3, 5, 6)
    grads = []
    for recompute in (False, True):
        model = _live(build_model(cfg))
        if recompute:
            apply_recompute(model, mode, layers_attr=recipe_for(cfg).pipeline.layers)
            block = model.blocks["1"]
            wrapped = "forward" in vars(block) if mode == "full" else block.cross.core is not full_attention
            assert wrapped, f"recompute {mode} reached no dit block"
        model(x, t, y, text).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
