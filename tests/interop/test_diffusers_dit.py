"""The diffusers oracle: a tiny random DiTTransformer2DModel (built from a config, nothing
downloaded) loads into the dit family and one forward equals diffusers' within 1e-5 (float32);
the export loads back into diffusers and gives the same output again."""

from __future__ import annotations

import pytest
import torch

from meshspeed.interop.diffusers_dit import (
    config_from_diffusers,
    config_to_diffusers,
    from_diffusers,
    load_diffusers_dit,
    to_diffusers,
)
from meshspeed.models import build_model

diffusers = pytest.importorskip("diffusers", reason="diffusers is a dev extra (the dit oracle)")

# learn_sigma (out = 2·in) and 2 channels, so the channel order of patches and unpatchify shows.
TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=2,
    out_channels=4,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)


def _diffusers_dit(seed: int = 0):
    torch.manual_seed(seed)
    model = diffusers.DiTTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():  # diffusers zero-inits nothing here, but be sure all is live
            p.add_(0.02 * torch.randn_like(p))
        # one shared conditioning embedder, as DiT's checkpoints have (the converter requires it)
        first = model.transformer_blocks[0].norm1.emb
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(first.state_dict())
    return model


def _inputs(n: int = 3):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, TINY["in_channels"], 8, 8, generator=gen)
    t = torch.tensor([0.0, 0.37, 1.0])[:n]
    y = torch.tensor([0, 7, 10])[:n]  # 10: the null class
    return x, t, y


def _reference(model, x, t, y):
    with torch.no_grad():  # diffusers' timestep is 1000·t (models/dit.py)
        return model(x, timestep=t * 1000.0, class_labels=y).sample


def test_diffusers_forward_equals_dit():
    ref_model = _diffusers_dit()
    x, t, y = _inputs()
    dit = load_diffusers_dit(ref_model)
    with torch.no_grad():
        got = dit(x, t, y)
    want = _reference(ref_model, x, t, y)
    assert got.shape == want.shape == (3, 4, 8, 8)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 1e-2  # not a trivially zero output


def test_export_loads_back_into_diffusers():
    ref_model = _diffusers_dit()
    dit = load_diffusers_dit(ref_model)
    with torch.no_grad():  # move every weight so an export that drops one shows
        for p in dit.parameters():
            p.add_(0.01 * torch.randn_like(p))
    config = config_from_diffusers(dict(ref_model.config))
    back = diffusers.DiTTransformer2DModel(**config_to_diffusers(config)).eval()
    missing, unexpected = back.load_state_dict(to_diffusers(dit.state_dict(), config), strict=True)
    assert not missing and not unexpected
    x, t, y = _inputs()
    with torch.no_grad():
        assert (dit(x, t, y) - _reference(back, x, t, y)).abs().max().item() < 1e-5
    # and the round trip is exact
    again = from_diffusers(back.state_dict(), config)
    assert all(torch.equal(again[k], v) for k, v in dit.state_dict().items())


def test_config_round_trip_and_refusals():
    config = config_from_diffusers(TINY)
    assert (config.dim, config.n_heads, config.learn_sigma, config.n_classes) == (32, 2, True, 10)
    assert config_to_diffusers(config)["out_channels"] == 4
    with pytest.raises(ValueError, match="out_channels=3"):
        config_from_diffusers(dict(TINY, out_channels=3))
    bad = diffusers.DiTTransformer2DModel(**TINY)  # its blocks' embedders differ
    with pytest.raises(ValueError, match="block 1's norm1.emb"):
        from_diffusers(bad.state_dict(), config)
    text = build_model(config_from_diffusers(TINY)).config
    text.text_dim = 8
    with pytest.raises(ValueError, match="without text"):
        config_to_diffusers(text)
