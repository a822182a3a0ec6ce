"""Sparse gradient communication against references that do not go through its packing plan.

The layout tests in tests/train/test_sparsity_comm.py compare the packed reduction with
`pack=False`, which masks with the plan's own `keep`: a plan that keeps the wrong entries (or an
old plan after the masks changed) agrees with itself there. Here the expectation is built from
the masks alone, by parameter name:
- unit: several buckets (some without masks), uneven unstructured masks (ZeRO-2 chunks hold
  different counts), a 3-D stacked weight, and the masks changed in place between two
  reductions (`masks_changed()`): every parameter's reduced gradient equals the mean over ranks
  of its single-device gradient times its current mask, and the bytes sent equal the kept
  entries (ZeRO-2: dp slots of the fullest chunk), counted from the masks;
- trainer: across mask updates, every step that packs leaves exactly zero gradient where the
  current mask is off and the dense gradient's non-zeros where it is on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.sparse_comm import SparseGradComm
from tests import harness


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 40)
        self.experts = nn.Parameter(torch.randn(3, 40, 12) * 0.1)  # [E, in, out] stacked weights
        self.b = nn.Linear(12, 24)
        self.c = nn.Linear(24, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))  # [n, 40]
        h = torch.einsum("ni,eio->no", h, self.experts)
        return self.c(torch.tanh(self.b(h)))


MASKED = ("a.weight", "experts", "c.weight")


def _loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every rank and step its own batch
    return model(torch.randn(6, 16, generator=g)).square().mean()


def _masks(params: dict, seed: int) -> dict[str, torch.Tensor]:
    """Unstructured masks of a different density per weight (and along it), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for j, name in enumerate(MASKED):
        p = params[name]
        density = torch.linspace(0.1, 0.9, p.numel()).view(p.shape).roll(7 * j + seed)
        out[name] = torch.rand(p.shape, generator=g) < density
    return out


def job_reference(ctx, zero: int) -> list[str]:
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    model = Net()
    ref = copy.deepcopy(model)
    # ~1.5 KB buckets: the parameters spread over several, the masked ones among unmasked ones
    dp, _ = build_data_parallel(model, mesh, zero=zero, dtype=torch.float32, lr=1e-2, bucket_mb=0.0015)
    live = _masks(dp.params, 0)
    sgc = SparseGradComm(dp, live)
    sgc.active = True
    bad = [] if len(dp.buckets) >= 3 else [f"{len(dp.buckets)} bucket(s): the test wants several"]
    for step in range(2):
        if step:  # new masks, written into the same buffers the comm holds
            for name, m in _masks(dp.params, 5).items():
                live[name].copy_(m)
            sgc.masks_changed()
        before = dp.stats["grad_comm_bytes"]
        dp.zero_grad()
        _loss(model, ctx.rank, step).backward()
        dp.finish_grad_sync()
        sent = dp.stats["grad_comm_bytes"] - before
        want = _mean_masked_grads(ref, live, ctx.world_size, step)
        bad += [f"step {step}: {b}" for b in _compare(dp, want)]
        expected = _expected_bytes(dp, live, ctx.world_size)
        if sent != expected:
            bad.append(f"step {step}: sent {sent} B, the masks keep {expected} B")
    return bad


def _mean_masked_grads(ref, masks, world: int, step: int) -> dict[str, torch.Tensor]:
    """The plain computation: every rank's batch on one model, averaged, then masked."""
    grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):
        ref.zero_grad()
        _loss(ref, r, step).backward()
        for n, p in ref.named_parameters():
            grads[n] += p.grad / world
    return {n: g * masks[n] if n in masks else g for n, g in grads.items()}


def _compare(dp, want: dict) -> list[str]:
    """Each parameter's reduced gradient (its part of this rank's shard under ZeRO-2), by name."""
    bad = []
    for name, w in want.items():
        s = dp.slots[name]
        lo, hi = dp.dp_shard(s.bucket) if dp.zero >= 2 else (0, dp.specs[s.bucket].numel)
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b:
            continue
        got = dp.reduced_grad(s.bucket, a, b)
        exp = w.reshape(-1)[a - s.offset : b - s.offset]
        if not torch.allclose(got, exp, rtol=1e-5, atol=1e-7):
            wrong = int(((got - exp).abs() > 1e-6 + 1e-5 * exp.abs()).sum())
            bad.append(f"{name}: {wrong} of {b - a} entries differ from the masked mean")
    return bad


def _expected_bytes(dp, masks, world: int) -> int:
    """Float32 values sent, from the masks: every kept entry (all of an unmasked parameter in a
    bucket with masks; a bucket without any goes dense); a reduce-scatter sends dp equal slots
    as long as the bucket's fullest 1/dp chunk."""
    total = 0
    for spec in dp.specs:
        if not any(s.name in masks for s in spec.slots):
            total += spec.numel  # no mask: the dense collective, padding and all
            continue
        keep = torch.zeros(spec.numel, dtype=torch.bool)
        for s in spec.slots:
            keep[s.offset : s.offset + s.numel] = masks[s.name].flatten() if s.name in masks else True
        if dp.zero >= 2:
            total += world * int(keep.view(world, -1).sum(1).max())
        else:
            total += int(keep.sum())
    return 4 * total


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_packed_reduction_equals_the_masked_mean_across_a_mask_change(ws, zero):
    assert harness.run(ws, job_reference, zero) == [[]] * ws
