"""Rectified-flow math (train/objectives/flow.py) and the EMA of the weights (train/ema.py)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.train.ema import EMA
from meshspeed.train.objectives.flow import drop_labels, flow_loss, noisy, sample_t, stratified_t, target


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_path_endpoints_and_velocity():
    x0, eps = torch.randn(4, 2, 3, 3, generator=_gen(1)), torch.randn(4, 2, 3, 3, generator=_gen(2))
    t = torch.tensor([0.0, 1.0, 0.25, 0.5])
    xt = noisy(x0, eps, t)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[1], eps[1])
    assert torch.allclose(xt[2], 0.75 * x0[2] + 0.25 * eps[2])
    # the target is the path's derivative in t: a finite difference of x_t recovers it
    h = 1e-3
    fd = (noisy(x0, eps, t + h) - noisy(x0, eps, t - h)) / (2 * h)
    assert torch.allclose(fd, target(x0, eps), atol=1e-3)
    assert flow_loss(target(x0, eps), x0, eps).item() == 0.0
    v = target(x0, eps) + 0.5  # every element off by 0.5
    assert flow_loss(v, x0, eps).item() == pytest.approx(0.25)
    extra = torch.cat([v, torch.full_like(v, 100.0)], dim=1)  # learn_sigma channels are ignored
    assert flow_loss(extra, x0, eps).item() == pytest.approx(0.25)


def test_t_sampling():
    u = sample_t(20000, _gen(), "uniform")
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u, sample_t(20000, _gen(), "uniform"))  # the generator decides
    ln = sample_t(20000, _gen(), "logit_normal", mean=0.0, std=1.0)
    assert abs(ln.mean().item() - 0.5) < 0.01 and ln.std().item() < u.std().item()  # mass in the middle
    shifted = sample_t(20000, _gen(), "logit_normal", mean=1.0)
    assert abs(torch.logit(shifted).mean().item() - 1.0) < 0.03
    with pytest.raises(ValueError, match="kind='beta'"):
        sample_t(4, _gen(), "beta")


def test_stratified_timesteps_are_the_eight_midpoints():
    assert stratified_t(8).tolist() == [1 / 16, 3 / 16, 5 / 16, 7 / 16, 9 / 16, 11 / 16, 13 / 16, 15 / 16]


def test_drop_labels():
    y = torch.arange(10).repeat(1000)
    d = drop_labels(y, 0.1, null_id=10, generator=_gen())
    dropped = d == 10
    assert abs(dropped.float().mean().item() - 0.1) < 0.01
    assert torch.equal(d[~dropped], y[~dropped]) and y.max() == 9  # input untouched
    assert torch.equal(drop_labels(y, 0.1, 10, _gen()), d)
    assert drop_labels(y, 0.0, 10, _gen()) is y and (drop_labels(y, 1.0, 10, _gen()) == 10).all()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_ema_update_is_the_running_average():
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = EMA(model.named_parameters(), decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model.named_parameters())
    for n, p in model.named_parameters():  # 0.9·old + 0.1·new
        assert torch.allclose(ema.shadow[n], 0.9 * start[n] + 0.1 * p.detach())
    with ema.swapped(model):
        assert torch.allclose(model[0].weight, ema.shadow["0.weight"])
    assert torch.allclose(model[0].weight, start["0.weight"] + 1.0)  # own weights back
    warm = EMA(model.named_parameters(), decay=0.9999, warmup=True)
    assert warm.current_decay() == pytest.approx(0.1)


def test_ema_works_on_local_shards_and_resumes_exactly():
    """Per-parameter tensors of any shape (a rank's shard): the average of the pieces is the
    piece of the average, and save + load continues bit for bit."""
    full = torch.randn(6, 4, generator=_gen(3))
    whole = EMA([("w", full)], decay=0.8)
    pieces = [EMA([("w", full[i * 2 : i * 2 + 2])], decay=0.8) for i in range(3)]
    for step in range(3):
        new = torch.randn(6, 4, generator=_gen(10 + step))
        whole.update([("w", new)])
        for i, e in enumerate(pieces):
            e.update([("w", new[i * 2 : i * 2 + 2])])
    assert torch.equal(torch.cat([e.shadow["w"] for e in pieces]), whole.shadow["w"])
    model = _model()
    a = EMA(model.named_parameters(), decay=0.99, warmup=True)
    a.update(model.named_parameters())
    b = EMA(model.named_parameters(), decay=0.5)
    b.load_state_dict(a.state_dict())
    for _ in range(2):
        with torch.no_grad():
            model[0].weight.mul_(1.5)
        a.update(model.named_parameters())
        b.update(model.named_parameters())
    assert a.updates == b.updates == 3
    assert all(torch.equal(a.shadow[n], b.shadow[n]) for n in a.shadow)
    with pytest.raises(RuntimeError, match="saw 1 of its 4"):
        a.update(list(model.named_parameters())[:1])
