"""SparseLinear against the oracle: the dense computation on the masked weight, forward and grads."""

import pytest
import torch
from torch import nn

from meshspeed.sparse import SparseLinear, SparseLinearFunction, nm_mask, topk_mask, transposable_2to4_mask
from meshspeed.sparse.cuda import CompressedWeight
from meshspeed.sparse.linear import _Compressed


def _layer(in_f=16, out_f=12, bias=True, lam=0.0, dtype=torch.float64, nm=(2, 4), seed=0):
    torch.manual_seed(seed)
    layer = SparseLinear(in_f, out_f, bias=bias, nm=nm, sr_ste_lambda=lam, dtype=dtype)
    mask = nm_mask(layer.weight, *nm) if nm else topk_mask(layer.weight, 0.7)
    layer.set_mask(mask)
    return layer


def _oracle(layer, x, g):
    """Plain autograd on W~ = W * mask (a leaf), then STE says grad_W = grad_W~."""
    wm = (layer.weight.detach() * layer.mask).requires_grad_()
    b = layer.bias.detach().clone().requires_grad_() if layer.bias is not None else None
    xr = x.detach().clone().requires_grad_()
    y = nn.functional.linear(xr, wm, b)
    y.backward(g)
    return y, xr.grad, wm.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("nm", [(2, 4), (1, 4), None])
def test_forward_and_grads_match_masked_dense(dtype, bias, nm):
    layer = _layer(bias=bias, dtype=dtype, nm=nm)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 5, 12, dtype=dtype)
    y = layer(x)
    y.backward(g)
    y_ref, gx, gw, gb = _oracle(layer, x, g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(layer.weight.grad, gw)  # STE: dense weight gets W~'s gradient
    assert layer.weight.grad[~layer.mask].abs().sum() > 0  # ...at pruned positions too (RigL reads it)
    if bias:
        torch.testing.assert_close(layer.bias.grad, gb)


def test_sr_ste_decay_matches_formula():
    lam = 0.37
    layer = _layer(lam=lam)
    x = torch.randn(7, 16, dtype=torch.float64)
    g = torch.randn(7, 12, dtype=torch.float64)
    layer(x).backward(g)
    _, _, gw, _ = _oracle(layer, x, g)
    expected = gw + lam * (~layer.mask) * layer.weight.detach()
    torch.testing.assert_close(layer.weight.grad, expected)
    # decay only touches pruned weights
    torch.testing.assert_close(layer.weight.grad[layer.mask], gw[layer.mask])


def test_dense_mask_runs_plain_linear():
    layer = _layer()
    layer.set_mask(torch.ones_like(layer.mask))
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.path == "dense"


def test_set_mask_validates_pattern():
    layer = _layer()
    bad = torch.zeros_like(layer.mask)
    bad[:, 0] = True
    with pytest.raises(ValueError, match="not 2:4"):
        layer.set_mask(bad)
    with pytest.raises(ValueError, match="mask shape"):
        layer.set_mask(torch.ones(3, 3, dtype=torch.bool))


def test_autocast_cpu_bf16_keeps_param_dtypes():
    layer = _layer(dtype=torch.float32)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = nn.functional.linear(x, layer.weight * layer.mask, layer.bias)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


def test_state_dict_roundtrip_keeps_mask():
    a, b = _layer(seed=0), _layer(seed=1)
    assert not torch.equal(a.mask, b.mask)
    assert set(a.state_dict()) == {"weight", "bias", "mask"}
    version = b.mask_version
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.mask, b.mask) and b.mask_version > version
    x = torch.randn(2, 16, dtype=torch.float64)
    torch.testing.assert_close(a(x), b(x))


def test_compressed_path_plumbing_with_fake_kernels():
    """The CUDA branch's Function wiring, with an identity 'compression' so it runs on CPU."""
    torch.manual_seed(0)
    layer = SparseLinear(16, 8, nm=(2, 4), transposable=True, dtype=torch.float64)
    layer.set_mask(transposable_2to4_mask(layer.weight))
    cache = CompressedWeight(compress=lambda t: t.clone())
    w, wt = cache.get(layer.weight, layer.mask, layer.mask_version, torch.float64, True)
    torch.testing.assert_close(wt, w.t())
    assert (w[~layer.mask] == 0).all() and torch.equal(w[layer.mask], layer.weight.detach()[layer.mask])
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 8, dtype=torch.float64)
    y = SparseLinearFunction.apply(x, layer.weight, layer.bias, layer.mask, 0.0, None, _Compressed(w, wt))
    y.backward(g)
    y_ref, gx, gw, gb = _oracle(layer, x, g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(layer.weight.grad, gw)
    torch.testing.assert_close(layer.bias.grad, gb)


def test_compressed_cache_rebuilds_only_on_change():
    layer = _layer(dtype=torch.float32)
    calls = []
    cache = CompressedWeight(compress=lambda t: calls.append(1) or t.clone())
    get = lambda: cache.get(layer.weight, layer.mask, layer.mask_version, torch.float32, False)  # noqa: E731
    get(), get()
    assert cache.rebuilds == 1 and len(calls) == 1
    with torch.no_grad():
        layer.weight.add_(1.0)  # optimizer-style in-place update bumps weight._version
    get()
    assert cache.rebuilds == 2
    layer.set_mask(nm_mask(torch.randn(12, 16), 2, 4))
    get(), get()
    assert cache.rebuilds == 3
    w, wt = get()
    torch.testing.assert_close(w, layer.weight.detach() * layer.mask)
    assert wt is None


def test_mask_change_between_forward_and_backward_is_caught():
    layer = _layer()
    y = layer(torch.randn(2, 16, dtype=torch.float64))
    layer.set_mask(nm_mask(torch.randn(12, 16), 2, 4))
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()
