"""Core (single process) elastic N:M and background mask jobs: the controller switches patterns at
the scheduled step, growth keeps the active weights and zeroes the grown ones' optimizer state,
the pattern in force survives state_dict; a threaded MaskJob equals the inline computation and
re-raises the worker's error on the training thread.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshspeed.sparse import MaskController, SparsityConfig, is_nm, sparsify, targets
from meshspeed.sparse.background import MaskJob, Snapshot


def _setup(schedule: str = "0:1:4,3:2:4"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    cfg = SparsityConfig(pattern="1:4", pattern_schedule=schedule, update_interval=2, transposable=False)
    sparsify(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, MaskController(model, opt, cfg)


def _train(model, opt, ctl, first: int, last: int, seen: dict) -> None:
    for done in range(first, last + 1):
        torch.manual_seed(done)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        old = {n: t.mask.clone() for n, t in targets(model)}
        record = ctl.step(done)
        seen[done] = (record, old, {n: t.mask.clone() for n, t in targets(model)})
        opt.zero_grad(set_to_none=False)


def test_pattern_schedule_switches_at_the_step_and_grows_by_gradient():
    model, opt, ctl = _setup()
    seen: dict = {}
    _train(model, opt, ctl, 1, 3, seen)  # done = 3: 1:4 -> 2:4, checked right after
    assert seen[2][0].sparsity == 0.75 and seen[3][0].sparsity == 0.5 and ctl.config.pattern == "2:4"
    record, old, new = seen[3]
    for name, t in targets(model):
        assert is_nm(old[name], 1, 4) and is_nm(new[name], 2, 4) and t.nm == (2, 4)
        grown = new[name] & ~old[name]
        assert not (old[name] & ~new[name]).any(), f"{name}: growth dropped an active weight"
        assert record.layers[name].regrown == int(grown.sum()) == grown.numel() // 4
        state = opt.state[t.weight]
        assert not t.weight.detach()[grown].any()
        assert not state["exp_avg"][grown].any() and not state["exp_avg_sq"][grown].any()
        assert state["exp_avg"][~grown].any()


def test_pattern_in_force_is_restored_from_state_dict():
    model, opt, ctl = _setup()
    _train(model, opt, ctl, 1, 3, {})
    saved, masks = ctl.state_dict(), {n: t.mask.clone() for n, t in targets(model)}
    assert saved["pattern"] == "2:4"
    model2, opt2, ctl2 = _setup()
    model2.load_state_dict(model.state_dict())
    ctl2.load_state_dict(saved)
    assert ctl2.config.pattern == "2:4" and not ctl2.pattern_due(4)
    for name, t in targets(model2):
        assert t.nm == (2, 4) and torch.equal(t.mask, masks[name])
        t.set_mask(t.mask.clone())  # the restored pattern checks the restored masks


def test_threaded_job_equals_inline_and_reraises_errors():
    results = []
    for threaded in (True, False):
        model, opt, ctl = _setup("")
        torch.manual_seed(1)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        snaps = [Snapshot.of(n, t, need_grad=True) for n, t in targets(model)]
        with torch.no_grad():
            for _, t in targets(model):
                t.weight.zero_()  # training moves on: the job must read its snapshot only
        job = MaskJob(lambda: ctl.step_on(2, snaps), device=torch.device("cpu"), threaded=threaded)
        record = job.result()
        assert record is not None and record.step == 2 and ctl.last_update == 2
        results.append({s.name: s.mask for s in snaps})
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])
    assert any(not m.all() for m in results[0].values())

    def boom():
        raise ValueError("worker failed")

    job = MaskJob(boom, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="worker failed"):
        job.result()
