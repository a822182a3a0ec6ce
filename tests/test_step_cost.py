"""benchmarks/step_cost.py's counter: FLOPs equal torch.utils.flop_counter's, the bytes of a
known operator sequence equal the hand count, CUDA's multi_tensor_apply launches, and the
benchmark's sides counted at a tiny size (CI) and at issue 24's 1.92B configuration on the meta
device (slow tier)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import step_cost
from benchmarks.step_cost_count import CPU_FLASH, CudaLike, StepCounter, mta_launches
from meshspeed import models


def _ops(counter):
    return [(op.name, op.read, op.write, op.launches) for op in counter.ops]


def test_bytes_of_a_known_sequence_equal_the_hand_count():
    x = torch.randn(64, 32)
    bias = torch.randn(32)
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    with StepCounter("cpu") as c:
        y = x * 2  # reads 64*32*4, writes as much
        y.add_(1.0)  # in place: the storage read once and written once
        v = y.t()  # a view: nothing
        z = v.to(torch.bfloat16)  # a cast: reads fp32, writes bf16
        w = x + bias  # a broadcast operand is read once: 32 floats
        m = torch.mm(a, b)  # reads both operands, writes the product
        m.zero_()  # a fill writes only
        x.copy_(w)  # copy_ reads its source, writes its destination
        e = torch.empty(10)  # an allocation: nothing
    n = 64 * 32 * 4
    assert _ops(c) == [
        ("mul", n, n, 1),
        ("add_", n, n, 1),
        ("_to_copy", n, n // 2, 1),
        ("add", n + 32 * 4, n, 1),
        ("mm", (16 * 32 + 32 * 8) * 4, 16 * 8 * 4, 1),
        ("zero_", 0, 16 * 8 * 4, 1),
        ("copy_", n, n, 1),
    ]
    assert [op.cls for op in c.ops] == [
        "forward elementwise", "forward elementwise", "casts and copies", "forward elementwise",
        "matmul/attention", "fills", "casts and copies",
    ]  # fmt: skip
    assert c.ops[4].flops == 2 * 16 * 32 * 8
    del z, e


def test_a_reduction_to_another_dtype_counts_the_cast_aten_makes_first():
    g = torch.randn(4096)
    with StepCounter("cpu") as c:
        torch.linalg.vector_norm(g, dtype=torch.float64)
        torch.linalg.vector_norm(g.view(2, 2048), dim=1, dtype=torch.float32)  # same dtype: no copy
    (cast, plain) = c.ops
    assert (cast.read, cast.write, cast.launches) == (4096 * 4 + 4096 * 8, 4096 * 8 + 8, 2)
    assert (plain.read, plain.write, plain.launches) == (4096 * 4, 2 * 4, 1)


def test_flops_equal_torch_flop_counter_on_a_training_step():
    torch.manual_seed(0)
    model = models.build_model(models.get_preset("tiny", n_layers=2), seed=0)
    x = torch.randint(0, 64, (2, 32))
    ref = FlopCounterMode(display=False)
    with ref:
        models.cross_entropy_loss(model(x), x).backward()
    with StepCounter("cpu") as c:
        models.cross_entropy_loss(model(x), x).backward()
    # torch's table has no entry for the CPU flash attention: the same formula counts it here
    flash = sum(op.flops for op in c.ops if op.name in CPU_FLASH)
    assert c.totals()["flops"] - flash == ref.get_total_flops() > 0
    assert flash > 0


def test_cuda_like_attention_on_meta_is_flash_and_counts_as_on_the_cpu():
    q = torch.randn(2, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    counts = {}
    for dev in ("cpu", "meta"):
        t = q.detach().to(dev).requires_grad_()
        with StepCounter(dev) as c, CudaLike(flash=dev == "meta"):
            torch.nn.functional.scaled_dot_product_attention(t, t, t, is_causal=True).sum().backward()
        counts[dev] = {op.name.replace("_for_cpu", ""): op for op in c.ops if op.cls == "matmul/attention"}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        assert counts["meta"][name].flops == counts["cpu"][name].flops > 0
        # CUDA's forward also writes, and its backward reads, the dropout RNG's seed and offset
        for key in ("read", "write"):
            assert 0 <= getattr(counts["meta"][name], key) - getattr(counts["cpu"][name], key) <= 64


def test_multi_tensor_apply_launches():
    assert mta_launches([10] * 36) == 1
    assert mta_launches([10] * 37) == 2
    assert mta_launches([65536 * 320]) == 1
    assert mta_launches([65536 * 320 + 1]) == 2
    assert mta_launches([]) == 0


def _args(**kw):
    base = dict(device="cpu", preset="tiny", layers=2, dim=0, batch=2, seq_len=32)
    return argparse.Namespace(**{**base, **kw})


def test_sides_at_a_tiny_size_cpu_and_meta():
    """The counter runs each side's real step (the trainer's included) and the meta device
    models CUDA's kernels: the same FLOPs on both, the trainer's optimizer one launch per bucket."""
    pytest.importorskip("triton", reason="the meta side counts Triton kernels: triton is in the dev extra")
    out = {}
    for dev in ("cpu", "meta"):
        res = step_cost.run_sides(_args(device=dev, sides=["plain", "autocast", "eager", "zero1"]))
        out[dev] = res["sides"]
        for name, r in res["sides"].items():
            assert "error" not in r, (dev, name, r)
            assert r["predicted_ms"]["H200"] > 0
    for name in ("plain loop", "autocast loop", "meshspeed eager"):
        assert out["meta"][name]["flops"] == out["cpu"][name]["flops"] > 0
    eager = out["meta"]["meshspeed eager"]
    assert eager["launches_by_class"]["optimizer"] >= 1
    assert eager["by_class"]["gradient norm"] > 0
    assert out["meta"]["+ zero-1, dp 2"]["by_class"]["communication"] > 0
    # pure bf16 state moves fewer optimizer bytes than fp32 masters and moments
    assert out["meta"]["plain loop"]["by_class"]["optimizer"] < eager["by_class"]["optimizer"]


def test_fused_kernels_and_2_4_count_on_meta():
    """The two feature sides count on the meta device (they were gaps): fused kernels move no more
    bytes outside matmul/attention than eager, in fewer launches; 2:4 runs its products on
    cuSPARSELt (counted at half the FLOPs) and compresses its weights: a side silently run dense
    would have eager's FLOPs and no compression."""
    pytest.importorskip("triton", reason="the meta side counts Triton kernels: triton is in the dev extra")
    res = step_cost.run_sides(_args(device="meta", sides=["eager", "fused", "sparse"]))
    s = res["sides"]
    for name, r in s.items():
        assert "error" not in r, (name, r)
        assert r["predicted_ms"]["H200"] > 0
    mm = "matmul/attention"
    eager, fused, sparse = s["meshspeed eager"], s["+ fused kernels"], s["+ 2:4"]
    assert fused["bytes"] - fused["by_class"][mm] <= eager["bytes"] - eager["by_class"][mm]
    assert fused["launches"] < eager["launches"]
    fused_ops = res["ops"]["+ fused kernels"][0].ops
    assert any(op.name.startswith("triton:") and op.cls != "optimizer" for op in fused_ops)
    assert 0 < sparse["flops"] < eager["flops"]
    ops = res["ops"]["+ 2:4"][0].ops
    assert sum(op.write for op in ops if op.name == "triton:mask_and_compress") > 0
    assert any(op.name == "_cslt_sparse_mm" and op.flops > 0 for op in ops)


