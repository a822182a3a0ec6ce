"""Offloaded optimizer state updated during backward (memory.offload.EarlyUpdates).

A bucket whose reduction has landed in the last micro-batch's backward is updated there, its
state copied to a second host buffer; step() keeps those updates or, when the step is clipped,
skipped or its gradients were scaled in place, undoes them and updates as before. Whatever the
schedule of plain, clipped and skipped steps, the run equals the one that updates at step()
only, bit for bit (parameters, masters and moments), at dp 1 and at dp 2 under ZeRO-1 and
ZeRO-2; at dp 1 the early updates demonstrably ran before backward had produced its last
gradient, and both the kept and the undone paths were taken.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from meshspeed import comm, models
from meshspeed.memory import offload_optimizer
from meshspeed.parallel.optim import build_data_parallel, clip_coefficient, clip_grad_norm_, grad_norm
from tests import harness

# step kinds: plain; clipped (factor < 1 inside the kernel); inplace (clip_grad_norm_ scales the
# buckets first); skipped (no step: a non-finite loss, say)
SCHEDULE = [
    "plain",
    "plain",
    "plain",
    "clipped",
    "plain",
    "plain",
    "skipped",
    "plain",
    "plain",
    "inplace",
    "plain",
]


def _config():
    return dataclasses.replace(
        models.get_preset("tiny"), dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_hidden=64
    )


def _run(ctx, zero: int, overlap: bool, dtype=torch.bfloat16) -> dict:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    torch.manual_seed(0)
    model = models.build_model(_config())
    dp, opt = build_data_parallel(
        model, mesh, zero=zero, bucket_mb=0.01, dtype=dtype, lr=1e-2, weight_decay=0.1
    )
    offload_optimizer(opt, overlap=overlap)
    early, seen = opt.early, []  # per early update: gradients that had arrived, of how many
    if early is not None:
        final = early.final

        def logged(i):
            before = early.stats["ahead"]
            final(i)
            if early.stats["ahead"] > before:
                seen.append(sum(k == "grad" for k, _ in dp.events))

        dp.on_final[dp.on_final.index(final)] = logged
    rank, size = dp.group.rank, dp.group.size
    totals = []
    for step, kind in enumerate(SCHEDULE):
        tokens = torch.randint(0, 64, (2 * 2 * size, 9), generator=torch.Generator().manual_seed(step))
        for i in range(2):
            rows = tokens[(i * size + rank) * 2 : (i * size + rank + 1) * 2]
            dp.events = []
            with contextlib.nullcontext() if i == 1 else dp.no_sync():
                (models.cross_entropy_loss(model(rows[:, :-1]), rows[:, 1:]) / 2).backward()
        totals.append(sum(k == "grad" for k, _ in dp.events))
        if kind == "inplace":
            clip_grad_norm_(dp, 1e-3, mesh)
            opt.step()
        elif kind != "skipped":
            opt.step(clip_coef=clip_coefficient(grad_norm(dp, mesh), 1e-3 if kind == "clipped" else 1e3))
        opt.zero_grad()
    state = opt.state_dict_per_param()
    names = sorted(k for k in state if k != "__step__")
    out = {
        "params": torch.cat([p.detach().float().flatten() for p in model.parameters()]),
        "state": torch.cat([v.flatten() for n in names for v in state[n].values()]),
        "step": state["__step__"],
        "stats": dict(early.stats) if early is not None else None,
        "seen": seen,
        "grads_per_backward": max(totals),
    }
    dp.remove_hooks()
    return out


def _assert_same(plain: dict, early: dict, what: str) -> None:
    assert plain["step"] == early["step"] == SCHEDULE.count("plain") + 2, what
    assert torch.equal(plain["params"], early["params"]), f"{what}: parameters differ"
    assert torch.equal(plain["state"], early["state"]), f"{what}: optimizer state differs"


def test_one_process_early_updates_are_bit_identical_and_run_inside_backward():
    ctx = comm.init()
    plain, early = _run(ctx, 0, False), _run(ctx, 0, True)
    _assert_same(plain, early, "dp 1")
    s = early["stats"]
    assert s["kept"] > 0 and s["undone"] > 0 and s["ahead"] == s["kept"] + s["undone"], s
    # some bucket was updated while autograd still had gradients of that backward to produce
    assert early["seen"] and min(early["seen"]) < early["grads_per_backward"], early["seen"]


def test_float32_parameters_are_their_own_master_and_are_not_updated_early():
    ctx = comm.init()
    plain, early = _run(ctx, 0, False, torch.float32), _run(ctx, 0, True, torch.float32)
    _assert_same(plain, early, "float32")
    assert early["stats"]["ahead"] == 0


def job_pair(ctx, zero: int) -> tuple[dict, dict]:
    return _run(ctx, zero, False), _run(ctx, zero, True)


@pytest.mark.parametrize("zero", [1, 2])
def test_two_ranks_zero_1_and_2_are_bit_identical(zero):
    for rank, (plain, early) in enumerate(harness.run(2, job_pair, zero, timeout=240)):
        _assert_same(plain, early, f"zero={zero} rank {rank}")
        s = early["stats"]
        assert s["ahead"] == s["kept"] + s["undone"], s
