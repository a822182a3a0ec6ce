"""Triton RMSNorm and SwiGLU against their torch references, forward and backward.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before the
first kernel is built), so every CI run checks them; with CUDA they run compiled on the GPU.
Tolerances: float32 1e-5 relative (+1e-6 absolute); bfloat16 2e-2 relative (+2e-2 absolute):
the kernels round once, the reference twice (see kernels/fused.py).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e .[dev]")

from meshspeed.kernels.fused import (  # noqa: E402
    rms_norm_fused,
    rms_norm_ref,
    swiglu_fused,
    swiglu_ref,
    triton_usable,
)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rnd(seed, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _grads(fn, *inputs, g):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


def _assert_close(got, want, dtype, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    err = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got.float(), want.float(), **TOL[dtype]), f"{what}: max err {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96])  # 96: not a power of two, the masked lanes matter
def test_rms_norm_matches_reference(dtype, dim):
    x = _rnd(1, 2, 5, dim, dtype=dtype) * 3
    w = 1 + 0.1 * _rnd(2, dim, dtype=dtype)
    g = _rnd(3, 2, 5, dim, dtype=dtype)
    want, (wdx, wdw) = _grads(lambda a, b: rms_norm_ref(a, b, 1e-5), x, w, g=g)
    got, (dx, dw) = _grads(lambda a, b: rms_norm_fused(a, b, 1e-5), x, w, g=g)
    _assert_close(got, want, dtype, "rms_norm out")
    _assert_close(dx, wdx, dtype, "rms_norm dx")
    _assert_close(dw, wdw, dtype, "rms_norm dweight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(dtype):
    # 3 × 7 × 100 = 2100 elements: two full blocks of 1024 and a masked tail.
    a, b = _rnd(4, 3, 7, 100, dtype=dtype) * 4, _rnd(5, 3, 7, 100, dtype=dtype)
    g = _rnd(6, 3, 7, 100, dtype=dtype)
    want, (wda, wdb) = _grads(swiglu_ref, a, b, g=g)
    got, (da, db) = _grads(swiglu_fused, a, b, g=g)
    _assert_close(got, want, dtype, "swiglu out")
    _assert_close(da, wda, dtype, "swiglu dgate")
    _assert_close(db, wdb, dtype, "swiglu dup")


def test_unusable_device_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = triton_usable("cpu")
    assert not ok and "TRITON_INTERPRET=1" in why
    with pytest.raises(RuntimeError, match="train.fused_kernels=false"):
        rms_norm_fused(torch.ones(2, 4), torch.ones(4))


def test_model_with_fused_kernels_matches_reference_model():
    from meshspeed.models import build_model, cross_entropy_loss, get_preset
    from meshspeed.models.layers import set_fused_kernels

    config = get_preset("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=96)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 128, (2, 8), generator=gen).to(DEVICE) for _ in range(2))
    runs = []
    for fused in (False, True):
        model = build_model(config, seed=1).to(DEVICE)
        n = set_fused_kernels(model, fused)
        loss = cross_entropy_loss(model(tokens), targets)
        loss.backward()
        runs.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    assert n == 2 * 2 + 1 + 2  # two norms per layer, the final norm, one FFN per layer
    (ref_loss, ref_grads), (loss, grads) = runs
    _assert_close(loss, ref_loss, torch.float32, "loss")
    for k in ref_grads:
        _assert_close(grads[k], ref_grads[k], torch.float32, f"{k}.grad")
