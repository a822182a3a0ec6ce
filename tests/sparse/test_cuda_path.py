"""Which matmul path a layer takes and why: decision logic on CPU, the real kernels when CUDA is there."""

import pytest
import torch
from torch import nn

from meshspeed.sparse import SparseLinear, SparsityConfig, decide_path, nm_mask, report, report_rows, sparsify
from meshspeed.sparse.cuda import DENSE, DENSE_MASKED, SPARSE, SPARSE_FWD, min_tile

BASE = dict(
    nm=(2, 4),
    transposable=True,
    enabled=True,
    use_kernels=True,
    device_type="cuda",
    capability=(9, 0),
    dtype=torch.bfloat16,
    out_features=256,
    in_features=512,
    backend="cutlass",
)


def _d(**kw):
    return decide_path(**{**BASE, **kw})


def test_full_sparse_path():
    assert _d() == (SPARSE, "")
    assert _d(backend="cusparselt", dtype=torch.float16, out_features=48, in_features=80) == (SPARSE, "")


@pytest.mark.parametrize(
    "kw,path,reason",
    [
        (dict(device_type="cpu"), DENSE_MASKED, "weight on cpu: 2:4 kernels need CUDA"),
        (dict(device_type="xpu"), DENSE_MASKED, "weight on xpu: 2:4 kernels need CUDA"),
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
    """Built on the CPU, the layers take the dense-masked path on every machine (the weight's
    device decides, GPU present or not), and the report shows each layer's own path and reason."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8))
    sparsify(model, SparsityConfig(pattern="2:4"))
    model(torch.randn(2, 16))
    for layer in model:
        assert layer.path == DENSE_MASKED and layer.path_reason == "weight on cpu: 2:4 kernels need CUDA"
    rows = report_rows(model)
    assert [r["name"] for r in rows] == ["0", "1"]
    assert all(abs(r["sparsity"] - 0.5) < 1e-9 for r in rows)
    table = report(model)
    assert table.splitlines()[0].split()[:3] == ["name", "shape", "pattern"]
    assert table.count("weight on cpu: 2:4 kernels need CUDA") == 2, table


needs_sm80 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="2:4 sparse kernels need a CUDA GPU with sm80+",
)


# bf16 keeps 8 significant bits: rounding a result to bf16 moves it by at most 2^-8 of itself.
_BF16_U = 2.0**-8
_FP32_U = 2.0**-24


def _bf16_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, extra: torch.Tensor | None = None):
    """Elementwise bound on |bf16 result - fp32 reference| for ref = a @ b (+ extra) from bf16
    inputs: at most two roundings to bf16 (the product, then the bias add) plus fp32
    accumulation over k = a.shape[-1] terms (doubled for a kernel's summation order). A wrong
    mask moves an output by a whole |w_ij x_j| term, ~1/sqrt(k) of it: far outside this bound."""
    k = a.shape[-1]
    mag = a.float().abs() @ b.float().abs()
    size = ref.abs() + (extra.float().abs() if extra is not None else 0)
    return 2 * _BF16_U * size + 2 * k * _FP32_U * mag + 1e-30


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.float() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error up to {worst:.2f}x the bf16 bound derived from the shapes"


@needs_sm80
@pytest.mark.parametrize("transposable", [True, False])
def test_cuda_sparse_kernels_match_dense_masked(transposable):
    torch.manual_seed(0)
    layer = SparseLinear(256, 128, nm=(2, 4), transposable=transposable, device="cuda", dtype=torch.bfloat16)
    from meshspeed.sparse import transposable_2to4_mask

    layer.set_mask(transposable_2to4_mask(layer.weight) if transposable else nm_mask(layer.weight, 2, 4))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)  # the same upstream gradient for both
    y = layer(x)
    assert layer.path == (SPARSE if transposable else SPARSE_FWD), layer.path_reason
    y.backward(g)
    wm = (layer.weight.detach() * layer.mask).float()  # [out, in], what the forward must multiply by
    xf, gf, b = x.detach().float(), g.float(), layer.bias.detach()
    y_ref = xf @ wm.t() + b.float()
    _assert_within(y, y_ref, _bf16_bound(x.detach(), wm.t(), y_ref, b), "forward")
    gx_ref = gf @ wm
    _assert_within(x.grad, gx_ref, _bf16_bound(g, wm, gx_ref), "input gradient")
    gw_ref = gf.t() @ xf  # STE: the dense gradient, mask not applied
    _assert_within(layer.weight.grad, gw_ref, _bf16_bound(g.t(), x.detach(), gw_ref), "weight gradient")
    layer(x)
    assert layer._compressed.rebuilds == 1  # same weight and mask: compression reused


@needs_sm80
def test_cuda_compressed_weight_follows_writes_through_a_bucket_view():
    """What data parallelism does: the weight's storage is a view of a flat bucket, updated in
    place through the bucket (weight._version does not move); invalidate_compressed after the
    step makes the next forward use the new weights."""
    from meshspeed.sparse.cuda import invalidate_compressed

    torch.manual_seed(0)
    layer = SparseLinear(256, 128, nm=(2, 4), transposable=True, device="cuda", dtype=torch.bfloat16)
    flat = torch.zeros(layer.weight.numel(), device="cuda", dtype=torch.bfloat16)
    flat.copy_(layer.weight.detach().reshape(-1))
    layer.weight.data = flat.view_as(layer.weight)
    from meshspeed.sparse import transposable_2to4_mask

    layer.set_mask(transposable_2to4_mask(layer.weight))
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        flat.mul_(-1.0)  # an "optimizer step" through the bucket
        assert invalidate_compressed(layer) == 1
        y = layer(x)
    wm = (layer.weight.detach() * layer.mask).float()
    y_ref = x.float() @ wm.t() + layer.bias.detach().float()
    _assert_within(y, y_ref, _bf16_bound(x, wm.t(), y_ref, layer.bias.detach()), "forward after the step")


@needs_sm80
@pytest.mark.parametrize("mode", ["auto", "sparse", "dense"])
def test_cuda_measured_choice_keeps_the_numbers(mode):
    """Whatever the measurement places where (cuSPARSELt where torch has it), y, dX and dW match
    the dense computation on the masked weight, and the choice is recorded with its timings."""
    from meshspeed.sparse import transposable_2to4_mask
    from meshspeed.sparse.choice import kernel_choices

    torch.manual_seed(1)
    layer = SparseLinear(1024, 512, nm=(2, 4), transposable=True, device="cuda", dtype=torch.bfloat16)
    layer.set_mask(transposable_2to4_mask(layer.weight))
    layer.kernel_mode, layer.name = mode, "probe"
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(g)
    y = layer(x.detach())
    wm = (layer.weight.detach() * layer.mask).float()
    xf, gf, b = x.detach().float(), g.float(), layer.bias.detach()
    y_ref = xf @ wm.t() + b.float()
    _assert_within(y, y_ref, _bf16_bound(x.detach(), wm.t(), y_ref, b), "forward")
    gx_ref = gf @ wm
    _assert_within(x.grad, gx_ref, _bf16_bound(g, wm, gx_ref), "input gradient")
    gw_ref = gf.t() @ xf
    _assert_within(layer.weight.grad, gw_ref, _bf16_bound(g.t(), x.detach(), gw_ref), "weight gradient")
    if torch.backends.cusparselt.is_available():
        record = kernel_choices(torch.nn.ModuleDict({"probe": layer}))["probe"]
        assert record["mode"] == mode and record["dW"] == "dense"
        if mode == "dense":
            assert (record["y"], record["dX"]) == ("dense", "dense")
        elif mode == "sparse":
            assert (record["y"], record["dX"]) == ("sparse", "sparse")
        else:
            assert set(record["ms"]) >= {"dense_fwd", "sparse_fwd", "compress_both"}