@pytest.mark.slow  # ~1-4 minutes: the 1.92B configuration on the meta device, every side
def test_the_benchmark_at_issue_24s_configuration_on_meta(capsys):
    out = step_cost.main(["--parent", "none"])
    s = out["sides"]
    assert abs(s["plain loop"]["predicted_ms"]["H200"] - step_cost.MEASURED_H200["plain loop"]) < 2
    assert s["meshspeed eager"]["flops"] == s["plain loop"]["flops"]
    assert "issue 40 item 2" in capsys.readouterr().out


def _old_power_sum(g, p):  # grad_norm._power_sum before the zeros and the first add were dropped
    from meshspeed.parallel import grad_norm as gn

    g = g.reshape(-1)
    dtype = torch.float32 if g.dtype in (torch.float16, torch.bfloat16, torch.float32) else g.dtype
    rows = g.numel() // gn.ROW
    total = torch.zeros((), dtype=torch.float64)
    if rows:
        part = torch.linalg.vector_norm(g[: rows * gn.ROW].view(rows, gn.ROW), p, dim=1, dtype=dtype)
        total = total + part.to(torch.float64).pow_(p).sum()
    if g.numel() > rows * gn.ROW:
        total = total + torch.linalg.vector_norm(g[rows * gn.ROW :], p, dtype=torch.float64) ** p
    return total


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_gradient_norm_without_its_zeros_is_bitwise_the_old_one(p):
    """The step-cost model found two launches per bucket in the gradient norm that add 0.0 (a
    zeros and its add): dropped, the norm is the same bits (0.0 + s is s for s >= 0, NaN, inf)."""
    from meshspeed import comm
    from meshspeed.parallel import grad_norm as gn

    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, gn.ROW, gn.ROW + 3, 5 * gn.ROW - 1, 3 * gn.ROW, 0]
    grads = [torch.randn(n, generator=gen) * torch.logspace(-4, 2, n) for n in sizes]
    grads.append(torch.tensor([float("nan"), 1.0]))
    for g in grads:
        assert torch.equal(gn._power_sum(g, p), _old_power_sum(g, p)) or (
            gn._power_sum(g, p).isnan() and _old_power_sum(g, p).isnan()
        )
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes[:-1]]
    for q, g in zip(params, grads):
        q.grad = g
    mesh = comm.ParallelDims().build(comm.init(device="cpu"))
    old = torch.zeros((), dtype=torch.float64)
    for g in grads[:-2]:
        old = old + _old_power_sum(g, p)
    assert torch.equal(gn.grad_norm(params, mesh, p), (old ** (1.0 / p)).float())
    with StepCounter("cpu") as c:
        gn.grad_norm(params[2:3], mesh, p)  # whole rows, no tail
    assert [op.name for op in c.ops if op.name in ("zeros", "add")] == []
