"""The gradient norm's per-bucket sum of powers: one float32 pass over the bucket in rows, the
rows' powers summed in float64 (no float64 copy of the bucket), as close to the exact float64
sum as a float32 row norm allows, for every length (whole rows, a tail, a tail alone)."""

from __future__ import annotations

import pytest
import torch

from meshspeed.parallel import grad_norm as gn


@pytest.mark.parametrize("n", [1, 7, gn.ROW, gn.ROW + 3, 5 * gn.ROW - 1, 3 * gn.ROW])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_power_sum_is_the_float64_sum_to_float32_row_precision(n, p):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-4, 2, n)
    exact = g.double().abs().pow(p).sum()
    got = gn._power_sum(g, p)
    assert got.dtype == torch.float64
    assert abs(got.item() - exact.item()) <= 1e-6 * exact.item(), (got.item(), exact.item())


def test_low_precision_gradients_are_summed_in_float32_rows():
    g = torch.randn(2 * gn.ROW + 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = g.double().square().sum()
    assert abs(gn._power_sum(g, 2.0).item() - exact.item()) <= 1e-6 * exact.item()


def test_no_float64_copy_of_a_float32_bucket():
    """The point of it: ATen's vector_norm(dtype=float64) casts the whole input first; the rows
    are reduced from the float32 bucket itself (the float64 work is one value per row)."""
    g = torch.randn(8 * gn.ROW)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        gn._power_sum(g, 2.0)
    casts = [e for e in prof.events() if e.name in ("aten::_to_copy", "aten::copy_") and e.input_shapes
             and e.input_shapes[0] and e.input_shapes[0][0] >= g.numel()]  # fmt: skip
    assert not casts, [(e.name, e.input_shapes) for e in casts]
