"""Sparse gradient communication (sparsity.sparse_grad_comm): the packed dp reduction equals the
dense one (and the single-device mean of the masked gradients) under all-reduce and ZeRO
reduce-scatter at dp 2, 3, 4; trainer losses equal the dense-communication run under dp 2,
dp 2 + ZeRO-1/2 and dp 2 x tp 2; counted bytes are N/M of dense for the masked weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.sparse_comm import SparseGradComm
from meshspeed.sparse import nm_mask
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_sparsity import _cfg, _rows, job_run


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8), nn.Linear(8, 8))


def _loss(model, rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)  # every rank its own batch
    return model(torch.randn(5, 16)).square().mean()


def job_pack(ctx, zero: int):
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    model = _model()
    reference = copy.deepcopy(model)
    dp, _ = build_data_parallel(model, mesh, zero=zero, dtype=torch.float32, lr=1e-2)
    # 2:4 masks on two of the three weights; the last layer and the biases stay dense
    masks = {n: nm_mask(p.detach(), 2, 4) for n, p in dp.params.items() if n in ("0.weight", "2.weight")}
    sgc = SparseGradComm(dp, masks)
    sgc.active = True
    out = {}
    for pack in (True, False):
        sgc.pack = pack
        before = dp.stats["grad_comm_bytes"]
        dp.zero_grad()
        _loss(model, ctx.rank).backward()
        dp.finish_grad_sync()
        out[pack] = (
            [dp.reduced_grad(i, *dp.dp_shard(i)).clone() for i in range(len(dp.buckets))],
            dp.stats["grad_comm_bytes"] - before,
        )
    # the plain single-device computation: the mean of every rank's gradient, masked
    grads = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for r in range(ctx.world_size):
        reference.zero_grad()
        _loss(reference, r).backward()
        for n, p in reference.named_parameters():
            grads[n] += p.grad / ctx.world_size
    want = []
    for i, spec in enumerate(dp.specs):
        full = torch.zeros(spec.numel)
        for s in spec.slots:
            g = grads[s.name] * masks[s.name] if s.name in masks else grads[s.name]
            full[s.offset : s.offset + s.numel] = g.reshape(-1)
        want.append(full[slice(*dp.dp_shard(i))])
    kept = sum(int(m.sum()) for m in masks.values()) + sum(
        p.numel() for n, p in dp.params.items() if n not in masks
    )
    dense = sum(b.grad.numel() for b in dp.buckets) * 4
    return out, want, kept, dense


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_packed_reduction_equals_dense_and_the_single_device_mean(ws, zero):
    for rank, (out, want, kept, dense) in enumerate(harness.run(ws, job_pack, zero)):
        (packed, packed_bytes), (ref, ref_bytes) = out[True], out[False]
        for a, b, w in zip(packed, ref, want):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"rank {rank}: packed != dense reduction"
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-7), f"rank {rank}: packed != single device"
        assert ref_bytes == dense
        # indices are implied by the masks: only values travel; a reduce-scatter pads every ZeRO
        # chunk's slot to the fullest chunk's count (small here: 4 parameters in 2 to 4 chunks)
        if zero < 2:
            assert packed_bytes == 4 * kept, (packed_bytes, kept)
        else:
            assert 4 * kept <= packed_bytes < 0.7 * dense, (packed_bytes, kept, dense)


def job_train(ctx, run_dir: str, extra: list, steps: int, pack: bool = True):
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    sgc = trainer.sparsity.grad_comm
    if sgc is not None:
        sgc.pack = pack
    rows = [trainer.train_step(s) for s in range(steps)]
    masked = sum(p.numel() for n, p in trainer.dp.params.items() if n in (sgc.masks if sgc else {}))
    total = sum(p.numel() for p in trainer.dp.params.values())
    return rows, masked, total, sorted(sgc.masks) if sgc else []


LAYOUTS = {
    "dp2": (2, [("parallel.tp", "1")]),
    "dp2-zero1": (2, [("parallel.tp", "1"), ("parallel.zero", "1")]),
    "dp2-zero2": (2, [("parallel.tp", "1"), ("parallel.zero", "2")]),
    "dp2xtp2": (4, [("parallel.tp", "2")]),
    # stacked expert weights [E, out, in] carry masks too (SparseParam): packed like the rest
    "moe-dp2-zero1": (2, [("parallel.tp", "1"), ("parallel.zero", "1"), ("model.preset", "tiny-moe")]),
    # expert parallelism: the experts' buckets are reduced over edp (dp 4 / ep 2), packed the same way
    "moe-dp4-ep2-zero1": (
        4,
        [("parallel.tp", "1"), ("parallel.zero", "1"), ("model.preset", "tiny-moe"), ("parallel.ep", "2")],
    ),
}
SPARSE = [("model.preset", "tiny"), ("sparsity.pattern", "2:4"), ("sparsity.update_interval", "3")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_losses_equal_dense_communication_and_bytes_are_n_over_m(tmp_path, layout):
    ws, extra = LAYOUTS[layout]
    extra = SPARSE + extra
    on = extra + [("sparsity.sparse_grad_comm", "true")]
    rows, masked, total, names = harness.run(ws, job_train, str(tmp_path / "packed"), on, 6)[0]
    if "moe" in layout:
        assert any(n.endswith("experts.w1") for n in names), names
    ref_rows = harness.run(ws, job_train, str(tmp_path / "dense"), on, 6, False)[0][0]
    plain_rows = harness.run(ws, job_train, str(tmp_path / "plain"), extra, 6)[0][0]
    for r, q in zip(rows, ref_rows):
        assert abs(r["loss"] - q["loss"]) <= 1e-6 * q["loss"], f"{layout} step {r['step']}: {r} vs {q}"
        assert r["sparsity"] == q["sparsity"]
    dense = plain_rows[0]["grad_comm_bytes"]
    assert dense > 0 and all(r["grad_comm_bytes"] == dense for r in plain_rows + ref_rows)
    # updates at done = 3, 6: steps 2 and 5 reduce dense (their masks may read the gradients)
    assert [r["step"] for r in rows if r["grad_comm_bytes"] == dense] == [2, 5]
    want = 0.5 * masked + (total - masked)  # 2:4: half of every masked weight, the rest whole
    for r in rows:
        if r["step"] not in (2, 5):
            ratio = r["grad_comm_bytes"] / dense
            assert abs(ratio - want / total) <= 0.03 * want / total, (layout, ratio, want / total)


def test_resume_keeps_the_packing_decision_and_an_async_update(tmp_path):
    layout = SPARSE + [
        ("parallel.tp", "1"),
        ("parallel.zero", "1"),
        ("train.steps", "9"),
        ("sparsity.sparse_grad_comm", "true"),
        ("sparsity.async_masks", "true"),
    ]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    harness.run(2, job_run, straight, layout)
    # stop at done = 5: the resumed step 5 (done = 6 updates) must reduce dense
    harness.run(2, job_run, split, layout + [("train.exit_interval", "5")])
    harness.run(2, job_run, split, layout + [("checkpoint.resume", "latest")])
    # stop at done = 6: the update launched then is in flight, saved and installed after step 6
    again = str(tmp_path / "again")
    harness.run(2, job_run, again, layout + [("train.exit_interval", "6")])
    harness.run(2, job_run, again, layout + [("checkpoint.resume", "latest")])
    a, b = _rows(straight), _rows(split)
    assert a == _rows(again)
    dense = max(r["grad_comm_bytes"] for r in a)
    # done = 6 updates (async, installed after step 6): step 5 reduces dense, the rest packs
    assert [r["step"] for r in a if r["grad_comm_bytes"] == dense] == [2, 5, 8]
    assert a == b
