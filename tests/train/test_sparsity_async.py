"""Masks off the critical path (sparsity.async_masks): the background update is the synchronous
update installed one step later, bit for bit; the same losses at dp 1 and dp 2 x tp 2; a
checkpoint taken with an update in flight resumes exactly.
"""

from __future__ import annotations

import os

import torch

from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_sparsity import NM24, RIGL, _cfg, _full_masks, _rows, job_run

TINY = [("model.preset", "tiny"), ("sparsity.update_interval", "2")]
ASYNC = [("sparsity.async_masks", "true")]


def job_masks_per_step(ctx, run_dir: str, extra: list, steps: int, threaded: bool = True):
    """Losses, rows and the gathered full masks after every step."""
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    trainer.sparsity.threaded = threaded
    rows, masks = [], []
    for s in range(steps):
        rows.append(trainer.train_step(s))
        masks.append(_full_masks(trainer))
    return rows, masks


def _losses(rows):
    return [r["loss"] for r in rows]


def test_async_is_sync_installed_one_step_later(tmp_path):
    extra = TINY + NM24[:1] + [("parallel.tp", "1"), ("sparsity.update_interval", "2")]
    steps = 7
    sync_rows, sync_masks = harness.run(1, job_masks_per_step, str(tmp_path / "s"), extra, steps)[0]
    bg_rows, bg_masks = harness.run(1, job_masks_per_step, str(tmp_path / "a"), extra + ASYNC, steps)[0]
    inline_rows, inline_masks = harness.run(
        1, job_masks_per_step, str(tmp_path / "i"), extra + ASYNC, steps, False
    )[0]
    # the thread changes nothing: the same masks and losses as computing inline at the same step
    assert _losses(bg_rows) == _losses(inline_rows)
    for a, b in zip(bg_masks, inline_masks):
        assert all(torch.equal(a[n], b[n]) for n in a)
    # update steps: done = 2, 4, 6 -> sync installs after step 1, 3, 5; async after step 2, 4, 6
    assert [r["step"] for r in sync_rows if "flip_rate" in r] == [1, 3, 5]
    assert [r["step"] for r in bg_rows if "flip_rate" in r] == [2, 4, 6]
    # until the first update both runs are one computation; then async installs at step 2 the
    # masks sync computed from the step-1 weights (the same snapshot), one step later
    assert _losses(bg_rows)[:2] == _losses(sync_rows)[:2]
    assert any(not torch.equal(sync_masks[0][n], sync_masks[1][n]) for n in sync_masks[0]), "no flip"
    for n in sync_masks[1]:
        assert torch.equal(bg_masks[1][n], sync_masks[0][n]), f"{n}: async installed early"
        assert torch.equal(bg_masks[2][n], sync_masks[1][n]), f"{n}: async mask != the sync one"
    assert _losses(bg_rows)[2] != _losses(sync_rows)[2]  # the delay is real: step 2 sees other masks


def _close(got, want, what):
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"{what} step {step}: {g} vs {w}"


def test_async_losses_equal_at_dp1_and_dp2_tp2(tmp_path):
    for key, extra in (("nm", TINY + NM24[:1]), ("rigl", TINY + RIGL[:3])):
        extra = extra + ASYNC + [("sparsity.update_interval", "2")]
        ref_rows, ref_masks = harness.run(
            1, job_masks_per_step, str(tmp_path / f"{key}1"), extra + [("parallel.tp", "1")], 6
        )[0]
        got = harness.run(
            4,
            job_masks_per_step,
            str(tmp_path / f"{key}4"),
            extra + [("parallel.tp", "2"), ("parallel.zero", "1")],
            6,
        )
        rows, masks = got[0]
        _close(_losses(rows), _losses(ref_rows), f"{key} dp2 x tp2")
        assert [r["step"] for r in rows if "flip_rate" in r] == [2, 4]
        for rank in range(1, 4):  # every rank installed the same masks at the same step
            assert all(torch.equal(masks[-1][n], got[rank][1][-1][n]) for n in masks[-1])
        # six steps: the masks are those of the single process (near-ties aside, see test_sparsity)
        assert all(torch.equal(masks[2][n], ref_masks[2][n]) for n in masks[2])


def test_checkpoint_with_an_update_in_flight_resumes_exactly(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    layout = (
        TINY
        + RIGL[:3]
        + ASYNC
        + [("parallel.tp", "2"), ("train.steps", "9"), ("sparsity.update_interval", "3")]
    )
    harness.run(2, job_run, straight, layout)
    # done = 3 is an update step: the checkpoint at step 3 holds the update computed in the background
    harness.run(2, job_run, split, layout + [("train.exit_interval", "3")])
    state = torch.load(os.path.join(split, "step-000003", "state.pt"), weights_only=True)
    assert state["extra"]["sparsity"]["pending"]["step"] == 3
    harness.run(2, job_run, split, layout + [("checkpoint.resume", "latest")])
    a, b = _rows(straight), _rows(split)
    assert len(a) == 9 and [r["step"] for r in a if "flip_rate" in r] == [3, 6]
    assert a == b
