"""Rectified-flow sampling: Euler and Heun integrate dx/dt = v exactly as their formulas say,
guidance mixes the conditional and unconditional velocities of one batched forward, image i's
noise depends on (seed, i) alone, and dp 1, 2 and 3 give byte-identical PNGs for the same seeds
(models/dit.py's DiT, its weights perturbed: adaLN-Zero's init predicts v = 0 everywhere, which
would make every layout agree trivially)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm.errors import ConfigError
from meshspeed.data.images import save_png, to_uint8
from meshspeed.infer.diffusion import image_noise, sample, sample_parallel
from meshspeed.models import build_model, get_preset
from tests import harness

SHAPE = (1, 8, 8)
N_CLASSES = 10


def tiny_dit(seed: int = 0) -> nn.Module:
    """A 2-block dit-tiny (8 × 8 digits, 10 classes + null) with every weight moved off its
    zero init by seeded noise, so the velocity depends on x, t and y."""
    model = build_model(get_preset("dit-tiny", n_layers=2, dim=48), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


class Linear(nn.Module):
    """v = a·x: dx/dt = a·x has x(0) = x(1)·e^(−a), Euler gives (1 − a/N)^N, Heun
    (1 − a/N + a²/2N²)^N."""

    def __init__(self, a: float):
        super().__init__()
        self.a = a

    def forward(self, x, t, y):
        return self.a * x


class PerClass(nn.Module):
    """v = y (as a float, every pixel), and a record of each forward's batch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t, y):
        self.calls.append((x.shape[0], y.tolist()))
        return y.float()[:, None, None, None].expand_as(x)


EULER = lambda a, n: (1 - a / n) ** n  # noqa: E731
HEUN = lambda a, n: (1 - a / n + a * a / (2 * n * n)) ** n  # noqa: E731


@pytest.mark.parametrize("sampler,factor", [("euler", EULER), ("heun", HEUN)])
def test_integrators_follow_their_formulas(sampler, factor):
    a, n = 1.5, 4
    y = torch.zeros(3, dtype=torch.long)
    x1 = image_noise(SHAPE, 7, range(3))
    got = sample(Linear(a), y, SHAPE, steps=n, sampler=sampler, seed=7)
    torch.testing.assert_close(got, x1 * factor(a, n), rtol=1e-5, atol=1e-6)
    # Heun is second order: at 8 steps it is far closer to the exact e^(−a) than Euler
    exact = x1 * math.exp(-a)
    err = {
        s: (sample(Linear(a), y, SHAPE, steps=8, sampler=s, seed=7) - exact).abs().max()
        for s in ("euler", "heun")
    }
    assert err["heun"] < err["euler"] / 10


def test_guidance_is_one_batched_forward():
    m = PerClass()
    y = torch.tensor([3, 5])
    got = sample(m, y, SHAPE, steps=2, guidance=2.0, null_class=N_CLASSES, seed=0)
    x1 = image_noise(SHAPE, 0, range(2))
    # v = v_u + s·(v_c − v_u) = 10 + 2·(y − 10), constant, so x0 = x1 − v
    want = x1 - (N_CLASSES + 2.0 * (y.float() - N_CLASSES))[:, None, None, None]
    torch.testing.assert_close(got, want)
    assert m.calls == [(4, [3, 5, 10, 10])] * 2  # both branches in one call per step
    m.calls.clear()
    sample(m, y, SHAPE, steps=2, guidance=1.0, null_class=N_CLASSES)  # s = 1: conditional only
    assert m.calls == [(2, [3, 5])] * 2


def test_noise_depends_on_seed_and_index_alone():
    full = image_noise(SHAPE, 3, range(6))
    assert torch.equal(image_noise(SHAPE, 3, [4, 1]), full[[4, 1]])
    assert not torch.equal(image_noise(SHAPE, 4, range(6)), full)
    assert not torch.equal(full[0], full[1])
    # (seed, i) is hashed, not summed: seed 3 image 1 is not seed 4 image 0
    assert not torch.equal(image_noise(SHAPE, 4, [0])[0], full[1])


def test_batch_split_gives_the_same_images():
    model = tiny_dit()
    y = torch.arange(7) % N_CLASSES
    kw = dict(steps=3, sampler="heun", guidance=1.5, null_class=N_CLASSES, seed=9)
    whole = sample(model, y, SHAPE, **kw)
    parts = torch.cat([sample(model, y[:3], SHAPE, rows=range(3), **kw),
                       sample(model, y[3:], SHAPE, rows=range(3, 7), **kw)])  # fmt: skip
    assert torch.equal(whole, parts)
    # not trivially equal: the model moved the noise, and guidance moved it differently
    assert (whole - image_noise(SHAPE, 9, range(7))).abs().max() > 0.1
    assert (whole - sample(model, y, SHAPE, **{**kw, "guidance": 1.0})).abs().max() > 0.01


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(steps=0), "--steps=0 must be an integer ≥ 1"),
        (dict(sampler="rk4"), "--sampler='rk4' is not valid; choose one of euler, heun"),
        (dict(guidance=float("nan")), "--guidance=nan must be a finite number"),
    ],
)
def test_bad_settings_are_one_line(kw, needle):
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(")):
        sample(tiny_dit(), torch.zeros(1, dtype=torch.long), SHAPE, **kw)


def png_bytes(images: torch.Tensor) -> list[bytes]:
    out = []
    for im in to_uint8(images):
        buf = io.BytesIO()
        save_png(im, buf)
        out.append(buf.getvalue())
    return out


def dp_job(ctx, n: int):
    model = tiny_dit(seed=1)
    y = torch.arange(n) % N_CLASSES
    kw = dict(steps=3, sampler="heun", guidance=2.0, null_class=N_CLASSES, seed=5)
    solo = sample(model, y, SHAPE, **kw)  # dp 1
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    got = sample_parallel(model, y, SHAPE, mesh, **kw)
    return png_bytes(solo), png_bytes(got)


@pytest.mark.parametrize("ws", [2, 3])
def test_dp_gives_byte_identical_pngs(ws):
    # 7 images: uneven shares at dp 2 (4 + 3) and dp 3 (3 + 2 + 2)
    for solo, got in harness.run(ws, dp_job, 7):
        assert len(got) == 7 and got == solo
