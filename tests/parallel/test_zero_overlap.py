"""ZeRO-1/2 with the parameter all-gather prefetched during the next forward (zero_prefetch.py):
losses, gradient norms and parameters equal the blocking gather's, bit for bit, and the
single-device run's; the gathers really are still in flight when step() returns."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.parallel.zero_prefetch import enable_zero_prefetch
from tests import harness
from tests.parallel.test_data import STEPS, _fresh, _train, reference


def job_prefetch(ctx, zero: int) -> dict:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    out = {}
    for prefetch in (False, True):
        model, dp, opt = _fresh(mesh, zero)
        pf = enable_zero_prefetch(dp) if prefetch else None
        hist = _train(ctx, mesh, dp, opt, model, range(STEPS))
        if pf is not None:
            out["in_flight_after_step"] = len(pf.pending)
            pf.wait()  # the parameters are read below, outside a forward
            out["stats"] = dict(pf.stats)
            out["buckets"] = len(dp.buckets)
            pf.remove()
        out[prefetch] = (hist, {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("zero", [1, 2])
def test_prefetched_gather_equals_blocking_gather(ws, zero):
    ref_params, _, ref_norms, ref_losses = reference()
    results = harness.run(ws, job_prefetch, zero)
    # Each rank's loss is over its rows: their mean is the global batch's loss.
    losses = [sum(r[True][0][step][1] for r in results) / ws for step in range(STEPS)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for res in results:
        (plain_hist, plain_params), (hist, params) = res[False], res[True]
        assert hist == plain_hist  # (norm, loss) per step, exactly
        assert all(torch.equal(params[n], plain_params[n]) for n in plain_params)
        assert [norm for norm, _ in hist] == pytest.approx(ref_norms, rel=1e-5)
        for n, p in params.items():
            assert torch.allclose(p, ref_params[n], rtol=1e-5, atol=1e-6), n
        # Every bucket's gather was issued at the end of each step and was still pending when
        # step() returned; the next forward waited for them (the last step's by wait()).
        assert res["in_flight_after_step"] == res["buckets"] > 1
        assert res["stats"]["issued"] == STEPS * res["buckets"]
        assert res["stats"]["waited_in_forward"] == (STEPS - 1) * res["buckets"]


def job_noop(ctx) -> list:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    return [enable_zero_prefetch(_fresh(mesh, 0)[1]) is None]


def test_without_zero_it_is_a_noop():
    assert harness.run(2, job_noop) == [[True], [True]]


def test_trainer_losses_with_prefetch_equal_single_process(tmp_path):
    from tests.train.test_trainer import job_losses

    want = harness.run(1, job_losses, str(tmp_path / "ref"), [("parallel.tp", "1")], 4)[0]
    extra = [("parallel.tp", "1"), ("parallel.zero", "2"), ("parallel.zero_prefetch", "true")]
    got = harness.run(4, job_losses, str(tmp_path / "dp4"), extra, 4)
    assert all(r == got[0] for r in got), "ranks disagree on the loss"
    for step, (g, w) in enumerate(zip(got[0], want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step}: {g} vs single-process {w}"
