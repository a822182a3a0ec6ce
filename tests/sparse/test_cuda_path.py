"""Which matmul path a layer takes and why: decision logic on CPU, the real kernels when CUDA is there."""

import pytest
import torch
from torch import nn

from meshspeed.sparse import SparseLinear, SparsityConfig, decide_path, nm_mask, report, report_rows, sparsify
from meshspeed.sparse.cuda import DENSE, DENSE_MASKED, SPARSE, SPARSE_FWD, min_tile

BASE = dict(
    nm=(2, 4), transposable=True, enabled=True, use_kernels=True, device_type="cuda", capability=(9, 0),
    dtype=torch.bfloat16, out_features=256, in_features=512, backend="cutlass",
)


def _d(**kw):
    return decide_path(**{**BASE, **kw})


def test_full_sparse_path():
    assert _d() == (SPARSE, "")
    assert _d(backend="cusparselt", dtype=torch.float16, out_features=48, in_features=80) == (SPARSE, "")


@pytest.mark.parametrize(
    "kw,path,reason",
    [
        (dict(device_type="cpu"), DENSE_MASKED, "no CUDA"),
        (dict(capability=(7, 5)), DENSE_MASKED, "below sm80"),
        (dict(dtype=torch.float32), DENSE_MASKED, "dtype float32 not bf16/fp16"),
        (dict(in_features=100), DENSE_MASKED, "in_features 100 not a multiple of 64"),
        (dict(out_features=48), DENSE_MASKED, "out_features 48 not a multiple of 32"),
        (dict(in_features=100, backend="cusparselt"), DENSE_MASKED, "in_features 100 not a multiple of 16"),
        (dict(nm=None), DENSE_MASKED, "unstructured pattern"),
        (dict(nm=(1, 4)), DENSE_MASKED, "pattern 1:4 has no sparse kernel"),
        (dict(use_kernels=False), DENSE_MASKED, "use_sparse_kernels=false"),
        (dict(input_dtype=torch.float32), DENSE_MASKED, "input dtype float32"),
        (dict(plain_weight=False), DENSE_MASKED, "tensor subclass"),
        (dict(enabled=False), DENSE, "layer dense"),
        (dict(transposable=False), SPARSE_FWD, "mask not transposable"),
        (dict(out_features=96), SPARSE_FWD, "W^T out_features 96 not a multiple of 64"),
    ],
)
def test_reasons(kw, path, reason):
    got = _d(**kw)
    assert got.path == path and reason in got.reason, got


def test_min_tile_reads_torch_tables():
    assert min_tile("cutlass", torch.bfloat16) == (32, 64)
    assert min_tile("cusparselt", torch.float16) == (16, 16)


def test_layer_and_report_name_their_path():
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8))
    sparsify(model, SparsityConfig(pattern="2:4"))
    model(torch.randn(2, 16))
    if not torch.cuda.is_available():
        assert model[0].path == DENSE_MASKED and model[0].path_reason == "no CUDA"
    rows = report_rows(model)
    assert [r["name"] for r in rows] == ["0", "1"]
    assert all(abs(r["sparsity"] - 0.5) < 1e-9 for r in rows)
    table = report(model)
    assert "no CUDA" in table or torch.cuda.is_available()
    assert table.splitlines()[0].split()[:3] == ["name", "shape", "pattern"]


needs_sm80 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="2:4 sparse kernels need a CUDA GPU with sm80+",
)


@needs_sm80
@pytest.mark.parametrize("transposable", [True, False])
def test_cuda_sparse_kernels_match_dense_masked(transposable):
    torch.manual_seed(0)
    layer = SparseLinear(256, 128, nm=(2, 4), transposable=transposable, device="cuda", dtype=torch.bfloat16)
    from meshspeed.sparse import transposable_2to4_mask

    layer.set_mask(transposable_2to4_mask(layer.weight) if transposable else nm_mask(layer.weight, 2, 4))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert layer.path == (SPARSE if transposable else SPARSE_FWD), layer.path_reason
    y.float().square().sum().backward()
    wm = (layer.weight.detach() * layer.mask).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y_ref = nn.functional.linear(xr, wm, layer.bias.detach())
    y_ref.float().square().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, xr.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(layer.weight.grad, wm.grad, rtol=2e-2, atol=5e-2)
    layer(x)
    assert layer._compressed.rebuilds == 1  # same weight and mask: compression reused
