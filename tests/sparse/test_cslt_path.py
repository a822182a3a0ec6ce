"""SparseLinear on the cuSPARSELt path, driven on CPU by the plain-torch stand-in of torch's
_cslt ops (the same compressed layout, the same operand contract): forward and gradients against
the dense computation on the masked weight, what is compressed when, and that activations reach
the product without a copy."""

import pytest
import torch
from torch import nn

from meshspeed.sparse import SparseLinear, nm_mask, transposable_2to4_mask
from meshspeed.sparse import choice as kc
from meshspeed.sparse.cslt_ops import ReferenceCsltOps
from meshspeed.sparse.cuda import DENSE_MASKED, SPARSE, SPARSE_DGRAD, SPARSE_FWD, invalidate_compressed


class _Ops(ReferenceCsltOps):
    """The stand-in, also recording the storage each product's dense operand lives in."""

    def __init__(self):
        super().__init__()
        self.operands = []

    def mm(self, compressed, dense_b, bias, alg_id):
        self.operands.append((dense_b.data_ptr(), dense_b.t().is_contiguous()))
        return super().mm(compressed, dense_b, bias, alg_id)


def _layer(mode="sparse", transposable=True, bias=True, seed=0, timer=None, monkeypatch=None):
    torch.manual_seed(seed)
    layer = SparseLinear(128, 64, bias=bias, transposable=transposable, dtype=torch.bfloat16)
    layer.set_mask(transposable_2to4_mask(layer.weight) if transposable else nm_mask(layer.weight, 2, 4))
    layer.cslt_ops, layer.kernel_mode = _Ops(), mode
    return layer


# injected timings (ms): y wins on 2:4, dX loses; preparing operands costs little
_MS = {"sparse_fwd": 0.5, "sparse_dgrad": 5.0, "dense_fwd": 1.0, "dense_dgrad": 1.0}


@pytest.fixture(autouse=True)
def _fresh_chooser(monkeypatch):
    monkeypatch.setattr(kc, "CHOOSER", kc.Chooser(lambda name, fn, dev: _MS.get(name, 0.01)))


def _oracle(layer, x, g):
    """float32 autograd on W~ = W * mask (STE: grad_W = grad_W~)."""
    wm = (layer.weight.detach() * layer.mask).float().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().float().requires_grad_()
    xr = x.detach().float().requires_grad_()
    y = nn.functional.linear(xr, wm, b)
    y.backward(g.float())
    return y, xr.grad, wm.grad, None if b is None else b.grad


def _close(got, ref, what):
    # one bf16 rounding of a float32-accumulated result (plus the input's cast): 2^-7 relative
    err = (got.float() - ref).abs()
    bound = 2.0**-7 * ref.abs() + 1e-2
    assert (err <= bound).all(), f"{what}: off by up to {(err / bound).max():.2f}x the bf16 bound"


@pytest.mark.parametrize("bias", [True, False])
def test_sparse_products_match_the_masked_dense_oracle(bias):
    layer = _layer(bias=bias)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert layer.path == SPARSE and layer.path_reason == ""
    y.backward(g)
    y_ref, gx, gw, gb = _oracle(layer, x, g)
    _close(y, y_ref, "forward")
    _close(x.grad, gx, "input gradient")
    _close(layer.weight.grad, gw, "weight gradient (dense, STE)")
    if bias:
        _close(layer.bias.grad, gb, "bias gradient")
    ops = layer.cslt_ops
    mms = [c for c in ops.calls if c[0] == "mm"]
    # y = (W~ [64 x 128] @ x^T [128 x 16])^T, dX = (W~^T [128 x 64] @ dY^T [64 x 16])^T, searched algorithm
    assert mms == [("mm", 64, 128, 16, 3), ("mm", 128, 64, 16, 3)]
    # both dense operands are the activations themselves, read transposed in place
    assert ops.operands[0] == (x.data_ptr(), True)
    assert ops.operands[1][1] is True


def test_compression_once_per_step_shared_by_micro_batches():
    layer = _layer()
    ops = layer.cslt_ops
    for _ in range(3):  # three micro-batches of one step
        layer(torch.randn(16, 128, dtype=torch.bfloat16)).sum().backward()
    assert [c for c in ops.calls if c[0] == "compress"][-1:] == [("compress", (64, 128), True, True)]
    assert layer._compressed.rebuilds == 1
    invalidate_compressed(layer)  # what the trainer does after each optimizer step
    layer(torch.randn(16, 128, dtype=torch.bfloat16))
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # an in-place write is seen without invalidation too
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    y = layer(x)
    assert layer._compressed.rebuilds == 3
    _close(y, _oracle(layer, x, torch.zeros(16, 64))[0], "forward after the weight changed")


def test_measured_choice_places_each_product():
    """The injected timings make y 2x faster and dX 5x slower on 2:4: y sparse, dX dense-masked
    from the cached W~, W^T never compressed."""
    layer = _layer(mode="auto")
    x = torch.randn(16, 128, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(16, 64, dtype=torch.bfloat16)
    layer(x).backward(g)
    assert layer.path == SPARSE_FWD and "input gradient dense-masked: auto" in layer.path_reason
    assert [c[1:3] for c in layer.cslt_ops.calls if c[0] == "mm"][-1:] == [(64, 128)]  # the forward only
    assert layer._compressed.wt is None and layer._compressed.wm is not None
    _, gx, _, _ = _oracle(layer, x, g)
    _close(x.grad, gx, "input gradient (dense-masked)")


def test_forced_dense_and_dgrad_only():
    layer = _layer(mode="dense")
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    y = layer(x)
    assert (layer.path, layer.path_reason) == (DENSE_MASKED, "sparsity.kernels=dense")
    assert not [c for c in layer.cslt_ops.calls if c[0] in ("mm", "compress")]
    assert torch.equal(y, nn.functional.linear(x, layer.weight * layer.mask, layer.bias))
    kc.CHOOSER.timer = lambda name, fn, dev: {**_MS, "sparse_fwd": 5.0, "sparse_dgrad": 0.2}.get(name, 0.01)
    layer = _layer(mode="auto")
    layer(x)
    assert layer.path == SPARSE_DGRAD and "forward dense-masked" in layer.path_reason


def test_what_the_kernels_cannot_take_runs_dense_masked():
    layer = _layer(transposable=False)  # row-only 2:4: no W^T kernel
    layer(torch.randn(16, 128, dtype=torch.bfloat16))
    assert layer.path == SPARSE_FWD and "mask not transposable" in layer.path_reason
    assert {c for c in layer.cslt_ops.calls if c[0] == "compress"} == {("compress", (64, 128), True, False)}
    layer = _layer()
    x = torch.randn(5, 128, dtype=torch.bfloat16)  # 5 tokens: cuSPARSELt takes multiples of 8
    y = layer(x)
    assert layer.path == DENSE_MASKED and "5 tokens" in layer.path_reason
    _close(y, _oracle(layer, x, torch.zeros(5, 64))[0], "forward")
