"""MaskController: budgets, RigL/SET invariants, N:M ramps, flip-rate records."""

import pytest
import torch
from torch import nn

from meshspeed.sparse import (
    MaskController,
    SparsityConfig,
    drop_grow,
    flip_count,
    is_nm,
    is_transposable_nm,
    keep_count,
    sparsify,
    targets,
)


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))
    with torch.no_grad():  # give layers different statistics so adapters have something to act on
        model[0].weight.mul_(3.0)
        model[4].weight.mul_(0.2)
    return model


def _train(model, opt, ctl, steps, start=1, seed=0, on_update=None):
    """Train; after each mask update call on_update(step, record, old_masks) before anything moves."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for step in range(start, start + steps):
        x = torch.randn(8, 16, generator=g)
        model(x).square().mean().backward()
        opt.step()
        old = {n: t.mask.clone() for n, t in ctl.targets}
        rec = ctl.step(step)
        records.append((step, rec, old))
        if rec is not None:
            for name, t in ctl.targets:
                if t.nm is not None and t.mask.all():
                    continue
                assert is_nm(t.mask, *t.nm) if t.nm else True
                assert is_transposable_nm(t.mask) if t.transposable else True
            if on_update is not None:
                on_update(step, rec, old)
        opt.zero_grad()
    return records


@pytest.mark.parametrize("adapter", ["none", "magnitude", "gradient", "sensitivity"])
@pytest.mark.parametrize("distribution", ["uniform", "erk"])
def test_layer_budgets_average_to_global_target(adapter, distribution):
    model = _model()
    cfg = SparsityConfig(
        pattern="unstructured",
        target=0.8,
        adapter=adapter,
        distribution=distribution,
        max_layer_sparsity=0.95,
    )
    sparsify(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = MaskController(model, opt, cfg)
    model(torch.randn(4, 16)).sum().backward()  # gradients for the gradient/sensitivity adapters
    levels = ctl.layer_sparsities(0.8)
    numels = ctl.numels
    mean = sum(numels[n] * levels[n] for n in levels) / sum(numels.values())
    assert mean == pytest.approx(0.8, abs=1e-6)
    assert all(0.0 <= s <= 0.95 + 1e-12 for s in levels.values())
    rec = ctl.update(10)
    assert rec.sparsity == pytest.approx(0.8, abs=2e-3)  # exact counts up to rounding per layer
    if adapter == "magnitude":
        # the loud first layer is pruned less than the quiet last one
        assert levels["0"] < levels["4"]


def test_rigl_constant_density_zero_regrowth_and_adam_state():
    model = _model()
    cfg = SparsityConfig(
        pattern="unstructured",
        target=0.75,
        method="rigl",
        update_interval=2,
        drop_fraction=0.3,
        total_steps=100,
    )
    sparsify(model, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctl = MaskController(model, opt, cfg)
    counts0 = {n: int(t.mask.sum()) for n, t in ctl.targets}
    seen = []

    def check(step, rec, old):
        assert rec.drop_fraction > 0
        for name, t in ctl.targets:
            assert int(t.mask.sum()) == counts0[name] == keep_count(t.weight.numel(), 0.75)
            grown = t.mask & ~old[name]
            assert rec.layers[name].regrown == int(grown.sum())
            assert rec.layers[name].flips == flip_count(old[name], t.mask)
            if grown.any():
                seen.append(name)
                assert (t.weight.detach()[grown] == 0).all()
                state = opt.state[t.weight]
                assert (state["exp_avg"][grown] == 0).all() and (state["exp_avg_sq"][grown] == 0).all()
                # untouched positions keep their Adam state
                assert state["exp_avg_sq"][t.mask & old[name]].abs().sum() > 0

    _train(model, opt, ctl, 8, on_update=check)
    saw_regrowth = bool(seen)
    assert saw_regrowth


def test_rigl_growth_uses_largest_gradient():
    mask = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    weight = torch.tensor([5.0, 0.1, 3.0, 9, 9, 9, 9, 9])
    grad = torch.tensor([0.0, 0, 0, 0.1, 0.9, 0.2, 0.8, 0.3])
    new = drop_grow(mask, weight.abs(), grad.abs(), keep=3, n_swap=1)
    # drops the smallest active |W| (index 1), grows the largest inactive |grad| (index 4)
    assert new.tolist() == [True, False, True, False, True, False, False, False]
    grow_more = drop_grow(mask, weight.abs(), grad.abs(), keep=4, n_swap=1)  # density rising
    assert grow_more.tolist() == [True, True, True, False, True, False, False, False]


def test_set_random_growth_is_seeded_and_keeps_density():
    results = []
    for _ in range(2):
        model = _model()
        cfg = SparsityConfig(pattern="unstructured", target=0.6, method="set", update_interval=1, seed=7)
        sparsify(model, cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ctl = MaskController(model, opt, cfg)
        counts0 = {n: int(t.mask.sum()) for n, t in ctl.targets}
        _train(model, opt, ctl, 3)
        assert {n: int(t.mask.sum()) for n, t in ctl.targets} == counts0
        assert all(r.flip_rate > 0 for r in ctl.history[1:])
        results.append(torch.cat([t.mask.flatten() for _, t in ctl.targets]))
    assert torch.equal(results[0], results[1])


def test_nm_schedule_ramps_sparse_layers_and_lambda():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    cfg = SparsityConfig(
        pattern="2:4",
        method="sr-ste",
        schedule="cubic",
        warmup_steps=2,
        ramp_steps=8,
        update_interval=1,
        total_steps=20,
        dense_finish_steps=3,
    )
    sparsify(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctl = MaskController(model, opt, cfg)
    assert all(t.path == "dense" for _, t in ctl.targets)  # warmup
    g = torch.Generator().manual_seed(0)
    fractions = []
    for step in range(1, 20):
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
        rec = ctl.step(step)
        opt.zero_grad()
        assert rec is not None  # interval 1
        sparse = [n for n, t in ctl.targets if not t.mask.all()]
        for n, t in ctl.targets:
            assert t.mask.all() or is_transposable_nm(t.mask)
            assert t.sr_ste_lambda == (pytest.approx(rec.sr_ste_lambda) if n in sparse else 0.0)
        fractions.append(len(sparse) / 4)
        # the parameter fraction of sparse layers tracks schedule / (1 - N/M) to within one layer
        assert abs(len(sparse) / 4 - ctl.schedule(step) / 0.5) <= 0.125 + 1e-9
    assert fractions[0] == 0 and max(fractions) == 1.0 and fractions[-1] == 0  # warmup, ramp, dense finish
    assert all(a <= b for a, b in zip(fractions[:15], fractions[1:16]))
    lambdas = [r.sr_ste_lambda for r in ctl.history]
    assert max(lambdas) == pytest.approx(2e-4)


def test_flip_rate_recorded_per_update_and_cadence():
    model = _model()
    cfg = SparsityConfig(pattern="2:4", method="sr-ste", update_interval=3, sr_ste_lambda=0.0)
    sparsify(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ctl = MaskController(model, opt, cfg)

    def check(step, rec, old):
        total = sum(flip_count(old[n], t.mask) for n, t in ctl.targets)
        assert rec.flip_rate == pytest.approx(total / sum(t.mask.numel() for _, t in ctl.targets))
        assert rec.layers["0"].flip_rate == pytest.approx(
            flip_count(old["0"], ctl.targets[0][1].mask) / (32 * 16)
        )

    records = _train(model, opt, ctl, 7, on_update=check)
    assert [s for s, r, _ in records if r is not None] == [3, 6]
    assert any(r.flip_rate > 0 for r in ctl.history[1:])  # lr 0.5 moves weights across group ranks


def test_rigl_without_gradient_explains_the_call_order():
    model = _model()
    cfg = SparsityConfig(pattern="unstructured", method="rigl", update_interval=1)
    sparsify(model, cfg)
    ctl = MaskController(model, None, cfg)
    with pytest.raises(RuntimeError, match="after loss.backward"):
        ctl.step(1)


def test_controller_needs_sparse_layers():
    with pytest.raises(ValueError, match="sparsify"):
        MaskController(nn.Linear(4, 4), None, SparsityConfig())
    model = _model()
    sparsify(model, SparsityConfig(pattern="2:4"))
    with pytest.raises(ValueError, match="pattern"):
        MaskController(model, None, SparsityConfig(pattern="unstructured"))
    assert len(targets(model)) == 3
