"""Fused RoPE on q and k, and the residual add + RMSNorm, against their references, forward
and backward, float32 and bfloat16.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before the first
kernel is built). Tolerances: float32 1e-5 relative (+1e-6 absolute); bfloat16 2e-2 relative
(+2e-2 absolute): the kernels round once where the references round twice (the RMSNorm's
weight multiply), RoPE rounds once everywhere. The complex-multiply RoPE is the CPU path.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e .[dev]")

from meshspeed.kernels.add_norm import add_rms_norm_fused, add_rms_norm_ref  # noqa: E402
from meshspeed.kernels.rope import rope_qk_complex, rope_qk_fused, rope_qk_ref  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rnd(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _run(fn, inputs, grads, n_diff):
    """Outputs and the gradients of the first n_diff inputs for output gradients `grads`."""
    leaves = [t.detach().clone().requires_grad_(i < n_diff) for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [t.grad for t in leaves[:n_diff]]


def _close(got, want, dtype, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        err = (a.float() - b.float()).abs().max().item()
        assert torch.allclose(a.float(), b.float(), **TOL[dtype]), f"{what}[{i}]: max err {err}"


def _tables(*shape):
    angles = _rnd(9, *shape) * 3
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_sample", [False, True])  # [seq, d/2] or [batch, seq, d/2] tables
def test_rope_qk_matches_reference(dtype, per_sample):
    # 6 query heads, 2 kv heads (neither a power of two's block: masked lanes), head_dim 12
    q, k = _rnd(1, 2, 5, 6, 12, dtype=dtype), _rnd(2, 2, 5, 2, 12, dtype=dtype)
    cos, sin = _tables(2, 5, 6) if per_sample else _tables(5, 6)
    g = [_rnd(3, *q.shape, dtype=dtype), _rnd(4, *k.shape, dtype=dtype)]
    want, want_grads = _run(rope_qk_ref, [q, k, cos, sin], g, 2)
    for fn in (rope_qk_fused, rope_qk_complex):
        got, got_grads = _run(fn, [q, k, cos, sin], g, 2)
        _close(got, want, dtype, f"{fn.__name__} out")
        _close(got_grads, want_grads, dtype, f"{fn.__name__} grads")


def test_rope_kernel_rotates_pairs_not_halves():
    # a planted rotate-half layout or a wrong sign in the backward rotation must show
    q = torch.zeros(1, 1, 1, 4, device=DEVICE)
    q[..., 0] = 1.0
    cos, sin = torch.zeros(1, 2, device=DEVICE), torch.ones(1, 2, device=DEVICE)  # 90 degrees
    out, _ = rope_qk_fused(q, q.clone(), cos, sin)
    assert out.flatten().tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96])  # 96: not a power of two
def test_add_rms_norm_matches_reference(dtype, dim):
    x, r = _rnd(1, 2, 5, dim, dtype=dtype) * 3, _rnd(2, 2, 5, dim, dtype=dtype)
    w = 1 + 0.1 * _rnd(3, dim, dtype=dtype)
    g = [_rnd(4, 2, 5, dim, dtype=dtype), _rnd(5, 2, 5, dim, dtype=dtype)]  # d h, d y
    want, want_grads = _run(lambda a, b, c: add_rms_norm_ref(a, b, c, 1e-5), [x, r, w], g, 3)
    got, got_grads = _run(lambda a, b, c: add_rms_norm_fused(a, b, c, 1e-5), [x, r, w], g, 3)
    _close(got, want, dtype, "add_rms_norm (h, y)")
    _close(got_grads, want_grads, dtype, "add_rms_norm (dx, dresidual, dweight)")


def test_model_with_every_triton_site_matches_reference_model():
    from meshspeed.models import build_model, cross_entropy_loss, get_preset
    from meshspeed.models.layers import set_kernels

    config = get_preset("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=96)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 128, (2, 8), generator=gen).to(DEVICE) for _ in range(2))
    runs = []
    for impl in ("ref", "triton"):
        model = build_model(config, seed=1).to(DEVICE)
        sites = set_kernels(model, lambda op, shape, dtype: impl, 2, 8, torch.float32)
        loss = cross_entropy_loss(model(tokens), targets)
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert sites == {"rms_norm": 5, "swiglu": 2, "rope": 2}
    (ref_loss, ref_grads), (loss, grads) = runs
    _close([loss, *grads], [ref_loss, *ref_grads], torch.float32, "loss, grads")
